"""A stand-in, asleep, for a vLLM engine on one GPU driven request by request: what
`stapo_megatron.serve.streaming.StreamingGenerator` uses of a
`stapo_megatron.rollout.vllm_engine.VLLMEngine` and of vLLM 0.32's in-process request API
(``LLMEngine.add_request`` / ``step`` / ``abort_request`` / ``reset_prefix_cache``,
``LLM.collective_rpc``), for the benchmarks that run the real control plane on a machine
without the GPU (`control_plane.py`).

Its time is the simulator's (`sim_model.DecodeModel`, priced as `sim_engine.Engine` prices an
engine's work): an iteration over n running requests whose contexts (prompt plus tokens so far)
sum to C costs ``DecodeModel.time(C, n, 1)``, a request added since the last iteration, or
dropped from the KV cache by ``reset_prefix_cache(reset_running_requests=True)``, first pays
the prefill of its whole context, and each ``step`` sleeps what it costs divided by ``scale``,
against a deadline (the engine's own clock), so that the Python between two iterations is
absorbed while it stays shorter than an iteration. A weight load (``collective_rpc``) consumes
the weights and sleeps ``load_s`` (not the first: the simulator's version 0 is there at the
start). ``busy_s`` counts the simulated seconds generating.

Its lengths are the simulator's: a prompt's first id is its index into ``prompts``
(`sim_model.Prompt`), the k-th request added for a prompt responds with ``responses[k % G]``
tokens (a group's G samples are added one after the other, so sample j draws response j),
capped by the request's ``max_tokens`` (``finish_reason`` "length"; else "stop"). Token values
mean nothing: a response's first token is its full length, every other token 1, every
log-prob 0.

What it returns has vLLM's shapes (`vllm.outputs.RequestOutput` with one
`vllm.outputs.CompletionOutput`, ``RequestOutputKind.DELTA``: each step's new tokens and, for
``logprobs=0``, one ``{token: vllm.logprobs.Logprob}`` per token). ``iterations_per_step`` > 1
lets one ``step`` run several iterations (at most up to the next request's end, so every finish
is on time), as vLLM's multi-step scheduling did: a weight load then waits for the next step.

Admission and preemption are `sim_engine.Engine`'s (vLLM's scheduler, in tokens): the KV cache
((``num_gpu_blocks`` - 1) x ``block_size``, less vLLM's null block: the decode model's ``kv_capacity_tokens``) and
``max_num_seqs`` are reported as vLLM reports them; an added request waits in line and starts
when the cache holds its context and every running request's next token and fewer than
``max_num_seqs`` run; when the running requests' next tokens do not fit, the most recently
started one is preempted (vLLM V1's recompute preemption: it returns first in line and, when it
starts again, prefills its prompt and the tokens it had generated: ``preemptions``,
``recomputed_tokens``). A lone request is never preempted. The generator's default worst-case
reservation never lets the cache run out; a smaller ``reserve_tokens`` does.
"""

from __future__ import annotations

import collections
import time
import types
from typing import Deque, Dict, Iterable, List, Optional

from sim_model import DecodeModel, Prompt

BLOCK_SIZE = 16
"""vLLM's KV block size on the GPU."""


class _Request:
    """A request: its prompt, response length, tokens so far and context to prefill."""

    __slots__ = ("request_id", "prompt_len", "count", "finish", "generated", "prefill")

    def __init__(self, request_id: str, prompt_len: int, count: int, finish: str):
        self.request_id, self.prompt_len, self.count, self.finish = request_id, prompt_len, count, finish
        self.generated = 0
        self.prefill = 0  # context tokens the next iteration prefills first (set when it starts)

    @property
    def context(self) -> int:
        return self.prompt_len + self.generated


class SleepingLLMEngine:
    """vLLM 0.32's ``LLMEngine`` request API, asleep (module docstring)."""

    def __init__(self, decode: DecodeModel, prompts: Dict[int, Prompt], scale: float, load_s: float = 0.0,
                 iterations_per_step: int = 1):
        if scale <= 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        if iterations_per_step < 1:
            raise ValueError(f"iterations_per_step must be >= 1, got {iterations_per_step}")
        self.decode, self.prompts, self.scale, self.load_s = decode, prompts, scale, load_s
        self.iterations_per_step = iterations_per_step
        self.vllm_config = types.SimpleNamespace(
            cache_config=types.SimpleNamespace(block_size=BLOCK_SIZE,
                                               # one more: vLLM's block pool keeps one as its null block
                                               num_gpu_blocks=decode.kv_capacity_tokens // BLOCK_SIZE + 1),
            scheduler_config=types.SimpleNamespace(max_num_seqs=decode.max_num_seqs, async_scheduling=False))
        self.running: Dict[str, _Request] = {}  # in the order they started (preemption takes the last)
        self.waiting: Deque[_Request] = collections.deque()  # added or preempted, in line
        self.drawn: Dict[int, int] = {}  # prompt index -> requests added for it
        self.busy_s = 0.0
        """Simulated seconds of iterations and prefills (``tokens`` / ``iterations``: the mean
        running requests)."""
        self.iterations = self.steps = self.loads = self.recomputed_tokens = self.tokens = self.preemptions = 0
        self.max_lag_s = 0.0
        """The most simulated seconds the engine's clock fell behind the model (the Python between
        two iterations, and the machine's load, costing more than the iterations slept)."""
        self._due = 0.0  # wall time the work so far ends at (the engine's clock)

    def add_request(self, request_id: str, prompt, params) -> str:
        """Queue one sample (``prompt``: `vllm.inputs.tokens_input`; ``params``: a
        `vllm.SamplingParams` with n = 1); it waits in line until a step starts it."""
        if params.n != 1:
            raise ValueError(f"one sample a request: SamplingParams.n must be 1, got {params.n}")
        if request_id in self.running or any(r.request_id == request_id for r in self.waiting):
            raise ValueError(f"request {request_id!r} is already running")
        ids = prompt["prompt_token_ids"]
        drawn = self.prompts[ids[0]]
        k = self.drawn.get(drawn.index, 0)
        self.drawn[drawn.index] = k + 1
        target = drawn.responses[k % len(drawn.responses)]
        count = min(target, params.max_tokens)
        if not self.running and not self.waiting:  # an idle engine's clock starts now
            self._due = time.perf_counter()
        self.waiting.append(_Request(request_id, len(ids), count, "stop" if count == target else "length"))
        return request_id

    def abort_request(self, request_ids: Iterable[str], internal: bool = False) -> None:
        ids = set(request_ids)
        for request_id in ids:
            self.running.pop(request_id, None)
        self.waiting = collections.deque(r for r in self.waiting if r.request_id not in ids)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """With ``reset_running_requests``: every running request prefills its whole context
        again at the next step (vLLM preempts them); else only the (unmodelled) prefix cache."""
        if reset_running_requests:
            for req in self.running.values():
                req.prefill = req.context
        return True

    def _schedule(self) -> None:
        """Start waiting requests in line while they fit, then preempt the newest running ones
        until every running request's next token fits (`sim_engine.Engine` ``_fill``, ``_preempt``)."""
        cap = self.decode.kv_capacity_tokens
        context = sum(r.context for r in self.running.values())
        while self.waiting and (not self.running or (
                context + self.waiting[0].context + len(self.running) + 1 <= cap
                and len(self.running) < self.decode.max_num_seqs)):
            req = self.waiting.popleft()
            req.prefill, context = req.context, context + req.context
            self.running[req.request_id] = req
        while len(self.running) > 1 and context + len(self.running) > cap:
            req = self.running.pop(next(reversed(self.running)))
            req.prefill, context = 0, context - req.context
            self.waiting.appendleft(req)
            self.preemptions += 1

    def step(self) -> list:
        """One iteration (up to ``iterations_per_step``) of every running request: their new
        tokens as DELTA `vllm.outputs.RequestOutput`s, finished ones leaving."""
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput

        self._schedule()
        if not self.running:
            return []
        reqs = list(self.running.values())
        n, context = len(reqs), sum(r.context for r in reqs)
        m = min(self.iterations_per_step, min(r.count - r.generated for r in reqs))
        if n > 1:  # up to the iteration whose next tokens would not fit
            m = min(m, (self.decode.kv_capacity_tokens - context) // n)
        prefill = sum(r.prefill for r in reqs)
        dt = self.decode.prefill_s_per_token * prefill + self.decode.time(context, n, m)
        self.recomputed_tokens += sum(r.prefill for r in reqs if r.generated)
        self.busy_s += dt
        self.iterations, self.tokens = self.iterations + m, self.tokens + n * m
        self.steps += 1
        outputs = []
        for r in reqs:
            r.prefill = 0
            tokens = [1] * m
            if r.generated == 0:
                tokens[0] = r.count  # the response's full length
            r.generated += m
            done = r.generated == r.count
            if done:
                del self.running[r.request_id]
            completion = CompletionOutput(0, "", tokens, None, [{t: Logprob(0.0, 1, None)} for t in tokens],
                                          finish_reason=r.finish if done else None)
            outputs.append(RequestOutput(r.request_id, None, None, None, [completion], done))
        self._sleep(dt)
        return outputs

    def _sleep(self, simulated_s: float) -> None:
        """Sleep until the engine's clock has moved ``simulated_s`` / scale on."""
        self._due += simulated_s / self.scale
        ahead = self._due - time.perf_counter()
        self.max_lag_s = max(self.max_lag_s, -ahead * self.scale)
        time.sleep(max(0.0, ahead))

    def load(self, weights: Iterable) -> None:
        """Take the weights (consumed as vLLM's layer-wise reload takes them) and sleep the load
        (after the first: the simulator's version 0 is there at the start)."""
        for _ in weights:
            pass
        if self.loads:
            self._due = max(self._due, time.perf_counter())
            self._sleep(self.load_s)
        self.loads += 1


class SleepingLLM:
    """``vllm.LLM``, the part the generator uses: its engine and ``collective_rpc``."""

    def __init__(self, llm_engine: SleepingLLMEngine):
        self.llm_engine = llm_engine

    def collective_rpc(self, method, timeout: Optional[float] = None, args: tuple = (), kwargs: Optional[dict] = None):
        """The in-place reload (`stapo_megatron.rollout.vllm_engine._reload_weights`): its
        ``weights_iterator`` consumed, the load slept."""
        self.llm_engine.load((kwargs or {})["weights_iterator"])
        return [None]


class SleepingVLLM:
    """`stapo_megatron.rollout.vllm_engine.VLLMEngine`, the part the generator uses, asleep
    (module docstring): ``llm``, ``has_tokenizer`` (False), ``detokenize``, ``shutdown``."""

    has_tokenizer = False

    def __init__(self, decode: DecodeModel, prompts: List[Prompt], scale: float, load_s: float = 0.0,
                 iterations_per_step: int = 1):
        # vLLM's modules are loaded now, as building the engine it stands in for loads them
        # (the generator's first admission would otherwise pay their import)
        import vllm.inputs  # noqa: F401
        import vllm.outputs  # noqa: F401

        self.llm = SleepingLLM(SleepingLLMEngine(decode, {p.index: p for p in prompts}, scale, load_s,
                                                 iterations_per_step))

    @property
    def busy_s(self) -> float:
        """Simulated seconds generating (`SleepingLLMEngine.busy_s`)."""
        return self.llm.llm_engine.busy_s

    def update_weights(self, named_tensors) -> None:
        """Weights between requests, as `VLLMEngine.update_weights` loads them."""
        self.llm.llm_engine.load(named_tensors)

    def detokenize(self, token_ids) -> str:
        return ""

    def shutdown(self) -> None:
        pass
