"""An engine rank of a separately placed job: build the rollout engine the colocated trainer
would build (`engine_config`), then execute trainer 0's commands in their order (`serve`).

Two threads. The listener takes every command off ``Transport.control`` as soon as trainer 0 sends
it (so that a stop is seen while requests are still queued); at a weight transfer it hands the
transfer over and waits until the main thread has received its buckets, which follow on
``control`` and ``Transport.weights``. The main thread, the one vLLM runs on, executes the
commands in order:

* ``("weights", transfer)``: receive the weights and load them into the engine (between two
  requests), streamed bucket by bucket, at most two on the engine's GPU
  (`stapo_megatron.serve.weight_receive`); trainer 0's transfer waits until the engine gets
  there;
* ``("adapter", transfer, config)``: the same for a LoRA adapter (``rollout.engine=vllm_lora``,
  `stapo_megatron.rollout.vllm_lora`): PEFT's tensors and ``adapter_config.json``'s ``config``,
  written as the engine's next adapter version, which every later request samples with;
* ``("generate", ticket, jobs, None)``: generate this engine's slices of the request
  (`stapo_megatron.rollout.remote.plan_chunks`; a job is a slice, its prompts and their
  `SamplingSettings`, `stapo_megatron.rollout.remote.Job`), those of every asking replica in one
  engine call (so the request pays one tail, not one per replica; each slice keeps its seeds:
  `stapo_megatron.serve.merged_calls`), and post each to the rank that asked, without waiting
  for it to take them; each reply's header carries the seconds spent generating (its share of
  the call, by tokens), idle (waiting for a command) and receiving and loading weights since the
  last reply;
* ``("partial", ticket, jobs, pool)``: partial rollouts (`stapo_megatron.serve.partial`):
  the step's prompts go into each asker's pool (``pool``: a `stapo_megatron.rollout.remote.
  PoolRequest`, what each pool returns), the pools' rounds run in lockstep (one engine
  call a round for all of them), and each pool's first finished groups are posted back as soon
  as it has them;
* ``("stream", ticket, jobs, requests)``: streaming rollouts (`stapo_megatron.serve.stream_pools`):
  the step's prompts join their replica's admission queue on each of the replica's engines;
  while this engine has samples running or a queued prompt it may claim and start, the main
  thread takes the commands that have arrived (without waiting) between two decode iterations,
  so weights are loaded in flight, and posts each group to its asker as it completes; an
  evaluation's ``generate`` first lets the running samples finish;
* ``("stop",)``: return (what is still queued is dropped: the trainers are done or stopping).

All ranks of one engine (vLLM TP > 1) run the same commands; its first rank sends the samples.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import queue
import signal
import threading
import time
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from stapo_megatron.rollout.transport import Transport, Outbox, broadcast_object
from stapo_megatron.mcore.config import ModelConfig
from stapo_megatron.rollout.config import RolloutConfig, RolloutSampling
from stapo_megatron.serve.merged_calls import Call, generate_merged, step_together
from stapo_megatron.rollout.registry import build_engine, resolve_engine
from stapo_megatron.rollout.remote import Chunk, Job, PoolRequest
from stapo_megatron.serve.weight_receive import receive_weights
from stapo_megatron.serve.partial import PartialPool
from stapo_megatron.serve.stream_pools import StoreClaims, StreamPools

VLLM_ENGINES = ("vllm", "vllm_lora")
"""The engines (`stapo_megatron.rollout.registry` names) that run vLLM and join the engines' group."""
STOP_WAIT_S = 60.0
"""At a stop, how long the engine waits for the trainers to take samples still in flight."""


def engine_config(rollout: RolloutSampling, seed: int, return_routes: bool, max_sequence_len: int,
                  bf16: bool, lora_rank: Optional[int] = None) -> RolloutConfig:
    """The engine a run's rollouts and evaluation need: the same for colocated and separate
    placement (so that both sample the same responses from the same weights). ``max_sequence_len``:
    `TrainerConfig.longest_sequence`; ``bf16``: the trainer's dtype; ``lora_rank``: the run's
    ``lora.rank`` (None: full fine-tuning), the widest adapter an adapter-serving engine reserves."""
    r = rollout
    return r.engine_config(
        max_model_len=_pad_to(max_sequence_len), seed=seed, return_routed_experts=return_routes,
        # the engine must run the dtype the trainer trains in, whatever the folder was saved in
        dtype="bfloat16" if bf16 else "float32",
        enable_sleep_mode=r.sleep_during_training and r.placement == "colocated" and torch.cuda.is_available(),
        # asleep, the weights are dropped (wake_and_sync rewrites them); the trainer syncs before any generate
        sleep_level=2, load_format="dummy", enforce_eager=r.enforce_eager,
        # a streaming engine takes weights between two iterations: none in flight there
        async_scheduling=False if r.mode == "streaming" else None, max_lora_rank=lora_rank,
    )


def run_engine_rank(rollout: RolloutSampling, model: ModelConfig, max_sequence_len: int, transport: Transport,
                    seed: int, return_routes: bool, warning_signals: Sequence[signal.Signals] = (),
                    lora_rank: Optional[int] = None) -> int:
    """An engine rank's whole life (`stapo_megatron.launch.entry` calls it instead of training, with
    the run's sections, its engine seed, whether routes are wanted and the run's ``lora.rank``):
    `serve`, then leave the engines' process group. Returns the requests served.

    The scheduler's warning signals (``warning_signals``: torchrun forwards them to every rank) are
    the trainers' to act on: they save at the next step boundary and send "stop". Their default
    action would end this rank at once, and the trainers' next receive with it, so they are ignored."""
    for sig in warning_signals:
        signal.signal(sig, signal.SIG_IGN)
    try:
        return serve(rollout, model, max_sequence_len, transport, seed, return_routes, lora_rank)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def engine_pool_env(transport: Transport) -> dict:
    """torchrun's ``RANK`` and ``WORLD_SIZE`` as the engines' own group numbers them, one engine
    rank too: vLLM's external launcher reads them from the environment (and forms its TP groups
    from them) next to the already formed default group, which is the engines' alone; its GPU
    is ``LOCAL_RANK``'s, as torchrun set it (`stapo_megatron.rollout.vllm_engine.engine_kwargs`)."""
    return dict(RANK=str(transport.rank - transport.trainers), WORLD_SIZE=str(transport.engine_ranks))


@contextlib.contextmanager
def _engine_pool_env(transport: Transport, engine: str) -> Iterator[None]:
    """`engine_pool_env` in the environment while a vLLM engine is built (the HF engine forms
    no groups: nothing to renumber)."""
    if resolve_engine(engine) not in VLLM_ENGINES:
        yield
        return
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    os.environ.update(engine_pool_env(transport))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _listen(transport: Transport, inbox: "queue.Queue[Any]", stopping: threading.Event) -> None:
    """The listener thread (module docstring); an exception is handed to the main thread."""
    try:
        while True:
            command = broadcast_object(transport.control)
            if command[0] in ("weights", "adapter"):
                received = threading.Event()
                inbox.put((*command, received))
                received.wait()  # the buckets follow on control: the main thread's to take
                continue
            if command[0] == "stop":
                stopping.set()
            inbox.put(command)
            if command[0] == "stop":
                return
    except BaseException as error:  # noqa: BLE001  (handed over, raised by the main thread)
        inbox.put(error)


def load_transfer(load, transport: Transport, received: threading.Event, device: torch.device) -> None:
    """Receive a weight transfer's buckets onto ``device`` and stream them into ``load`` (an
    engine's ``update_weights``); ``received`` tells the listener the groups are its own again."""
    try:
        weights = receive_weights(transport, device)
        load(weights)
        for _ in weights:  # what the engine did not ask for: off the groups, in step with trainer 0
            pass
    finally:
        received.set()


def serve(rollout: RolloutSampling, model: ModelConfig, max_sequence_len: int, transport: Transport, seed: int,
          return_routes: bool, lora_rank: Optional[int] = None) -> int:
    """Run this engine rank until trainer 0 says stop; returns the requests it served. ``rollout``
    and ``model``: the run's sections; ``max_sequence_len``: `TrainerConfig.longest_sequence`;
    ``seed``: this engine's (`stapo_megatron.trainer.seeds.Seeds.engine`); ``return_routes``: the
    engine returns each token's routed experts; ``lora_rank``: the run's ``lora.rank`` (None: no
    LoRA), the adapter slot of ``rollout.engine=vllm_lora``.

    Raises:
        RuntimeError: trainer 0's commands stopped arriving (it died: the message says so) or
            the engine failed.
    """
    with _engine_pool_env(transport, rollout.engine):
        engine = build_engine(rollout.engine, model.hf_dir, engine_config(
            rollout, seed, return_routes, max_sequence_len, model.bf16, lora_rank))
    inbox: "queue.Queue[Any]" = queue.Queue()
    stopping = threading.Event()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    threading.Thread(target=_listen, args=(transport, inbox, stopping), name="engine-listener", daemon=True).start()
    outbox = Outbox(transport.data)
    idle = load = 0.0
    served = version = 0
    pools: dict = {}  # partial rollouts: trainer rank -> its PartialPool
    stream = None  # streaming rollouts: the StreamPools, from the first "stream" command on

    def post(ticket: int, chunk: Chunk, samples: list, took: float) -> None:
        """A chunk's reply to its asker (without waiting for it to take it)."""
        nonlocal idle, load
        if transport.is_engine_leader:
            outbox.send(chunk.dest, [ticket, chunk.index, _us(took), _us(idle), _us(load)], samples)
        idle = load = 0.0

    try:
        while True:
            if stream is not None and stream.busy:  # between two decode iterations
                try:
                    command = inbox.get_nowait()
                except queue.Empty:
                    stream.advance(post)
                    continue
            else:
                waited = time.perf_counter()
                command = inbox.get()
                idle += time.perf_counter() - waited
            if isinstance(command, BaseException):
                raise RuntimeError(f"engine rank {transport.rank}: trainer 0's commands stopped "
                                   f"({command})") from command
            if command[0] == "stop":
                return served
            if command[0] in ("weights", "adapter"):
                started = time.perf_counter()
                version, received = command[1], command[-1]
                if command[0] == "adapter":  # PEFT's tensors (a few MB): all of them, then the folder
                    into = functools.partial(_load_adapter, engine, command[2])
                else:
                    into = engine.update_weights if stream is None else functools.partial(stream.load, version=version)
                load_transfer(into, transport, received, device)
                load += time.perf_counter() - started
                continue
            kind, ticket, jobs, pool = command
            mine = [] if stopping.is_set() else [job for job in jobs if job[0].engine == transport.engine_index]
            if kind == "stream":
                if stream is None:
                    r = rollout
                    claims = None if transport.store is None else StoreClaims(transport.store,
                                                                              str(transport.engine_index))
                    stream = StreamPools(engine, r.settings(None), r.separate.max_staleness,
                                         r.streaming.weight_load, version, reserve_tokens=r.streaming.reserve_tokens,
                                         claims=claims)
                stream.add(ticket, mine, pool, collections.Counter(job[0].dest for job in jobs))
            elif kind == "partial":
                _partial_steps(engine, pools, mine, pool, version, functools.partial(post, ticket))
            else:
                if stream is not None:
                    stream.drain(post)
                for reply in _generate(engine, mine):
                    post(ticket, *reply)
            served += 1
    finally:
        if stream is not None:
            stream.abort()
        engine.shutdown()
        if not stopping.is_set():
            outbox.pending.clear()  # failing: the trainers will not take them
        else:
            _drain(outbox)


def _load_adapter(engine, config: dict, named_tensors) -> None:
    """A received adapter transfer into ``engine`` (`stapo_megatron.rollout.vllm_lora.VLLMLoraEngine.
    load_adapter`: its next version, which later requests name)."""
    engine.load_adapter(dict(named_tensors), config)


def _generate(engine, jobs: List[Job]) -> Iterator[Tuple[Chunk, list, float]]:
    """This engine's chunks of a request, ``(chunk, samples, seconds)`` each: all of them in one
    engine call (`merged_calls.generate_merged`: the request pays one tail, not one per asking
    replica), each chunk's samples seeded as if generated alone."""
    calls = [Call(prompts, settings) for _, prompts, settings in jobs]
    for (chunk, _, _), (samples, took) in zip(jobs, generate_merged(engine, calls)):
        yield chunk, samples, took


def _partial_steps(engine, pools: dict, jobs: List[Job], request: PoolRequest, version: int, post) -> None:
    """Partial rollouts: each asker's prompts into its pool (``pools``: trainer rank -> its
    `PartialPool`), the pools' rounds in lockstep (`merged_calls.step_together`: one engine call
    per round for all of them); ``post(chunk, [reply], seconds)`` as soon as a pool is done."""
    steps = []
    for chunk, prompts, settings in jobs:
        pool = pools.setdefault(chunk.dest, PartialPool())
        steps.append(functools.partial(_pool_step, pool, prompts, settings, request, version))
    step_together(engine, steps, lambda i, reply, took: post(jobs[i][0], [reply], took))


def _pool_step(pool: PartialPool, prompts, settings, request: PoolRequest, version: int, engine) -> dict:
    """One pool's step (prompts: (position, index, ids) of the step's window) and its state."""
    groups = pool.step(engine, prompts, settings, request.want, request.capacity, request.round_tokens, version)
    return dict(groups=groups, pool=len(pool.groups), waiting=len(pool.waiting), continued=pool.continued)


def _drain(outbox: Outbox) -> None:
    """At a stop: the trainers have taken what they asked for; sends of steps they will never
    train (a stop on the scheduler's signal) are abandoned after a short wait."""
    try:
        outbox.close(STOP_WAIT_S)
    except RuntimeError:
        outbox.pending.clear()


def _pad_to(n: int, multiple: int = 8) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return (n + multiple - 1) // multiple * multiple


def _us(seconds: float) -> int:
    return int(seconds * 1e6)

