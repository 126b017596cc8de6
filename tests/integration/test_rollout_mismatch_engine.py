"""Tier b: the rollout/training mismatch with a real engine whose weights are one step stale,
and the step metrics reduced over DP (gloo, 2 ranks).

Stale engine: a tiny Qwen3 Megatron model (fp32, O(1) logits) is synced into the transformers
engine (`HFEngine`, no mock), samples are drawn and the metrics show no mismatch (both sides
fp32: |delta log p| below SYNCED_ATOL). Then one real policy update (Adam, the loss of
``mcore.step.policy_update``) changes the trainer's weights and the weight sync is skipped: the
engine samples with the previous step's weights. The metrics must show the mismatch, and
icepop / seq_mask must reject exactly the flagged tokens / sequences. After the sync the
mismatch is gone again.
"""

import dataclasses
import math

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from stapo_megatron.method import rollout_correction as rc
from stapo_megatron.method.config import LossConfig
from tests.helpers.dist_utils import one_rank_parallel, run_distributed
from tests.helpers.engine_parity import MISMATCH_PROMPTS, mismatch_minibatch, randomize

pytestmark = pytest.mark.slow

SYNCED_ATOL = 1e-4
"""Per-token |log pi_old - log pi_rollout| bound with synced fp32 weights (HF SDPA vs Megatron's
local spec; tests/rollout/test_hf_engine.py's LOGPROB_ATOL)."""

VARIANT = "qwen3"
PROMPTS = MISMATCH_PROMPTS
G, MAX_TOKENS, SEQ = 4, 12, 32




@pytest.fixture(scope="module")
def stale_run(tmp_path_factory):
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.data.tokenizer import build_char_tokenizer
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.hf_engine import HFEngine
    from stapo_megatron.rollout.weight_sync import sync_weights
    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
    from stapo_megatron.trainer.mismatch_metrics import rollout_mismatch

    hf_dir = str(tmp_path_factory.mktemp("stale") / "hf")
    save_tiny_hf_model(hf_dir, VARIANT, dtype=torch.float32, seed=0)
    build_char_tokenizer(hf_dir)
    bounds = rc.RolloutCorrectionConfig()  # the default bounds: ratio [0.5, 2], geometric [0.999, 1.001]
    out = {}
    with one_rank_parallel() as groups:
        engine = HFEngine(hf_dir, RolloutConfig(dtype="float32", seed=0))
        model = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32, calculate_per_token_loss=True)
        randomize(model, seed=3)
        model, optimizer = wrap_model_and_optimizer(model, OptimConfig(lr=3e-2, weight_decay=0.0, clip_grad=0.0))
        ctx = PassContext(model, SEQ, 1.0, groups, 300)

        def sample_and_measure(seed):
            samples = engine.generate(PROMPTS, n=G, temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, seed=seed)
            minis = mismatch_minibatch(PROMPTS, samples, G, SEQ, seed)
            old_policy_pass(ctx, minis)
            return minis, rollout_mismatch(minis, bounds, groups, torch.device("cpu"))

        sync_weights(model, tiny_config(VARIANT), groups, engine)
        minis, out["synced"] = sample_and_measure(seed=1)
        # one real update of the trainer's weights; the engine's weight sync is skipped
        out["update"] = policy_update(ctx, optimizer, minis[0], LossConfig(method="justrl")).metrics
        minis, out["stale"] = sample_and_measure(seed=2)
        out["stale_batches"] = [dataclasses.replace(mb) for mb in minis[0]]
        out["losses"] = {}
        for mode in ("none", "icepop", "seq_mask"):
            config = LossConfig(method="stapo", tau_p=0.05, rollout_correction=dataclasses.replace(bounds, mode=mode))
            # flags and rejections compare the batch's fixed pi_old with pi_rollout: the same
            # for each of these updates, whatever they do to the weights
            out["losses"][mode] = policy_update(ctx, optimizer, minis[0], config).metrics
        sync_weights(model, tiny_config(VARIANT), groups, engine)
        _, out["resynced"] = sample_and_measure(seed=3)
        engine.shutdown()
    return out


def test_synced_engine_shows_no_mismatch(stale_run):
    m = stale_run["synced"]
    assert m["rollout_train_logprob_diff"] < SYNCED_ATOL and m["mismatch_abs_logprob_diff_max"] < SYNCED_ATOL
    assert m["mismatch_token_flagged_fraction"] == 0 and m["mismatch_seq_flagged_fraction"] == 0
    assert abs(m["mismatch_k3_kl"]) < SYNCED_ATOL**2
    assert m["mismatch_ratio_q01"] == pytest.approx(1, abs=SYNCED_ATOL) == m["mismatch_ratio_q99"]


def test_engine_one_step_stale_shows_the_mismatch(stale_run):
    assert stale_run["update"]["skipped"] == 0 and stale_run["update"]["grad_norm"] > 0
    m, synced = stale_run["stale"], stale_run["synced"]
    # one Adam step of lr 3e-2 on O(1)-logit weights: the engine's log-probs are far from pi_old
    assert m["rollout_train_logprob_diff"] > 0.05 > 1000 * synced["rollout_train_logprob_diff"]
    assert m["mismatch_abs_logprob_diff_max"] > math.log(2)
    assert m["mismatch_k3_kl"] > 1e-3
    assert m["mismatch_ratio_q01"] < 1 < m["mismatch_ratio_q99"]
    assert m["mismatch_token_flagged_fraction"] > 0 and m["mismatch_seq_flagged_fraction"] > 0.5
    # and the weight sync removes it
    r = stale_run["resynced"]
    assert r["mismatch_abs_logprob_diff_max"] < SYNCED_ATOL and r["mismatch_token_flagged_fraction"] == 0


def test_masks_catch_the_stale_tokens(stale_run):
    """icepop rejects exactly the flagged tokens; seq_mask every token of a flagged sequence;
    with no correction nothing is rejected (each update runs on the same stale batch)."""
    losses, m = stale_run["losses"], stale_run["stale"]
    batches = stale_run["stale_batches"]
    num_response = sum(int(mb.response_mask.sum()) for mb in batches)
    assert losses["none"]["correction_rejected_count"] == 0
    assert losses["none"]["mismatch_flagged_count"] == round(m["mismatch_token_flagged_fraction"] * num_response) > 0
    assert losses["icepop"]["correction_rejected_count"] == losses["none"]["mismatch_flagged_count"]
    bounds = rc.RolloutCorrectionConfig()
    in_flagged_seqs = sum(
        int((mb.response_mask & rc.sequence_flags(bounds, rc.log_ratio(mb.old_logprob, mb.rollout_logprob),
                                                   mb.response_mask)[:, None]).sum())
        for mb in batches)
    assert losses["seq_mask"]["correction_rejected_count"] == in_flagged_seqs > losses["icepop"]["correction_rejected_count"]
    assert losses["seq_mask"]["num_kept"] < losses["icepop"]["num_kept"] < losses["none"]["num_kept"]


def _dp_worker(seed_base: int):
    """One of two DP ranks: its own micro-batches; the step metrics reduced over DP."""
    from stapo_megatron.batch.microbatch import MicroBatch
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.trainer.mismatch_metrics import rollout_mismatch

    groups = init_parallel(1, 1)
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(seed_base + rank)
    B, S = 3 + rank, 10
    old = -torch.rand(B, S, generator=gen) * 3
    rollout = old + 0.7 * torch.randn(B, S, generator=gen)
    mask = torch.rand(B, S, generator=gen) > 0.3
    mb = MicroBatch(tokens=torch.zeros(B, S, dtype=torch.long), position_ids=torch.zeros(B, S, dtype=torch.long),
                    labels=torch.zeros(B, S, dtype=torch.long), response_mask=mask, old_logprob=old,
                    rollout_logprob=torch.where(mask, rollout, 0.0))
    metrics = rollout_mismatch([[mb]], rc.RolloutCorrectionConfig(), groups, torch.device("cpu"))
    return metrics, (old, rollout, mask)


def test_step_metrics_reduce_over_data_parallel_ranks():
    results = run_distributed(2, _dp_worker, 11)
    assert results[0][0] == results[1][0], "every rank logs the same numbers"
    metrics = results[0][0]
    old = torch.cat([r[1][0][r[1][2]] for r in results]).double()
    rollout = torch.cat([r[1][1][r[1][2]] for r in results]).double()
    delta = old - rollout
    rho = delta.exp()
    assert metrics["rollout_train_logprob_diff"] == pytest.approx(delta.abs().mean().item(), rel=1e-6)  # delta is taken in fp32, as the trainer does
    assert metrics["mismatch_abs_logprob_diff_max"] == pytest.approx(delta.abs().max().item(), rel=1e-6)  # delta is taken in fp32, as the trainer does
    assert metrics["mismatch_k3_kl"] == pytest.approx((rho - 1 - delta).mean().item(), rel=1e-6)  # delta is taken in fp32, as the trainer does
    assert metrics["mismatch_token_flagged_fraction"] == pytest.approx(((rho < 0.5) | (rho > 2)).double().mean().item())
    for q in rc.RATIO_QUANTILES:
        # the quantile of fp32 ratios (gathered as fp32), linear interpolation as torch.quantile
        expected = torch.quantile(rho.float().double(), q).item()
        assert metrics[f"mismatch_ratio_q{round(100 * q):02d}"] == pytest.approx(expected, rel=1e-6)
    rows = [(r[1][0], r[1][1], r[1][2]) for r in results]
    num_seq = sum(int(m.any(-1).sum()) for _, _, m in rows)
    num_flagged = 0
    for o, ro, m in rows:
        geo = (((o - ro) * m).sum(-1) / m.sum(-1).clamp(min=1)).double().exp()
        num_flagged += int((m.any(-1) & ((geo < 0.999) | (geo > 1.001))).sum())
    assert metrics["mismatch_seq_flagged_fraction"] == pytest.approx(num_flagged / num_seq)
