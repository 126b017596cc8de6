"""Issue 14: each setting where the project follows the paper (arXiv 2602.15620) rather than a shortcut.

Here: the random control's draws lie in S2T's candidate pool; the +1/-1 exact-match reward on a
table of answers. Elsewhere: GRPO against a float64 reference written from the DeepSeekMath
formula (tests/method/test_objective.py); the warm-up schedule in training steps from lr 0
(tests/trainer/test_lr.py); "exact" tau_H equals a from-scratch computation on the current
weights and the frozen reference of GRPO's KL holds the initial weights
(tests/integration/test_paper_fidelity_megatron.py).
"""

import dataclasses

import pytest
import torch

from stapo_megatron.method import masks
from stapo_megatron.method.config import LossConfig
from stapo_megatron.mcore.loss import loss_func, minibatch_threshold
from stapo_megatron.rewards.functions import REWARDS, boxed_exact_match, get_reward, normalize_answer
from stapo_megatron.rewards.answers import STATUS_OK, STATUS_UNPARSEABLE
from stapo_megatron.rewards.scorer import RewardScorer
from tests.helpers.spiky_batch import _spiky_batch


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
