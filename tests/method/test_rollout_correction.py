"""Tier a: the rollout/training mismatch (``method/rollout_correction.py``) on plain tensors.

Each correction (tis, icepop, seq_mask) composed with every method of the registry, through
``mcore.loss.loss_func`` and the fused log-prob op, against a float64 reference written here
from the formulas of docs/design.md ("Rollout/training mismatch"): the loss and its gradient
with respect to the logits. The metrics against values computed by hand.
"""

import dataclasses
import json
import math

import pytest
import torch

from stapo_megatron.method import masks
from stapo_megatron.method import rollout_correction as rc
from stapo_megatron.method.config import LossConfig, method_loss_config
from stapo_megatron.method.registry import METHODS, get_method
from stapo_megatron.runlog.metrics import RunLogger, summarize_silenced
from stapo_megatron.batch.microbatch import MicroBatch
from stapo_megatron.mcore.loss import loss_func, minibatch_threshold
from stapo_megatron.mcore.loss_metrics import METRIC_SUMS
from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy

FP32_TOL = 1e-5
"""fp32 op and fp32 loss vs the float64 reference over a 64-entry vocabulary."""

BOUNDS = dict(token_lower=0.6, token_upper=1.5, seq_lower=0.9, seq_upper=1.1, tis_cap=1.3)
"""Bounds tight enough that the batch below has tokens and sequences on both sides of them."""


def _batch(seed=0, B=8, S=12, V=64):
    """Logits with rare sampled tokens under confident distributions (S2T candidates), pi_old off
    pi_theta by noise (ratios away from 1, some clipped), and pi_rollout off pi_old: by N(0, 0.5)
    on odd rows (mismatched sequences), by N(0, 0.01) on even rows (nearly synced ones)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, V, generator=gen)
    logits[..., 0] += torch.rand(B, S, generator=gen) * 12  # confident on token 0: low H
    labels = torch.randint(1, V, (B, S), generator=gen)
    logprob, entropy = vocab_parallel_logprob_entropy(logits, labels)
    old = logprob.detach() + 0.2 * torch.randn(B, S, generator=gen)
    scale = torch.tensor([0.01, 0.5] * (B // 2))[:, None]
    rollout = old + scale * torch.randn(B, S, generator=gen)
    ref = logprob.detach() + 0.1 * torch.randn(B, S, generator=gen)
    adv = torch.tensor([1.0, -1.0, 0.5, 1.5] * (B // 4))[:, None].expand(B, S).contiguous()
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[:, :3] = False  # prompt
    mask[1, 9:] = False  # a shorter response
    rollout = torch.where(mask, rollout, 0.0)  # as pack_sequences leaves it off the response
    batch = MicroBatch(tokens=labels, position_ids=torch.arange(S).expand(B, S), labels=labels, response_mask=mask,
                       advantages=adv, old_logprob=old, rollout_logprob=rollout, ref_logprob=ref, seed=3)
    return logits, entropy, batch


def reference_loss(config: LossConfig, logits, batch: MicroBatch, silenced) -> torch.Tensor:
    """-J with the rollout correction, float64, from the formulas (not from the package)."""
    rcfg = config.rollout_correction
    x = logits.double()
    logp = torch.log_softmax(x / config.temperature, -1).gather(-1, batch.labels[..., None]).squeeze(-1)
    old, rollout, adv = batch.old_logprob.double(), batch.rollout_logprob.double(), batch.advantages.double()
    mask = batch.response_mask
    rho = torch.exp(old - rollout)                                   # pi_old / pi_rollout
    seq_geo = torch.exp(((old - rollout) * mask).sum(-1) / mask.sum(-1))  # geometric mean per row
    weight = torch.ones_like(rho)
    rejected = torch.zeros_like(mask)
    if rcfg.mode == "tis":
        weight = torch.clamp(rho, max=rcfg.tis_cap)
    elif rcfg.mode == "icepop":
        rejected = (rho < rcfg.token_lower) | (rho > rcfg.token_upper)
    elif rcfg.mode == "seq_mask":
        rejected = ((seq_geo < rcfg.seq_lower) | (seq_geo > rcfg.seq_upper))[:, None].expand_as(mask)
    keep = (mask & ~rejected & ~silenced).double()
    r = torch.exp(logp - old)
    surrogate = torch.minimum(r * adv, torch.clamp(r, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high) * adv)
    if config.clip_ratio_c is not None:
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, config.clip_ratio_c * adv), surrogate)
    per_token = -weight * surrogate
    if config.kl_coef:
        log_ref = batch.ref_logprob.double() - logp
        per_token = per_token + config.kl_coef * (torch.exp(log_ref) - log_ref - 1)
    if get_method(config.method).loss_agg == "seq_mean_token_mean":
        count = keep.sum(-1)
        has = count > 0
        return ((per_token * keep).sum(-1)[has] / count[has]).sum() / has.sum()
    return (per_token * keep).sum() / keep.sum()


@pytest.mark.parametrize("mode", ["tis", "icepop", "seq_mask"])
@pytest.mark.parametrize("method", list(METHODS))
def test_correction_loss_and_gradient_match_float64_reference(method, mode):
    logits, entropy, batch = _batch()
    config = method_loss_config(method, clip_ratio_c=3.0, rollout_correction=rc.RolloutCorrectionConfig(mode, **BOUNDS))
    mask, adv = batch.response_mask, batch.advantages
    threshold = minibatch_threshold(config, batch.old_logprob, entropy, adv, mask)
    logits = logits.clone().requires_grad_()
    loss_sum, normaliser, metrics = loss_func(config, batch, threshold, None, None, logits)
    (loss_sum / normaliser).backward()

    lp, _ = vocab_parallel_logprob_entropy(logits.detach(), batch.labels)
    silenced = get_method(method).mask(config, lp, entropy, adv, mask, threshold, batch.seed)
    x = logits.detach().double().requires_grad_()
    ref = reference_loss(config, x, batch, silenced)
    ref.backward()
    assert (loss_sum / normaliser).item() == pytest.approx(ref.item(), abs=FP32_TOL)
    torch.testing.assert_close(logits.grad.double(), x.grad, atol=FP32_TOL, rtol=0)

    sums = dict(zip(METRIC_SUMS, metrics["stapo_sums"].tolist()))
    assert sums["num_silenced"] == silenced.sum().item()
    # the batch exercises the correction: some tokens rejected / truncated, not all
    if mode == "tis":
        rho = torch.exp(batch.old_logprob.double() - batch.rollout_logprob.double())
        keep = mask & ~silenced
        assert ((rho > BOUNDS["tis_cap"]) & mask).any() and ((rho < 1) & mask).any()
        assert sums["num_truncated"] == (keep & (rho > BOUNDS["tis_cap"])).sum().item()
        assert sums["is_weight_sum"] == pytest.approx(rho.clamp(max=BOUNDS["tis_cap"])[keep].sum().item(), rel=1e-5)
        assert sums["num_rejected"] == 0
    else:
        assert 0 < sums["num_rejected"] < mask.sum().item()
        rejected = rc.correction(config.rollout_correction, batch.old_logprob, batch.rollout_logprob, mask)[1]
        # a rejected token gets no gradient: its logits' rows are exactly zero
        assert logits.grad[rejected].abs().max() == 0
        assert sums["num_kept"] == (mask & ~rejected & ~silenced).sum().item()


def test_mode_none_is_the_uncorrected_loss():
    logits, entropy, batch = _batch()
    config = LossConfig(method="stapo")
    threshold = minibatch_threshold(config, batch.old_logprob, entropy, batch.advantages, batch.response_mask)
    with_rollout = loss_func(config, batch, threshold, None, None, logits)
    without = loss_func(config, dataclasses.replace(batch, rollout_logprob=None), threshold, None, None, logits)
    assert with_rollout[0].item() == without[0].item() and with_rollout[1].item() == without[1].item()


def test_tis_by_hand():
    """Four tokens, pi_theta = pi_old (r = 1), C = 2: weights min(rho, 2) = 2, 1, 0.5, 2."""
    old = torch.log(torch.tensor([[0.5, 0.5, 0.2, 0.9]]))
    rollout = torch.log(torch.tensor([[0.25, 0.5, 0.4, 0.1]]))  # rho = 2, 1, 0.5, 9
    mask = torch.ones(1, 4, dtype=torch.bool)
    weight, rejected = rc.correction(rc.RolloutCorrectionConfig("tis", tis_cap=2.0), old, rollout, mask)
    torch.testing.assert_close(weight, torch.tensor([[2.0, 1.0, 0.5, 2.0]]))
    assert not rejected.any()
    from stapo_megatron.method.objective import PolicyTokens, policy_loss

    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0]])
    loss_sum, count = policy_loss(PolicyTokens(old, old, adv, mask, torch.zeros_like(mask), is_weight=weight))
    assert loss_sum.item() == pytest.approx(-(2 + 1 + 0.5 - 2)) and count.item() == 4  # the count is not weighted


def test_icepop_and_seq_mask_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.2, 0.9], [0.3, 0.3, 0.3, 0.3]]))
    rollout = torch.log(torch.tensor([[0.25, 0.5, 0.4, 0.9], [0.3, 0.3, 0.3, 0.3]]))  # rho row 0: 2, 1, 0.5, 1
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    cfg = dict(token_lower=0.6, token_upper=1.5, seq_lower=0.99, seq_upper=1.01)
    _, icepop = rc.correction(rc.RolloutCorrectionConfig("icepop", **cfg), old, rollout, mask)
    assert icepop.tolist() == [[True, False, True, False], [False] * 4]
    # row 0's geometric mean is (2 * 1 * 0.5 * 1)^(1/4) = 1: kept; widen one token to move it
    _, seq = rc.correction(rc.RolloutCorrectionConfig("seq_mask", **cfg), old, rollout, mask)
    assert not seq.any()
    rollout[0, 1] = math.log(0.25)  # rho = 2: geometric mean 2^(1/4)
    _, seq = rc.correction(rc.RolloutCorrectionConfig("seq_mask", **cfg), old, rollout, mask)
    assert seq.tolist() == [[True] * 4, [False] * 4]


def test_mismatch_sums_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.2, 0.9], [0.3, 0.3, 0.3, 0.3]]))
    rollout = torch.log(torch.tensor([[0.25, 0.5, 0.4, 0.9], [0.3, 0.15, 0.3, 0.3]]))
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    cfg = rc.RolloutCorrectionConfig(token_lower=0.6, token_upper=1.5, seq_lower=0.99, seq_upper=1.01)
    sums, max_abs, ratios = rc.mismatch_sums(cfg, old, rollout, mask)
    total = dict(zip(rc.MISMATCH_SUMS, sums.tolist()))
    # response rhos: 2, 1, 0.5, 1 | 1, 2; |delta| = ln2, 0, ln2, 0 | 0, ln2
    assert total["num_response"] == 6 and total["num_sequences"] == 2
    assert total["abs_delta_sum"] == pytest.approx(3 * math.log(2), abs=1e-6)
    assert max_abs.item() == pytest.approx(math.log(2), abs=1e-6)
    # k3 = rho - 1 - ln rho: (1 - ln2) + 0 + (-0.5 + ln2) + 0 + 0 + (1 - ln2)
    assert total["k3_sum"] == pytest.approx(1.5 - math.log(2), abs=1e-6)
    assert total["num_token_flagged"] == 3
    # geometric means: row 0 (2 * 0.5)^(1/4) = 1 (inside), row 1 2^(1/2) (outside)
    assert total["num_seq_flagged"] == 1
    assert sorted(ratios.tolist()) == pytest.approx([0.5, 1, 1, 1, 2, 2], abs=1e-6)


def test_overlap_of_silenced_and_flagged_tokens_in_the_loss_metrics():
    logits, entropy, batch = _batch()
    config = LossConfig(method="stapo", rollout_correction=rc.RolloutCorrectionConfig(**BOUNDS))
    mask, adv = batch.response_mask, batch.advantages
    threshold = minibatch_threshold(config, batch.old_logprob, entropy, adv, mask)
    _, _, metrics = loss_func(config, batch, threshold, None, None, logits)
    sums = dict(zip(METRIC_SUMS, metrics["stapo_sums"].tolist()))
    lp, _ = vocab_parallel_logprob_entropy(logits, batch.labels)
    silenced = masks.s2t_mask(lp, entropy, adv, mask, tau_h=threshold)
    candidates = masks.s2t_candidates(lp, adv, mask)
    rho = torch.exp(batch.old_logprob.double() - batch.rollout_logprob.double())
    flagged = mask & ((rho < 0.6) | (rho > 1.5))
    assert (silenced & flagged).any() and (silenced & ~flagged).any()  # both kinds occur here
    assert sums["num_flagged"] == flagged.sum().item()
    assert sums["num_silenced_flagged"] == (silenced & flagged).sum().item()
    assert sums["num_candidates_flagged"] == (candidates & flagged).sum().item()
    # the inspector's rows: (label, log p, H, A, log p_rollout, flagged, grad norm) per silenced token
    rows = metrics["silenced_tokens"]
    assert rows.shape == (silenced.sum().item(), 7)
    torch.testing.assert_close(rows[:, 4], batch.rollout_logprob[silenced])
    assert rows[:, 5].tolist() == flagged[silenced].float().tolist()


def test_s2t_candidates_by_the_rollout_probability():
    """s2t_probability="rollout": the candidate test reads pi_rollout, in the threshold and the mask."""
    logits, entropy, batch = _batch()
    lp, _ = vocab_parallel_logprob_entropy(logits, batch.labels)
    # pi_rollout makes every third response token rare and the others likely
    rare = torch.zeros_like(batch.response_mask)
    rare[:, 3::3] = True
    rollout = torch.where(rare, math.log(1e-4), math.log(0.5))
    batch = dataclasses.replace(batch, rollout_logprob=torch.where(batch.response_mask, rollout, 0.0))
    config = LossConfig(method="stapo", s2t_probability="rollout")
    mask, adv = batch.response_mask, batch.advantages
    threshold = minibatch_threshold(config, batch.rollout_logprob, entropy, adv, mask)
    _, _, metrics = loss_func(config, batch, threshold, None, None, logits)
    sums = dict(zip(METRIC_SUMS, metrics["stapo_sums"].tolist()))
    expected_candidates = rare & mask & (adv > 0)
    expected = masks.s2t_mask(batch.rollout_logprob, entropy, adv, mask, tau_h=threshold)
    assert sums["num_candidates"] == expected_candidates.sum().item() > 0
    assert sums["num_silenced"] == expected.sum().item() > 0
    trainer_candidates = masks.s2t_candidates(lp, adv, mask)
    assert not torch.equal(trainer_candidates, expected_candidates)  # the option changes the selection


def test_inspector_records_both_probabilities(tmp_path):
    rows = [(7, math.log(1e-3), 0.1, 1.0, math.log(4e-3), 1.0), (7, math.log(3e-3), 0.3, 1.0, math.log(3e-3), 0.0),
            (8, math.log(1e-3), 0.2, 0.5, math.nan, 0.0)]
    summary = summarize_silenced(rows, str)
    assert summary[0] == dict(token="7", count=2, p_mean=pytest.approx(2e-3), p_rollout_mean=pytest.approx(3.5e-3),
                              entropy_mean=pytest.approx(0.2), advantage_mean=1.0, flagged=1,
                              grad_norm_mean=None)
    assert summary[1]["p_rollout_mean"] is None  # no sampler log-probs
    logger = RunLogger(str(tmp_path), tensorboard=False)
    logger.log_silenced(1, rows, str)
    record = json.loads((tmp_path / "silenced_tokens.jsonl").read_text())
    assert [(t["token"], t["flagged"]) for t in record["per_token"]] == [("7", True), ("7", False), ("8", False)]
    assert record["per_token"][0]["p"] == pytest.approx(1e-3) and record["per_token"][0]["p_rollout"] == pytest.approx(4e-3)
    assert record["per_token"][2]["p_rollout"] is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="is"), "rollout_correction.mode must be one of"),
    (dict(tis_cap=0.0), "tis_cap must be finite and > 0"),
    (dict(token_lower=1.2), "0 < token_lower <= 1 <= token_upper"),
    (dict(seq_upper=0.5), "0 < seq_lower <= 1 <= seq_upper"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rc.RolloutCorrectionConfig(**kwargs)
    with pytest.raises(ValueError, match="s2t_probability must be one of"):
        LossConfig(s2t_probability="sampler")


def test_correction_without_rollout_logprobs_is_refused():
    logits, entropy, batch = _batch()
    config = LossConfig(method="justrl", rollout_correction=rc.RolloutCorrectionConfig("icepop"))
    with pytest.raises(ValueError, match="needs the micro-batch's rollout_logprob"):
        loss_func(config, dataclasses.replace(batch, rollout_logprob=None), torch.tensor(float("nan")), None, None, logits)


def test_sequence_mask_and_metrics_on_a_packed_row_equal_the_padded_rows():
    """seq_mask and the sequence counts read a packed row's sequences (``sequence_ids``), not the
    row: three sequences packed into one row give what their three padded rows give."""
    from stapo_megatron.batch.packing import sequence_ids

    gen = torch.Generator().manual_seed(3)
    lengths, S = [5, 7, 4], 8
    config = rc.RolloutCorrectionConfig(mode="seq_mask", seq_lower=0.99, seq_upper=1.01)
    old = torch.randn(3, S, generator=gen) * 0.5 - 2
    # sequence 0 in bounds, 1 far above, 2 below (geometric means of the response tokens)
    rollout = old - torch.tensor([0.001, 0.3, -0.2])[:, None]
    mask = torch.zeros(3, S, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, 1:n] = True  # the first token of each sequence is prompt
    _, rejected = rc.correction(config, old, rollout, mask)
    sums, max_abs, ratios = rc.mismatch_sums(config, old, rollout, mask)
    cat = lambda x: torch.cat([x[i, :n] for i, n in enumerate(lengths)])[None]  # noqa: E731
    cu_seqlens = torch.tensor([0, 5, 12, 16])
    ids = sequence_ids(cu_seqlens)[None]
    _, rejected_packed = rc.correction(config, cat(old), cat(rollout), cat(mask), ids)
    sums_packed, max_packed, ratios_packed = rc.mismatch_sums(config, cat(old), cat(rollout), cat(mask), ids)
    assert cat(rejected).tolist() == rejected_packed.tolist()
    assert rejected[1, 1:7].all() and rejected[2, 1:4].all() and not rejected[0].any()
    assert sums_packed.tolist() == pytest.approx(sums.tolist(), rel=1e-12)
    assert sums_packed[1] == 3 and sums_packed[-1] == 2  # sequences, sequences flagged
    assert float(max_packed) == pytest.approx(float(max_abs)) and ratios_packed.tolist() == pytest.approx(ratios.tolist())
    # without the ids the row would be one sequence: one geometric mean for all three
    _, one_row = rc.correction(config, cat(old), cat(rollout), cat(mask))
    assert one_row.tolist() != rejected_packed.tolist()
