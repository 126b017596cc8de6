"""The objectives of ``method/objectives.py`` against verl's core_algos and float64 references.

verl: the formulas of verl 0.9.1 (PyPI ``verl==0.9.1``), ``verl/trainer/ppo/core_algos.py``
(sha256 a54b6d812db4441e...):
``compute_policy_loss_vanilla`` (dual clip), ``compute_policy_loss_gspo``, ``compute_policy_loss_cispo``,
``compute_policy_loss_clip_cov``, ``compute_policy_loss_kl_cov`` and ``agg_loss``. That module cannot be
imported with this project's packages (``verl/__init__`` imports ray, ``verl.utils`` tensordict), so the
``verl_*`` functions below restate those functions operation by operation (masked means with verl's
+1e-8, its clamps, its aggregation), per micro-batch [B, T] with verl's ``response_mask`` = our kept
tokens. When written, these restatements gave bit-identical losses and gradients to verl 0.9.1's own
functions on the inputs of `test_loss_and_gradient_match_verl` (core_algos.py loaded from the installed
wheel with its package imports stubbed; float64 and float32). The paper references below are written
independently from the papers' formulas.
"""

import dataclasses

import pytest
import torch

from stapo_megatron.method.config import LossConfig, method_loss_config
from stapo_megatron.method.objective import PolicyLossConfig, PolicyTokens, policy_loss
from stapo_megatron.method.objectives import (OBJECTIVES, clip_cov_generator, clip_cov_token_loss, get_objective,
                                              kl_cov_token_loss)

F64 = torch.float64

# -- verl 0.9.1, restated --------------------------------------------------------------------------


def verl_agg(loss_mat, mask, mode):
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (torch.where(mask.bool(), loss_mat, 0.0) * mask).sum() / mask.sum()
    seq_len = mask.sum(-1)
    seq_loss = (loss_mat * mask).sum(-1) / (seq_len + 1e-8)
    seq_mask = (seq_len > 0).to(loss_mat.dtype)
    return (torch.where(seq_mask.bool(), seq_loss, 0.0) * seq_mask).sum() / seq_mask.sum()


def verl_masked_mean(x, mask):
    return (torch.where(mask, x, 0.0) * mask).sum() / (mask.sum() + 1e-8)


def verl_vanilla(old, lp, adv, mask, lo, hi, c):
    ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - lo, 1 + hi)
    clip1 = torch.maximum(l1, l2)
    return torch.where(adv < 0, torch.min(-adv * c, clip1), clip1), "token-mean"


def verl_gspo(old, lp, adv, mask, lo, hi):
    m = mask.to(lp.dtype)
    seq_kl = ((lp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    ratio = torch.exp(torch.clamp(lp - lp.detach() + seq_kl.detach()[:, None], max=10.0))
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - lo, 1 + hi)), "seq-mean-token-mean"


def verl_cispo(old, lp, adv, mask, lo, hi):
    ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    return -torch.clamp(ratio, 1 - lo, 1 + hi).detach() * adv * lp, "token-mean"


def verl_clip_cov(old, lp, adv, mask, lo, hi, cov_ratio, lb, ub, generator):
    ratio = torch.exp(lp - old)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - lo, 1 + hi)
    cov = (adv - verl_masked_mean(adv, mask)) * (lp - verl_masked_mean(lp.detach(), mask))
    cov = cov.detach().masked_fill(~mask | ((l2 > l1) & mask), -torch.inf)
    clip_num = max(int(cov_ratio * mask.sum().item()), 1)
    idx = torch.nonzero((cov < ub) & (cov > lb) & mask)
    idx = idx[torch.randperm(len(idx), generator=generator)[: min(clip_num, len(idx))]]
    corr = torch.ones_like(adv)
    corr[idx[:, 0], idx[:, 1]] = 0
    return torch.maximum(l1, l2) * corr, "token-mean"


def verl_kl_cov(old, lp, adv, mask, kl_ratio, coef):
    log_r = lp - old
    loss = -adv * torch.exp(log_r)
    loss_kl = -adv * torch.exp(log_r) + coef * log_r.abs()
    valid_idx = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]
    a, p = adv[mask].detach(), lp[mask].detach()
    cov = (a - a.mean()) * (p - p.mean())
    top = valid_idx[torch.topk(cov, max(1, int(len(cov) * kl_ratio))).indices]
    rows, cols = top // adv.shape[1], top % adv.shape[1]
    loss = loss.clone()
    loss[rows, cols] = loss_kl[rows, cols]
    return loss, "token-mean"


# -- inputs and our pipeline ----------------------------------------------------------------------


def _inputs(dtype, seed=0, B=6, T=24):
    """Random log-probs with clipped and unclipped ratios, per-sequence advantages, prompts,
    ragged responses, a fully masked row, and some silenced tokens."""
    g = torch.Generator().manual_seed(seed)
    lp = -(torch.rand(B, T, generator=g, dtype=F64) * 4 + 0.01)
    old = lp + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T).contiguous()
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        start, end = 2 + b % 3, T - (b * 5) % 7
        mask[b, start:end] = True
    mask[3] = False
    silenced = mask & (torch.rand(B, T, generator=g) < 0.1)
    return lp.to(dtype).requires_grad_(), old.to(dtype), adv.to(dtype), mask, silenced


def _ours(name, config, lp, old, adv, mask, silenced, sequence_ids=None, seed=5, is_weight=None):
    objective = get_objective(name)
    policy = PolicyLossConfig(config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c,
                              loss_agg=objective.loss_agg, token_loss=objective.build(config, sequence_ids, None, seed))
    loss_sum, normaliser = policy_loss(PolicyTokens(lp, old, adv, mask, silenced, is_weight=is_weight,
                                                    sequence_ids=sequence_ids), policy)
    return loss_sum / normaliser


CONFIGS = {
    "dual_clip": LossConfig(objective="dual_clip", clip_ratio_c=3.0),
    "gspo": LossConfig(objective="gspo", clip_ratio_low=0.02, clip_ratio_high=0.03),
    "cispo": LossConfig(objective="cispo"),
    "clip_cov": LossConfig(objective="clip_cov", clip_cov_ratio=0.05, clip_cov_lower=0.2),
    "clip_cov_defaults": LossConfig(objective="clip_cov"),
    "kl_cov": LossConfig(objective="kl_cov", kl_cov_ratio=0.05, kl_cov_coef=0.7),
}


def _verl(key, config, lp, old, adv, keep, seed=5, is_weight=None):
    """verl's loss: the function's loss matrix, times ``rollout_is_weights``, through ``agg_loss``."""
    loss, mode = _verl_matrix(key, config, lp, old, adv, keep, seed)
    return verl_agg(loss if is_weight is None else loss * is_weight, keep, mode)


def _verl_matrix(key, config, lp, old, adv, keep, seed):
    c = config
    if key == "dual_clip":
        return verl_vanilla(old, lp, adv, keep, c.clip_ratio_low, c.clip_ratio_high, c.clip_ratio_c)
    if key == "gspo":
        return verl_gspo(old, lp, adv, keep, c.clip_ratio_low, c.clip_ratio_high)
    if key == "cispo":
        return verl_cispo(old, lp, adv, keep, c.clip_ratio_low, c.clip_ratio_high)
    if key.startswith("clip_cov"):
        return verl_clip_cov(old, lp, adv, keep, c.clip_ratio_low, c.clip_ratio_high, c.clip_cov_ratio,
                             c.clip_cov_lower, c.clip_cov_upper, clip_cov_generator(c, seed))
    return verl_kl_cov(old, lp, adv, keep, c.kl_cov_ratio, c.kl_cov_coef)


def _loss_and_grad(fn, lp):
    loss = fn(lp)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad


TOL = {
    # verl's sequence mean divides by |o_i| + 1e-8 (ours by |o_i|): ~1e-9 relative for GSPO; the rest agree to 1e-15
    F64: dict(rtol=1e-7, atol=1e-10),
    # float32 rounding of sums over ~100 tokens in a different order
    torch.float32: dict(rtol=2e-5, atol=1e-6),
}


@pytest.mark.parametrize("weighted", [False, True], ids=["", "tis"])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("key", list(CONFIGS))
def test_loss_and_gradient_match_verl(key, dtype, weighted):
    """``weighted``: a truncated-IS rollout correction's weights (``rollout_is_weights`` in verl)."""
    config = CONFIGS[key]
    lp, old, adv, mask, silenced = _inputs(dtype)
    keep = mask & ~silenced
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(9), dtype=F64).to(dtype) * 2 if weighted else None
    ours = _loss_and_grad(lambda x: _ours(config.objective, config, x, old, adv, mask, silenced, is_weight=w), lp)
    ref = _loss_and_grad(lambda x: _verl(key, config, old=old, lp=x, adv=adv, keep=keep, is_weight=w), lp)
    assert ours[0].dtype == dtype
    torch.testing.assert_close(ours[0], ref[0], **TOL[dtype])
    torch.testing.assert_close(ours[1], ref[1], **TOL[dtype])
    assert ours[1][~keep].abs().max() == 0 and ours[1][keep].abs().max() > 0  # masked tokens get no gradient


@pytest.mark.parametrize("key", list(CONFIGS))
def test_packed_rows_equal_padded_rows(key):
    """One packed row (the six sequences end to end, ``sequence_ids``) gives the padded batch's
    loss and gradient: GSPO's sequence ratio and mean are per sequence, not per row."""
    config = CONFIGS[key]
    lp, old, adv, mask, silenced = _inputs(F64, seed=1)
    B, T = lp.shape
    ids = torch.arange(B).repeat_interleave(T)[None]
    padded = _loss_and_grad(lambda x: _ours(config.objective, config, x, old, adv, mask, silenced), lp)
    packed = _loss_and_grad(lambda x: _ours(config.objective, config, x.reshape(1, -1), old.reshape(1, -1),
                                            adv.reshape(1, -1), mask.reshape(1, -1), silenced.reshape(1, -1), ids), lp)
    # the same float64 sums, accumulated per sequence either way: agreement to rounding
    torch.testing.assert_close(packed[0], padded[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(packed[1], padded[1], rtol=1e-12, atol=1e-14)


# -- float64 references from the papers ----------------------------------------------------------


def test_gspo_is_the_papers_sequence_objective():
    """GSPO (arXiv 2507.18071, Eq. 5-7): J = 1/G sum_i min(s_i A_i, clip(s_i) A_i) with
    s_i = (pi_theta(y_i) / pi_old(y_i))^(1/|y_i|), differentiated through s_i itself."""
    config = CONFIGS["gspo"]
    lp, old, adv, mask, silenced = _inputs(F64, seed=5)
    keep = mask & ~silenced

    def paper(x):
        terms = []
        for b in range(x.shape[0]):
            if keep[b].any():
                s = torch.exp((x[b] - old[b])[keep[b]].mean())
                a = adv[b, 0]
                terms.append(-torch.min(s * a, s.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high) * a))
        return torch.stack(terms).mean()

    ours = _loss_and_grad(lambda x: _ours("gspo", config, x, old, adv, mask, silenced), lp)
    ref = _loss_and_grad(paper, lp)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-12, atol=1e-14)
    # some sequences clipped (zero gradient), some not
    clipped = [b for b in range(6) if keep[b].any() and ours[1][b].abs().max() == 0]
    assert 0 < len(clipped) < int(keep.any(-1).sum())


def test_cispo_gradient_is_the_clipped_weight_times_advantage():
    """CISPO (MiniMax-M1 Eq. 4): d(-J)/d log pi_t = -clip(r_t) A_t / N for every kept token,
    clipped or not (the clip bounds the weight, it never removes the gradient)."""
    config = CONFIGS["cispo"]
    lp, old, adv, mask, silenced = _inputs(F64, seed=3)
    keep = mask & ~silenced
    loss, grad = _loss_and_grad(lambda x: _ours("cispo", config, x, old, adv, mask, silenced), lp)
    r = torch.exp(lp.detach() - old)
    w = r.clamp(0.8, 1.28)
    assert bool(((r < 0.8) | (r > 1.28))[keep].any())
    torch.testing.assert_close(grad, torch.where(keep, -w * adv / keep.sum(), 0.0), rtol=1e-12, atol=0.0)
    torch.testing.assert_close(loss, -(w * adv * lp.detach())[keep].sum() / keep.sum(), rtol=1e-12, atol=0.0)


def test_dual_clip_by_hand():
    """Ye et al. 2020 (Eq. 5), token by token: for A < 0 the loss is min(max(-rA, -clip(r)A), -cA)."""
    config = LossConfig(objective="dual_clip", clip_ratio_c=1.5)
    lp, old, adv, mask, silenced = _inputs(F64, seed=4)
    lp, keep = lp.detach(), mask & ~silenced
    total, count = 0.0, 0
    for b, t in keep.nonzero().tolist():
        r, a = float(torch.exp(lp[b, t] - old[b, t])), float(adv[b, t])
        loss = max(-r * a, -min(max(r, 0.8), 1.28) * a)
        total, count = total + (min(loss, -1.5 * a) if a < 0 else loss), count + 1
    ours = _ours("dual_clip", config, lp, old, adv, mask, silenced)
    assert ours.item() == pytest.approx(total / count, rel=1e-12)
    assert any(-1.5 * float(a) < max(-float(torch.exp(lp[b, t] - old[b, t])) * float(a), 0) and float(a) < 0
               for (b, t), a in zip(keep.nonzero().tolist(), adv[keep]))  # the dual bound was active


def test_kl_cov_penalises_the_top_covariance_tokens():
    """KL-Cov (arXiv 2505.22617, Eq. 13): the k = max(1, int(ratio N)) kept tokens of largest
    (A - mean A)(log pi - mean log pi) get |log r| added, with no ratio clip anywhere."""
    lp, old, adv, mask, _ = _inputs(F64, seed=5)
    lp = lp.detach()
    cells = mask.nonzero().tolist()
    a_mean = sum(float(adv[b, t]) for b, t in cells) / len(cells)
    p_mean = sum(float(lp[b, t]) for b, t in cells) / len(cells)
    cov = sorted(((float(adv[b, t]) - a_mean) * (float(lp[b, t]) - p_mean), b, t) for b, t in cells)
    k = int(len(cells) * 0.1)
    top = {(b, t) for _, b, t in cov[-k:]}
    loss = kl_cov_token_loss(lp, old, adv, mask, ratio=0.1, kl_coef=2.0)
    for b, t in cells:
        base = -float(adv[b, t]) * float(torch.exp(lp[b, t] - old[b, t]))
        extra = 2.0 * abs(float(lp[b, t] - old[b, t])) if (b, t) in top else 0.0
        assert float(loss[b, t]) == pytest.approx(base + extra, rel=1e-12, abs=1e-15)


def test_clip_cov_drops_eligible_tokens_only():
    """Clip-Cov (arXiv 2505.22617, Eq. 11): exactly min(max(1, int(ratio N)), eligible) kept
    tokens lose their term, all of them unclipped with lb < cov < ub; the rest keep the dapo loss."""
    lp, old, adv, mask, _ = _inputs(F64, seed=6)
    lp = lp.detach()
    full = clip_cov_token_loss(lp, old, adv, mask, ratio=1.0, lower=-1e9, upper=1e9)  # every unclipped token
    some = clip_cov_token_loss(lp, old, adv, mask, ratio=0.1, lower=0.2, upper=5.0,
                               generator=torch.Generator().manual_seed(0))
    dapo = clip_cov_token_loss(lp, old, adv, mask, ratio=1e-9, lower=1e8, upper=1e9)  # nothing eligible
    n = int(mask.sum())
    dropped = mask & (some != dapo)
    assert int(dropped.sum()) == int(0.1 * n) and bool((some[dropped] == 0).all())
    ratio = torch.exp(lp - old)
    clipped = (-adv * ratio.clamp(0.8, 1.28)) > (-adv * ratio)
    assert not bool((dropped & clipped).any())
    assert bool((full[mask & ~clipped] == 0).all()) and bool((full[mask & clipped] == dapo[mask & clipped]).all())


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_loss_func_applies_the_s2t_mask_to_the_objective(name):
    """``loss.method=stapo loss.objective=NAME`` through Megatron's loss_func: the S2T mask of
    the micro-batch on NAME's loss, as `policy_loss` computes it from the same tensors."""
    from tests.helpers.spiky_batch import _spiky_batch
    from stapo_megatron.method import masks as s2t
    from stapo_megatron.mcore.loss import loss_func, minibatch_threshold

    logits, logprob, entropy, batch = _spiky_batch()
    gen = torch.Generator().manual_seed(1)
    old_logprob = logprob.detach() + 0.2 * torch.randn(logprob.shape, generator=gen)  # off-policy: ratios != 1
    batch = dataclasses.replace(batch, seed=3, old_logprob=old_logprob)
    config = method_loss_config("stapo", objective=name, tau_p=0.002, clip_cov_ratio=0.05, kl_cov_ratio=0.05)
    config = dataclasses.replace(config, kl_coef=0.0)  # GRPO's KL needs a reference model, tested in test_loss
    mask, adv = batch.response_mask, batch.advantages
    threshold = minibatch_threshold(config, logprob, entropy, adv, mask)
    loss_sum, normaliser, metrics = loss_func(config, batch, threshold, None, None, logits)
    silenced = s2t.s2t_mask(logprob, entropy, adv, mask, tau_p=0.002, tau_h=threshold)
    assert silenced.any() and metrics["stapo_sums"][3].item() == silenced.sum().item()
    objective = get_objective(name)
    want, want_n = policy_loss(PolicyTokens(logprob, batch.old_logprob, adv, mask, silenced), PolicyLossConfig(
        config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c, loss_agg=objective.loss_agg,
        token_loss=objective.build(config, None, None, 3)))
    assert int(normaliser) == int(want_n) == (int(mask.any(-1).sum()) if objective.loss_agg != "token_mean"
                                               else int((mask & ~silenced).sum()))
    torch.testing.assert_close(loss_sum, want, rtol=1e-6, atol=1e-6)


def test_clip_fraction_counts_each_objectives_own_clip():
    """The ``clip_fraction`` metric's tokens (verl's pg_clipfrac): GSPO's by sequence ratio, CISPO's
    by clipped weight whatever the sign of A, none for KL-Cov, the PPO clip otherwise."""
    from stapo_megatron.method.objectives import clipped_tokens

    lp, old, adv, mask, silenced = _inputs(F64, seed=5)
    lp, keep = lp.detach(), mask & ~silenced
    r = torch.exp(lp - old)
    ppo = (-adv * r.clamp(0.8, 1.28)) > (-adv * r)
    assert torch.equal(clipped_tokens(LossConfig(), lp, old, adv, keep), ppo)
    assert torch.equal(clipped_tokens(CONFIGS["clip_cov"], lp, old, adv, keep), ppo)
    assert torch.equal(clipped_tokens(CONFIGS["cispo"], lp, old, adv, keep), (r < 0.8) | (r > 1.28))
    assert not clipped_tokens(CONFIGS["kl_cov"], lp, old, adv, keep).any()
    gspo = clipped_tokens(CONFIGS["gspo"], lp, old, adv, keep)
    for b in range(lp.shape[0]):
        if keep[b].any():
            s = float(torch.exp((lp[b] - old[b])[keep[b]].mean()))
            a = float(adv[b, 0])
            assert bool(gspo[b, keep[b]].all()) == (-a * min(max(s, 0.98), 1.03) > -a * s)
            assert gspo[b, keep[b]].all() or not gspo[b, keep[b]].any()  # one decision per sequence
    assert 0 < int((gspo & keep).sum()) < int(keep.sum())


# -- configuration ---------------------------------------------------------------------------------


def test_existing_methods_keep_their_objectives():
    assert {m: LossConfig(method=m).effective_objective for m in ("stapo", "justrl", "grpo", "entropy20")} == {
        "stapo": "dapo", "justrl": "dapo", "grpo": "grpo", "entropy20": "dapo"}
    assert get_objective("grpo").loss_agg == "seq_mean_token_mean" == get_objective("gspo").loss_agg
    cfg = method_loss_config("stapo", objective="gspo")
    assert (cfg.method, cfg.objective, cfg.clip_ratio_low, cfg.clip_ratio_high) == ("stapo", "gspo", 3e-4, 4e-4)
    assert method_loss_config("stapo") == LossConfig(method="stapo")
    assert method_loss_config("justrl", objective="dual_clip").clip_ratio_c == 3.0


def test_each_method_aggregates_as_its_default_objective():
    from stapo_megatron.method.registry import METHODS

    assert {m.name: m.loss_agg for m in METHODS.values()} == {
        m.name: get_objective(m.objective).loss_agg for m in METHODS.values()}


# -- user objectives (`register_objective`, `get_objective` of a dotted path) ---------------------

PLUGIN = "tests.helpers.user_objective_plugin"
"""The user's module (tests/helpers/user_objective_plugin.py)."""
FP32_TOL = 1e-5
"""fp32 loss sums of at most 96 tokens of ratio <= e and |A| <= 1."""


@pytest.fixture
def objectives(monkeypatch):
    """A private copy of `OBJECTIVES`, and the plugin imported afresh into it, so that the
    registration here leaves the built-in registry (and its order) as other tests expect it."""
    import importlib

    from stapo_megatron.method import objectives as module

    monkeypatch.setattr(module, "OBJECTIVES", dict(module.OBJECTIVES))
    importlib.reload(importlib.import_module(PLUGIN))
    return module.OBJECTIVES


def _off_policy_loss(objective):
    """(loss_sum, normaliser) of justrl on ``objective`` over the spiky batch with pi_old 0.5 nats
    below pi_theta (ratio e^0.5 ~ 1.65: the PPO clip is active for A > 0), and the ratio."""
    from stapo_megatron.mcore.loss import loss_func
    from tests.helpers.spiky_batch import _spiky_batch

    logits, logprob, _, batch = _spiky_batch()
    batch = dataclasses.replace(batch, old_logprob=logprob.detach() - 0.5)
    config = LossConfig(method="justrl", objective=objective)
    loss_sum, normaliser, _ = loss_func(config, batch, torch.tensor(float("nan")), None, None, logits)
    return loss_sum, normaliser, batch


def test_the_built_in_objectives_are_registered_in_order():
    assert list(OBJECTIVES) == ["dapo", "grpo", "dual_clip", "gspo", "cispo", "clip_cov", "kl_cov"]
    assert [(o.loss_agg, o.context_parallel) for o in OBJECTIVES.values()] == [
        ("token_mean", True), ("seq_mean_token_mean", True), ("token_mean", True), ("seq_mean_token_mean", True),
        ("token_mean", True), ("token_mean", False), ("token_mean", False)]
    assert dict(OBJECTIVES["grpo"].loss_options) == dict(clip_ratio_high=0.2, clip_ratio_c=None, kl_coef=0.04)


def test_a_decorated_objective_trains_a_loss_by_name_and_by_dotted_path(objectives):
    assert list(objectives)[-1] == "reinforce"
    objective = get_objective(f"{PLUGIN}:reinforce")
    assert objective is objectives["reinforce"] is get_objective(f"{PLUGIN}.reinforce")
    assert (objective.summary, dict(objective.loss_options), objective.loss_agg) == (
        "REINFORCE with the ratio: l_t = -r A, no clip.", {"clip_ratio_high": 0.4}, "token_mean")
    assert method_loss_config("justrl", objective=f"{PLUGIN}:reinforce").clip_ratio_high == 0.4
    for name in ("reinforce", f"{PLUGIN}:reinforce"):
        loss_sum, normaliser, batch = _off_policy_loss(name)
        # no clip: every token contributes -e^0.5 A; 4 rows of A = +1 and 4 of -1, 9 response tokens each
        assert int(normaliser) == 8 * 9 and loss_sum.item() == pytest.approx(0.0, abs=FP32_TOL)
    dapo, _, _ = _off_policy_loss("dapo")
    # the PPO clip holds A > 0 at 1.28: 36 x (-1.28) + 36 x e^0.5
    assert dapo.item() == pytest.approx(36 * (torch.exp(torch.tensor(0.5)).item() - 1.28), abs=FP32_TOL)


def test_a_plain_builder_by_dotted_path_trains_a_loss():
    path = f"{PLUGIN}.sign_only"
    objective = get_objective(path)
    assert (objective.name, objective.loss_agg, objective.context_parallel) == (path, "token_mean", True)
    assert path not in OBJECTIVES
    g = torch.Generator().manual_seed(0)
    lp, old = -torch.rand(2, 4, generator=g), -torch.rand(2, 4, generator=g)
    adv = torch.tensor([[2.0] * 4, [-0.5] * 4])
    mask = torch.ones(2, 4, dtype=torch.bool)
    config = PolicyLossConfig(token_loss=objective.build(LossConfig(objective=path), None, None, 0))
    loss_sum, normaliser = policy_loss(PolicyTokens(lp, old, adv, mask, torch.zeros_like(mask)), config)
    ratio = torch.exp(lp - old)  # -r for A = 2, +r for A = -0.5
    assert int(normaliser) == 8 and loss_sum.item() == pytest.approx((ratio[1] - ratio[0]).sum().item(), abs=1e-6)


def test_a_user_objective_reaches_the_config_from_the_command_line():
    from stapo_megatron.config.yaml_io import dump_config, parse_config
    from stapo_megatron.launch.entry import build_config

    path = f"{PLUGIN}:reinforce"
    cfg, _ = build_config("tiny", **{"loss.objective": path})
    assert (cfg.loss.objective, cfg.loss.effective_objective) == (path, path)
    _, again, _ = parse_config(dump_config(cfg, recipe="tiny"))
    assert again.loss.objective == path


@pytest.mark.parametrize("path, message", [
    ("tests.no_such_module:fn", "loss.objective = 'tests.no_such_module:fn' does not name an importable object: "
                                "cannot import module 'tests.no_such_module'"),
    (f"{PLUGIN}:NOT_AN_OBJECTIVE", f"loss.objective = '{PLUGIN}:NOT_AN_OBJECTIVE' names a int, not an Objective "
                                   "or a builder"),
    ("reinforc", "objective must be one of ('dapo', 'grpo'"),
])
def test_a_bad_objective_names_the_field_and_the_path(path, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LossConfig(objective=path)


def test_an_objective_name_taken_by_another_function_is_refused(objectives):
    from stapo_megatron.method.objectives import register_objective

    with pytest.raises(ValueError, match=r"objective 'gspo' is already registered \(by stapo_megatron.method."
                                         r"objectives._gspo\); choose another name for .*mine"):
        @register_objective("gspo")
        def mine(config, sequence_ids, sequence_sum, seed):
            return None
    assert objectives["gspo"].build is OBJECTIVES["gspo"].build
