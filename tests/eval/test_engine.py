"""Tier a: the engine stapo-eval samples with (`stapo_megatron.eval.engine`): the CPU thread
binding of vLLM's workers, and the refusals of ``--tensor-parallel-size`` where it cannot run (the
HF engine, a TP that does not divide the heads, a process inside torch.distributed). The TP=2 run
itself: tests/integration/test_eval_engine.py."""

import os

import pytest
import torch.distributed as dist

from stapo_megatron.bridge.tiny import save_tiny_hf_model
from stapo_megatron.eval import cli as eval_cli
from stapo_megatron.eval import engine
from stapo_megatron.rollout.config import RolloutConfig


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("src") / "hf")
    save_tiny_hf_model(path, "qwen3")  # 4 attention heads, 2 KV heads
    return path


@pytest.mark.parametrize("cpus, workers, binding", [
    ([0, 1], 2, "0|1"), ([4, 5, 6, 7], 2, "4,5|6,7"), (list(range(8)), 3, "0,1,2|3,4,5|6,7"), ([3, 1], 1, "1,3")])
def test_cpu_thread_binding_splits_the_cpus_between_the_workers(cpus, workers, binding):
    assert engine.cpu_thread_binding(cpus, workers) == binding


def test_cpu_thread_binding_refuses_more_workers_than_cpus():
    with pytest.raises(ValueError, match="--tensor-parallel-size 4 needs at least 4 CPUs .* may use 2"):
        engine.cpu_thread_binding([0, 1], 4)


def test_tensor_parallel_needs_the_vllm_engine():
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 needs the vLLM engine, and engine 'hf' is the "
                                         "HF engine"):
        engine.check_tensor_parallel("hf", 2)
    with pytest.raises(ValueError, match="--tensor-parallel-size must be >= 1, got 0"):
        engine.check_tensor_parallel("vllm", 0)
    engine.check_tensor_parallel("hf", 1)
    engine.check_tensor_parallel("vllm", 2)


def test_a_tp_that_does_not_divide_the_heads_is_named_before_vllm_starts(tiny_hf):
    with pytest.raises(ValueError, match=f"--tensor-parallel-size 3 does not divide the 4 attention heads of {tiny_hf}"):
        engine.build_eval_engine("vllm", tiny_hf, RolloutConfig(tensor_parallel_size=3))


def test_the_worker_process_engine_refuses_a_torch_distributed_process(tiny_hf):
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="runs in a process without torch.distributed"):
            engine.WorkerProcessVLLMEngine(tiny_hf, RolloutConfig(tensor_parallel_size=2))
    finally:
        dist.destroy_process_group()


def test_stapo_eval_refuses_tp_with_the_hf_engine_before_any_work(tmp_path, tiny_hf, capsys):
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"prompt": "1+1", "answer": "2"}\n')
    code = eval_cli.main([tiny_hf, "--out", str(tmp_path / "out"), "--set", f"name=p,path={problems}",
                          "--engine", "hf", "--tensor-parallel-size", "2"])
    assert code == 2
    assert "stapo-eval: error: --tensor-parallel-size 2 needs the vLLM engine" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_worker_processes_are_spawned_before_cuda_is_asked_for(tiny_hf, monkeypatch):
    """vLLM forks its workers unless CUDA is initialised, and ``torch.cuda.is_available()`` alone
    initialises the driver: forked workers then cannot use CUDA. The engine asks for spawn as its
    first step, so it is in place even when it stops at its first check (the heads)."""
    for name in engine.WORKER_START_METHOD:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        engine.build_eval_engine("vllm", tiny_hf, RolloutConfig(tensor_parallel_size=3))
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
