"""Issue 14: each setting where the project follows the paper (arXiv 2602.15620) rather than a shortcut.

GRPO against a float64 reference written from the DeepSeekMath formula; the random control's
draws lie in S2T's candidate pool; the +1/-1 exact-match reward on a table of answers; the
warm-up schedule in training steps from lr 0; "exact" tau_H equals a from-scratch computation on
the current weights; the frozen reference of GRPO's KL holds the initial weights.
"""

import dataclasses
import math

import pytest
import torch

from stapo_megatron.method import masks
from stapo_megatron.method.config import LossConfig
from stapo_megatron.mcore.loss import loss_func, minibatch_threshold
from stapo_megatron.method.config import method_loss_config
from stapo_megatron.method.objective import PolicyLossConfig, policy_loss
from stapo_megatron.rewards.functions import REWARDS, boxed_exact_match, get_reward, normalize_answer
from stapo_megatron.rewards.answers import STATUS_OK, STATUS_UNPARSEABLE
from stapo_megatron.rewards.scorer import RewardScorer
from stapo_megatron.trainer.lr import warmup_lr
from tests.helpers.dist_utils import run_distributed
from tests.mcore.test_loss import _spiky_batch

# -- (1) GRPO: DeepSeekMath's objective -----------------------------------------------------------


def grpo_reference(logprob, old, ref, adv_B, mask, eps=0.2, beta=0.04):
    """-J_GRPO in float64, written from DeepSeekMath (Shao et al. 2024, Eq. 3), one sequence at a time:
    J = 1/G sum_i 1/|o_i| sum_t [min(r A_i, clip(r, 1-eps, 1+eps) A_i) - beta (pi_ref/pi - log(pi_ref/pi) - 1)]."""
    total, num_sequences = 0.0, 0
    for i in range(logprob.shape[0]):
        terms = []
        for t in range(logprob.shape[1]):
            if not mask[i, t]:
                continue
            lp, lo, lr, a = (float(x[i, t]) for x in (logprob, old, ref, adv_B[:, None].expand_as(logprob)))
            r = math.exp(lp - lo)
            surrogate = min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
            kl = math.exp(lr - lp) - (lr - lp) - 1
            terms.append(surrogate - beta * kl)
        if terms:
            total += sum(terms) / len(terms)
            num_sequences += 1
    return -total / num_sequences


def _grpo_inputs(B=6, S=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, S, generator=gen, dtype=torch.float64) * 4
    logprob = old + torch.randn(B, S, generator=gen, dtype=torch.float64) * 0.4  # ratios well outside 1 +- 0.2
    ref = old + torch.randn(B, S, generator=gen, dtype=torch.float64) * 0.3
    adv_B = torch.randn(B, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([9, 2, 5, 0, 7, 1])  # unequal lengths (and an empty one) tell the means apart
    mask = torch.arange(S)[None, :] < lengths[:, None]
    return logprob, old, ref, adv_B, mask


def test_grpo_loss_equals_the_deepseekmath_formula_in_float64():
    logprob, old, ref, adv_B, mask = _grpo_inputs()
    config = method_loss_config("grpo")
    assert (config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c, config.kl_coef) == (0.2, 0.2, None, 0.04)
    adv = adv_B[:, None].expand_as(logprob)
    # two "micro-batches": Megatron adds their sums and their normalisers, then divides
    grpo = PolicyLossConfig(config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c, config.kl_coef,
                            loss_agg="seq_mean_token_mean")
    parts = [policy_loss(logprob[rows], old[rows], adv[rows], mask[rows], torch.zeros_like(mask[rows]), grpo,
                         ref[rows])
             for rows in (slice(0, 4), slice(4, 6))]
    loss = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    assert sum(int(p[1]) for p in parts) == 5  # sequences with a response token
    expected = grpo_reference(logprob, old, ref, adv_B, mask)
    # the objective runs in fp32 (inputs are cast): fp32 rounding of exp / sums of ~50 terms
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    token_mean, num_tokens = policy_loss(logprob, old, adv, mask, torch.zeros_like(mask),
                                         PolicyLossConfig(0.2, 0.2, None, 0.04), ref)
    assert abs(token_mean.item() / num_tokens.item() - expected) > 1e-2, "the aggregation must matter here"


def test_grpo_gradient_matches_the_float64_formula():
    logprob, old, ref, adv_B, mask = _grpo_inputs(seed=1)
    x = logprob.clone().requires_grad_()
    loss_sum, num = policy_loss(x, old, adv_B[:, None].expand_as(x), mask, torch.zeros_like(mask),
                                PolicyLossConfig(0.2, 0.2, None, 0.04, "seq_mean_token_mean"), ref)
    (loss_sum / num).backward()
    x64 = logprob.clone().requires_grad_()
    # the same formula vectorised in float64, for autograd
    r = torch.exp(x64 - old)
    adv = adv_B[:, None].expand_as(x64)
    surrogate = torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
    kl = torch.exp(ref - x64) - (ref - x64) - 1
    per_token = torch.where(mask, surrogate - 0.04 * kl, 0.0)
    lengths = mask.sum(-1)
    j = (per_token.sum(-1)[lengths > 0] / lengths[lengths > 0]).mean()
    (-j).backward()
    # fp32 forward/backward against float64: relative rounding ~1e-7 of O(1) gradients
    torch.testing.assert_close(x.grad, x64.grad, atol=1e-6, rtol=1e-5)


def test_grpo_without_a_reference_is_refused():
    logprob, old, ref, adv_B, mask = _grpo_inputs()
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logprob"):
        policy_loss(logprob, old, adv_B[:, None].expand_as(logprob), mask, torch.zeros_like(mask),
                    PolicyLossConfig(kl_coef=0.04, loss_agg="seq_mean_token_mean"))
    with pytest.raises(ValueError, match=r"loss_agg must be one of \('token_mean', 'seq_mean_token_mean'\)"):
        policy_loss(logprob, old, adv_B[:, None].expand_as(logprob), mask, torch.zeros_like(mask),
                    PolicyLossConfig(loss_agg="seq"))


def test_grpo_loss_func_normalises_by_sequences():
    logits, logprob, entropy, batch = _spiky_batch()
    config = method_loss_config("grpo")
    ref = batch.old_logprob - 0.1
    loss_sum, normaliser, metrics = loss_func(config, dataclasses.replace(batch, ref_logprob=ref), torch.tensor(float("nan")),
                                              None, None, logits)
    mask = batch.response_mask
    assert normaliser.item() == mask.shape[0]  # every row has response tokens
    assert metrics["stapo_sums"][1].item() == mask.sum().item()  # num_kept still counts tokens
    # on-policy ratio 1: per sequence -A + beta * k3(ref - logp = -0.1), the same for every token
    k3 = math.exp(-0.1) + 0.1 - 1
    adv_B = batch.advantages[:, 0]
    assert loss_sum.item() == pytest.approx((-adv_B + 0.04 * k3).sum().item(), abs=1e-5)


# -- (2) the random control draws from S2T's candidate pool ----------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_random_control_draws_lie_in_the_candidate_pool(seed):
    logits, logprob, entropy, batch = _spiky_batch(seed=seed)
    mask, adv = batch.response_mask, batch.advantages
    config = LossConfig(method="random", seed=seed)
    threshold = minibatch_threshold(config, logprob, entropy, adv, mask)
    candidates = masks.s2t_candidates(logprob, adv, mask)
    stapo = masks.s2t_mask(logprob, entropy, adv, mask, tau_h=threshold)
    assert stapo.sum() > 0 and candidates.sum() > stapo.sum(), "the pool must be larger than what S2T takes"
    drawn = None
    for micro_seed in range(5):
        _, _, metrics = loss_func(config, dataclasses.replace(batch, seed=micro_seed), threshold, None, None, logits)
        rows = metrics["silenced_tokens"]  # (label id, log p, H, A) of the silenced tokens
        assert len(rows) == stapo.sum().item(), "as many tokens as S2T silences"
        assert (rows[:, 3] > 0).all() and (rows[:, 1].exp() < config.tau_p).all(), "every draw is a candidate"
        # the same draw as a mask (the method's seed: config.seed * 1_000_003 + the micro-batch's)
        draw = masks.random_mask(candidates, int(stapo.sum()), seed * 1_000_003 + micro_seed)
        assert not (draw & ~candidates).any()
        torch.testing.assert_close(rows[:, 0], batch.labels[draw].float())
        drawn = draw if drawn is None else drawn | draw
    assert (drawn & ~stapo).any(), "the draws are random, not S2T's own choice"


def test_random_uniform_keeps_the_old_control():
    logits, logprob, entropy, batch = _spiky_batch()
    mask, adv = batch.response_mask, batch.advantages
    config = LossConfig(method="random_uniform")
    threshold = minibatch_threshold(config, logprob, entropy, adv, mask)
    num = int(masks.s2t_mask(logprob, entropy, adv, mask, tau_h=threshold).sum())
    _, _, metrics = loss_func(config, dataclasses.replace(batch, seed=3), threshold, None, None, logits)
    expected = masks.random_mask(mask, num, seed=3)
    assert len(metrics["silenced_tokens"]) == num == expected.sum()
    assert (metrics["silenced_tokens"][:, 3] < 0).any(), "draws from all response tokens, A < 0 included"


# -- (3) rewards ----------------------------------------------------------------------------------

EXACT_MATCH_TABLE = [
    # response, reference, reward
    ("so \\boxed{42}", "42", 1.0),
    ("\\boxed{41} then \\boxed{42}", "42", 1.0),  # the last box counts
    ("\\boxed{42} then \\boxed{41}", "42", -1.0),
    ("\\boxed{ 42 }", "42", 1.0),  # spaces
    ("\\boxed{100,000}", "100000", 1.0),  # thousands separator of an integer
    ("\\boxed{\\frac12}", "\\frac{1}{2}", 1.0),  # TeX shorthand
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", -1.0),  # exact match, not equivalence (math_verify: 1)
    ("\\boxed{0.5}", "\\frac{1}{2}", -1.0),
    ("\\boxed{x = 5}", "5", 1.0),  # right-hand side of the last "="
    ("\\boxed{5 \\text{ dollars}}", "5", 1.0),  # units dropped
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{\\text{(A)}}", "(A)", 1.0),
    ("\\boxed{$7$}", "7", 1.0),
    ("no box: 42", "42", -1.0),
    ("\\boxed{42", "42", -1.0),  # unfinished box
    ("\\boxed{42}", "\\boxed{42}", 1.0),  # a boxed reference
    ("\\boxed{42}", "$42$", 1.0),
    ("\\boxed{-3}", "3", -1.0),
]


@pytest.mark.parametrize("response, answer, reward", EXACT_MATCH_TABLE)
def test_boxed_exact_match_table(response, answer, reward):
    got, status = boxed_exact_match(response, answer)
    assert got == reward
    assert status == (STATUS_UNPARSEABLE if response in ("no box: 42", "\\boxed{42") else STATUS_OK)


def test_normalize_answer_examples():
    assert normalize_answer("x = \\frac12") == "\\frac{1}{2}"
    assert normalize_answer("\\text{Monday}") == "Monday"
    # Minerva's rule drops the commas of any digits-and-commas answer, a list of integers too
    # (DAPO's reward inherits this): "1,2" and "12" match
    assert normalize_answer("1,2") == "12"


def test_reward_registry_and_dotted_paths():
    assert tuple(REWARDS) == ("math_verify", "boxed_exact_match")
    assert (REWARDS["math_verify"].failure_reward, REWARDS["boxed_exact_match"].failure_reward) == (0.0, -1.0)
    plugged = get_reward("stapo_megatron.rewards.functions.boxed_exact_match")
    assert plugged.score_fn is boxed_exact_match and plugged.failure_reward == 0.0
    with pytest.raises(ValueError, match=r"reward must be one of \('math_verify', 'boxed_exact_match'\) or a "
                                         r"dotted path module.function, got 'exact'"):
        get_reward("exact")
    with pytest.raises(ValueError, match="reward = 'stapo_megatron.nope.f' does not name an importable object"):
        get_reward("stapo_megatron.nope.f")
    with pytest.raises(ValueError, match="names float, not a function"):
        get_reward("math.pi")


def test_scorer_runs_the_chosen_reward_in_its_workers():
    reward = get_reward("boxed_exact_match")
    with RewardScorer(num_workers=1, timeout_s=5.0, score_fn=reward.score_fn,
                      failure_reward=reward.failure_reward) as scorer:
        rewards, stats = scorer.score(["\\boxed{\\dfrac{1}{2}}", "\\boxed{7}", "none"], ["\\frac{1}{2}", "7", "1"])
    assert rewards == [-1.0, 1.0, -1.0]
    assert stats["num_unparseable"] == 1


# -- (4) warm-up in training steps from lr 0 ------------------------------------------------------


def test_warmup_counts_training_steps_from_zero():
    lrs = [warmup_lr(step, 1e-6, 10) for step in range(13)]
    assert lrs == pytest.approx([1e-6 * s / 10 for s in range(10)] + [1e-6] * 3, rel=1e-12, abs=0)
    assert lrs[0] == 0.0  # veRL's first step trains at lr 0
    assert [warmup_lr(step, 1e-3, 0) for step in range(3)] == [1e-3] * 3


# -- (5) "exact" tau_H and (1) the frozen reference, on a real Megatron model ---------------------

VOCAB, PROMPT, RESPONSE, MBS = 512, 4, 12, 2


def _from_scratch_tau_h(model, mbs, tau_p, q):
    """tau_H from a plain forward of ``model`` with the full-vocabulary float64 softmax."""
    entropies = []
    with torch.no_grad():
        for mb in mbs:
            logits = model(mb.tokens, mb.position_ids, attention_mask=None).double()
            logp_V = torch.log_softmax(logits, dim=-1)
            logprob = logp_V.gather(-1, mb.labels[..., None]).squeeze(-1)
            entropy = -(logp_V.exp() * logp_V).sum(-1)
            candidates = (mb.advantages > 0) & (logprob.exp() < tau_p) & mb.response_mask
            entropies.append(entropy[candidates])
    pooled = torch.cat(entropies)
    return torch.quantile(pooled, q).item(), pooled.numel()


def _exact_and_reference_worker():
    from functools import partial

    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.mcore.reference import add_reference_logprobs, frozen_copy
    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.schedule import PassContext, compute_logprob_entropy, old_policy_pass
    from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
    from stapo_megatron.recipes.synthetic import build_tiny_gpt, synthetic_rollouts, tiny_gpt_config

    groups = init_parallel(1, 1)
    build = partial(build_tiny_gpt, tiny_gpt_config(), VOCAB, PROMPT + RESPONSE)
    model = build()
    reference = frozen_copy(model, build)
    model, optimizer = wrap_model_and_optimizer(model, OptimConfig(optimizer="sgd", lr=5.0, weight_decay=0.0,
                                                                   clip_grad=0.0))
    seq = PROMPT + RESPONSE
    mbs, _ = synthetic_rollouts(4, 4, PROMPT, RESPONSE, VOCAB, seed=0, micro_batch_size=MBS)
    minis = [mbs[:4], mbs[4:]]
    ctx = PassContext(model, seq, groups=groups)
    old_policy_pass(ctx, minis)
    add_reference_logprobs(PassContext(reference, seq), minis)
    exact = LossConfig(method="stapo", tau_h_source="exact")
    first = policy_update(ctx, optimizer, minis[0], exact).metrics
    # the second mini-batch, after the first one's update: what "exact" and "old" see now
    scratch = _from_scratch_tau_h(model.module, minis[1], exact.tau_p, exact.entropy_quantile)
    old_tau = minibatch_threshold(exact, *(torch.cat([x.reshape(-1) for x in xs]) for xs in (
        [mb.old_logprob for mb in minis[1]], [mb.old_entropy for mb in minis[1]], [mb.advantages for mb in minis[1]],
        [mb.response_mask for mb in minis[1]]))).item()
    second = policy_update(ctx, optimizer, minis[1], exact).metrics
    # GRPO with its KL on the moved policy: the loss path reads ref_logprob
    grpo = policy_update(ctx, optimizer, minis[1], method_loss_config("grpo")).metrics
    ref_vs_old = max((mb.ref_logprob - mb.old_logprob).abs().max().item() for m in minis for mb in m)
    fresh = compute_logprob_entropy(ctx, minis[1])
    moved = max((lp - mb.ref_logprob).abs().max().item() for (lp, _), mb in zip(fresh, minis[1]))
    return first, second, scratch, old_tau, grpo, ref_vs_old, moved


@pytest.fixture(scope="module")
def exact_run():
    return run_distributed(1, _exact_and_reference_worker)[0]


# slow: one spawned process builds a Megatron model and runs four updates (~40 s on a shared
# 2-core CPU, almost all of it importing megatron-core and initialising the process group)


