"""The real control plane at time scale, on the CPU: the trainer-side rollout schedule, the engine
server, the transport and the partial-rollout pools run for real, against stand-ins for the GPUs,
and their trainer wait, engine idle and step time are set beside the simulator's for the same
inputs.

Real (the code under test): each mode's `stapo_megatron.trainer.rollout_schedule.RolloutSchedule` on every
trainer rank, `stapo_megatron.rollout.remote.RemoteEngine` and `stapo_megatron.rollout.transport`
(``init_job``: one process per rank, gloo groups over torchrun's kind of store), the engine rank's
`stapo_megatron.serve.server.serve` (its listener thread, command queue, merged calls,
outbox) and `stapo_megatron.serve.partial.PartialPool`; streaming rollouts: the engine server's
loop over `stapo_megatron.serve.stream_pools.StreamPools` and its `StreamingGenerator`.

Stand-ins, for hardware this machine lacks (they sleep, so they need no cores):

- `SleepingEngine`, a vLLM engine on one H100 (Qwen3-8B, TP=1): ``generate`` sleeps the
  simulator's decode time for the call's sequences (`sim_schedules.Engine`: continuous batching,
  prefill, the call ending with its longest response) divided by ``--scale`` and returns responses
  of the simulator's lengths for the same prompts (`sim_model.sample_prompts`, the paper's
  lengths). A prompt's ids carry its index (its first id), a response's first token its full
  length (a partial rollout's continuation finds both). ``update_weights`` sleeps the transfer.
- `sleeping_vllm.SleepingVLLM`, the same engine driven request by request (streaming rollouts).
- the update: every trainer sleeps the modelled forward passes and update of all replicas' trained
  tokens (`sim_model.trainer_s`: pi_old, or with ``--recipe`` the streaming recipe's passes and
  update as the dry run counts them), divided by ``--scale``.
- the weight sync: the colocated switch or the separate transfer (`sim_model.switch_s`), scaled,
  after a real bucket of a few bytes went through the transport.

The simulator's figures come from `sim_schedules.colocated`, ``separate`` and ``partial`` and
`sim_streaming.streaming` on the same job, prompts and lengths (a GPU per trainer rank and per
engine; a trainer rank's prompts a contiguous share of the step's, as the trainer's are);
streaming in the built schedule (``--sim-schedule queue``, a replica's queue shared by its
engines; ``slices``: fixed slices, for comparison) at the generator's KV reservation (prompt plus
``--reserve-tokens``, default ``max_tokens``, a sample: ``kv_reserve`` = (mean prompt + reserve) /
(mean prompt + mean response)). The streaming recipe's split, a replica over several engines, is ``--trainers`` below ``--engines``;
``--recipe`` takes its reservation, eta and trainer passes (``qwen3_8b_stream``). Figures are in
the simulator's seconds (wall seconds times ``--scale``), steady state after ``--warmup``; the
harness's differences from the simulator are what the control plane adds.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/control_plane.py            # ~2-3 min
    PYTHONPATH=benchmarks .venv/bin/python benchmarks/control_plane.py --schedules streaming --reserve-tokens 3800
    PYTHONPATH=benchmarks .venv/bin/python benchmarks/control_plane.py --schedules streaming --recipe \
        --trainers 1 --engines 4 --prompts 32                    # the recipe's split, reservation, passes
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import types
from typing import Dict, List, Optional, Sequence

from sim_model import H100, PAPER_LENGTHS, QWEN3_8B, Lengths, Prompt, sample_prompts, switch_s, trainer_s
from sim_schedules import Engine, Job, colocated, partial, separate, steady
from sim_streaming import streaming
from sleeping_vllm import SleepingVLLM

from stapo_megatron.utils import free_port

SCHEDULES = ("colocated", "k=0", "k=1", "partial", "streaming")


@dataclasses.dataclass(frozen=True)
class Setup:
    """One harness job: a few steps of Qwen3-8B on H100s at the paper's lengths."""

    steps: int = 6
    warmup: int = 2
    """Steps left out of the steady-state figures."""
    prompts_per_step: int = 8
    group: int = 8
    trainers: int = 2
    """Trainer ranks (one data-parallel replica each)."""
    trainer_gpus: int = 1
    """GPUs each trainer rank stands for (a replica's TP x PP x CP: the streaming recipe's is 4):
    its update sleeps the modelled time of that many GPUs."""
    engines: int = 1
    """Engine ranks of separate placement (TP=1 each; above ``trainers``: a replica sliced over several)."""
    scale: float = 100.0
    """Simulated seconds per wall second."""
    oversample: float = 0.5
    """Partial rollouts: groups in flight beyond the step's (the pools' ``rollout.partial.oversample`` is 1 + this)."""
    partial_tokens: int = 4096
    """Partial rollouts' round (``rollout.partial.round_tokens``)."""
    eta: int = 2
    """Streaming rollouts' off-policyness bound (``rollout.separate.max_staleness``)."""
    stream_iterations: int = 8
    """Streaming: decode iterations a step of the stand-in runs (`sleeping_vllm.SleepingLLMEngine`;
    at 1 the Python between two iterations, ~0.1 ms, is near an iteration's sleep, 14 ms / ``scale``)."""
    reserve_tokens: Optional[int] = None
    """Streaming: response tokens of KV reserved per sample (``rollout.streaming.reserve_tokens``)."""
    forwards: int = 1
    """Forward passes before the update; ``recompute``: full recompute in the update."""
    recompute: bool = False
    sim_schedule: str = "queue"
    """The simulator's streaming schedule (`sim_streaming.SCHEDULES`): the built one (a replica's
    admission queue shared by its engines) by default."""
    lengths: Lengths = PAPER_LENGTHS
    seed: int = 0

    def job(self, schedule: str) -> Job:
        gpus = self.trainers * self.trainer_gpus + (0 if schedule == "colocated" else self.engines)
        return Job(QWEN3_8B, H100, num_gpus=gpus, engine_tp=1, prompts_per_step=self.prompts_per_step,
                   group=self.group, lengths=self.lengths, forwards=self.forwards, recompute=self.recompute,
                   trainer_replica_gpus=self.trainer_gpus)

    def mine(self, step: int, rank: int) -> List[Prompt]:
        """Trainer ``rank``'s prompts of ``step``: its contiguous share, as the trainer's are."""
        per = self.prompts_per_step // self.trainers
        return self.batch(step)[rank * per:(rank + 1) * per]

    def prompts(self) -> List[Prompt]:
        """The data order: enough prompts for every step and the pools' look-ahead."""
        ahead = max(3, self.eta + 1)  # streaming's simulator admits up to eta + 1 steps ahead
        return sample_prompts(self.lengths, (self.steps + ahead) * self.prompts_per_step, self.group, self.seed)

    def batch(self, step: int) -> List[Prompt]:
        return self.prompts()[step * self.prompts_per_step:(step + 1) * self.prompts_per_step]


def prompt_ids(prompt: Prompt) -> List[int]:
    """A prompt's token ids: its index, then filler to its length."""
    return [prompt.index] + [0] * (prompt.prompt_len - 1)


class SleepingEngine:
    """A GPU engine's time and lengths, asleep (module docstring)."""

    def __init__(self, setup: Setup, separate: bool):
        job = setup.job("separate" if separate else "colocated")
        self.decode = job.decode(1, separate=separate)
        self.prompts = {p.index: p for p in setup.prompts()}
        self.scale = setup.scale
        self.transfer_s = switch_s(QWEN3_8B, job.eff, colocated=False) if separate else 0.0
        self.busy_s, self.calls, self.loads = 0.0, [], 0
        """Simulated seconds generating, the sequences of each ``generate`` call, the loads."""

    def generate(self, prompt_token_ids, n, temperature, top_p, max_tokens, seed=None):
        from stapo_megatron.rollout.base import Sample

        clock = Engine(self.decode)
        out, sequences = [], 0
        for ids in prompt_token_ids:
            prompt = self.prompts[ids[0]]
            so_far = ids[prompt.prompt_len:]
            targets = [so_far[0]] if so_far else prompt.responses[:n]
            assert len(targets) == n, "a continuation asks for one sample, a new prompt for its group"
            group = []
            for target in targets:
                count = min(max_tokens, target - len(so_far))
                clock.admit(Prompt(prompt.index, len(ids), [count]), 0)
                tokens = ([target] + [1] * (count - 1)) if not so_far else [1] * count
                group.append(Sample(token_ids=tokens, logprobs=[0.0] * len(tokens), text="",
                                    finish_reason="stop" if len(so_far) + count == target else "length"))
            out.append(group)
            sequences += len(targets)
        clock.run()
        self.busy_s += clock.clock
        self.calls.append(sequences)
        time.sleep(clock.clock / self.scale)
        return out

    def detokenize(self, token_ids) -> str:
        return ""

    def update_weights(self, named_tensors) -> None:
        for _ in named_tensors:
            pass
        if self.loads:  # the first weights are there at the start (the simulator's version 0)
            time.sleep(self.transfer_s / self.scale)
        self.loads += 1

    def sleep(self, *args, **kwargs) -> None:
        """Nothing to do (``sleep``, ``wake_up`` and ``shutdown`` of a stand-in)."""

    wake_up = shutdown = sleep


def _sampling(setup: Setup, schedule: str):
    from stapo_megatron.rollout.config import RolloutSampling
    from stapo_megatron.rollout.rollout_modes import PartialRollouts, SeparatePlacement, StreamingRollouts

    mode = {"colocated": "colocated", "partial": "partial", "streaming": "streaming"}.get(schedule, "separate")
    sections = {} if mode == "colocated" else dict(separate=SeparatePlacement(
        setup.engines, {"k=0": 0, "k=1": 1, "partial": 1, "streaming": setup.eta}[schedule], weight_bucket_mb=1))
    if mode == "partial":
        sections["partial"] = PartialRollouts(oversample=1 + setup.oversample, round_tokens=setup.partial_tokens)
    if mode == "streaming":
        sections["streaming"] = StreamingRollouts(reserve_tokens=setup.reserve_tokens)
    return RolloutSampling(group_size=setup.group, max_response_len=setup.lengths.response_cap,
                           engine="vllm" if schedule == "streaming" else "hf",  # the stand-ins replace either
                           mode=mode, **sections)


def _trainer(setup: Setup, schedule: str, rank: int) -> dict:
    """A trainer rank: the real schedule over ``setup``'s steps, the update asleep."""
    import torch
    import torch.distributed as dist

    from stapo_megatron.mcore.parallel import Groups
    from stapo_megatron.rollout.remote import RemoteEngine
    from stapo_megatron.rollout.transport import init_job
    from stapo_megatron.trainer.pooled_schedules import build_schedule

    config = _sampling(setup, schedule)
    job = setup.job(schedule)
    if config.placement == "separate":
        transport = init_job(setup.engines, 1, init_timeout_s=120, timeout_s=600, samples_timeout_s=600)
        engine = RemoteEngine(transport, asks=True, timeout_s=600, bucket_mb=1)
        switch = switch_s(QWEN3_8B, job.eff, colocated=False)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=setup.trainers)
        engine, switch = SleepingEngine(setup, separate=False), switch_s(QWEN3_8B, job.eff, colocated=True)
    mine = lambda step: setup.mine(step, rank)  # noqa: E731  (this replica's share)
    synced = []

    def sync(engine, wake):
        engine.update_weights(iter([("w", torch.zeros(4))]))
        if synced:  # the first weights are the simulator's version 0, there at the start
            time.sleep(switch / setup.scale)
        synced.append(wake)
        return {}

    schedule_ = build_schedule(config, engine, Groups(None, None, None, True, 0),
                               lambda s: [(p.index, prompt_ids(p)) for p in mine(s)], lambda index: "",
                               lambda s: 1000 * s + 100 * rank, sync, setup.steps, timeout_s=600.0)
    started = time.perf_counter()
    schedule_.start(0)
    rows = []
    for step in range(setup.steps):
        waited = time.perf_counter()
        rollout = schedule_.samples(step)
        wait = time.perf_counter() - waited
        tokens = [len(s.prompt_ids) + len(s.sample.token_ids) for s in rollout.samples]
        every: List[Optional[list]] = [None] * setup.trainers
        dist.all_gather_object(every, tokens)
        trained = [t for part in every for t in part]
        train = sum(trainer_s(QWEN3_8B, H100, job.eff, trained, setup.trainers * setup.trainer_gpus, setup.forwards,
                              setup.recompute))
        time.sleep(train / setup.scale)
        end = time.perf_counter() - started
        syncing = time.perf_counter()
        schedule_.after_update(step)
        sync_s = time.perf_counter() - syncing
        rows.append(dict(step=step, version=rollout.version, wait=wait * setup.scale, sync=sync_s * setup.scale,
                         train=train, end=end * setup.scale, tokens=sum(trained), samples=len(tokens),
                         groups=rollout.num_prompts,
                         indices=sorted(rollout.prompt_indices) if config.pooled else rollout.prompt_indices))
    engine.shutdown()
    out = dict(rows=rows)
    if config.placement != "separate":
        out.update(busy_s=engine.busy_s, calls=engine.calls)
    return out


def _engine(setup: Setup, schedule: str) -> dict:
    """An engine rank: the real `server.serve` around the sleeping engine."""
    import torch.distributed as dist

    from stapo_megatron.rollout.transport import init_job
    from stapo_megatron.serve import server

    if schedule == "streaming":  # built before the trainers' clocks start, as SleepingEngine is (vLLM's imports)
        job = setup.job(schedule)
        standin = SleepingVLLM(job.decode(1, separate=True), setup.prompts(), setup.scale,
                               switch_s(QWEN3_8B, job.eff, colocated=False), setup.stream_iterations)
    else:
        standin = SleepingEngine(setup, separate=True)
    transport = init_job(setup.engines, 1, init_timeout_s=120, timeout_s=600, samples_timeout_s=600)
    server.build_engine = lambda *args, **kwargs: standin  # the stand-in for the engine the config names
    # what serve reads of a run's config (a whole TrainerConfig would also describe the training)
    rollout = _sampling(setup, schedule)
    cfg = types.SimpleNamespace(rollout=rollout, model=types.SimpleNamespace(hf_dir="", bf16=False),
                                longest_sequence=lambda: setup.lengths.prompt_range[1] + rollout.max_response_len)
    try:
        served = server.serve(cfg.rollout, cfg.model, cfg.longest_sequence(), transport, seed=0, return_routes=False)
    finally:
        dist.destroy_process_group()
    if schedule == "streaming":  # an engine call: a step of the request API
        llm = standin.llm.llm_engine
        return dict(served=served, busy_s=standin.busy_s, calls=llm.steps, max_lag_s=llm.max_lag_s,
                    mean_running=llm.tokens / max(1, llm.iterations), preemptions=llm.preemptions,
                    recomputed_tokens=llm.recomputed_tokens)
    return dict(served=served, busy_s=standin.busy_s, calls=standin.calls)


def _rank_main(rank: int, world: int, port: int, setup: Setup, schedule: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK="0", OMP_NUM_THREADS="1")
    try:
        out = _trainer(setup, schedule, rank) if rank < setup.trainers else _engine(setup, schedule)
        results.put((rank, out))
    except BaseException as error:  # noqa: BLE001  (reported by the parent)
        import traceback

        results.put((rank, RuntimeError(f"rank {rank}: {error}\n{traceback.format_exc()}")))


def run_harness(setup: Setup, schedule: str, timeout_s: float = 900.0) -> Dict[int, dict]:
    """One schedule on real processes (trainers, then engines for separate placement): each rank's result."""
    import multiprocessing

    world = setup.trainers + (0 if schedule == "colocated" else setup.engines)
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, setup, schedule, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(world):
            rank, value = results.get(timeout=timeout_s)
            if isinstance(value, BaseException):
                raise value
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return out


def harness_figures(setup: Setup, schedule: str, out: Dict[int, dict]) -> dict:
    """The harness's run in the simulator's terms (`sim_schedules.steady`), plus the trainers'
    mean wait for samples a step and the engine calls."""
    rows = out[0]["rows"]
    engines = [out[r] for r in range(setup.trainers)] if schedule == "colocated" else \
        [out[r] for r in range(setup.trainers, setup.trainers + setup.engines)]
    ends = [r["end"] for r in rows]
    busy = sum(e["busy_s"] for e in engines)
    run = dict(step_ends=ends, step_tokens=[r["tokens"] for r in rows], trainer_busy_s=sum(r["train"] for r in rows),
               engine_idle=1 - busy / (len(engines) * ends[-1]))
    figures = steady(run, setup.job(schedule).num_gpus, setup.warmup)
    steady_rows = rows[setup.warmup:]
    figures["wait_s"] = sum(r["wait"] for r in steady_rows) / len(steady_rows)
    figures["sync_s"] = sum(r["sync"] for r in steady_rows) / len(steady_rows)
    figures["calls"] = sum(e["calls"] if isinstance(e["calls"], int) else len(e["calls"]) for e in engines)
    if schedule == "streaming":
        figures["mean_running"] = sum(e["mean_running"] for e in engines) / len(engines)
        figures["max_lag_s"] = max(e["max_lag_s"] for e in engines)
        figures["preemptions"] = sum(e["preemptions"] for e in engines)
        figures["recomputed_tokens"] = sum(e["recomputed_tokens"] for e in engines)
    return figures


def simulator_figures(setup: Setup, schedule: str, per_sequence: bool = True,
                      kv_reserve: Optional[float] = None) -> dict:
    """The simulator's run of the same job, prompts and lengths (``per_sequence``: partial
    rollouts' admission, `sim_schedules.partial`; ``kv_reserve``: streaming's, None: the
    generator's, `generator_reserve`); with the run's ``preemptions`` and ``recomputed_tokens``."""
    job, prompts = setup.job(schedule), setup.prompts()
    kv_reserve = generator_reserve(setup) if kv_reserve is None else kv_reserve
    batches = [setup.batch(s) for s in range(setup.steps)]
    if schedule == "colocated":
        run = colocated(job, batches)
    elif schedule == "partial":
        run = partial(job, prompts, setup.steps, setup.engines, setup.oversample, engine_tp=1,
                      per_sequence=per_sequence)
    elif schedule == "streaming":
        run = streaming(job, prompts, setup.steps, setup.engines, setup.eta, engine_tp=1, kv_reserve=kv_reserve,
                        schedule=setup.sim_schedule)
    else:
        run = separate(job, batches, setup.engines, int(schedule[-1]), engine_tp=1)
    return dict(steady(run, job.num_gpus, setup.warmup), preemptions=run.get("preemptions", 0),
                recomputed_tokens=run.get("recomputed_tokens", 0))


def generator_reserve(setup: Setup) -> float:
    """`sim_streaming`'s ``kv_reserve`` at which it admits what `StreamingGenerator` admits: every
    sample holds its prompt plus ``reserve_tokens`` (default ``max_tokens``, the response cap),
    as a multiple of the mean sequence."""
    mean_prompt = sum(setup.lengths.prompt_range) / 2
    reserve = min(setup.reserve_tokens or setup.lengths.response_cap, setup.lengths.response_cap)
    return (mean_prompt + reserve) / (mean_prompt + setup.lengths.mean_response())


def compare(setup: Setup, schedules: Sequence[str]) -> List[tuple]:
    """Rows (schedule, harness figures, simulator figures)."""
    return [(name, harness_figures(setup, name, run_harness(setup, name)), simulator_figures(setup, name))
            for name in schedules]


def table(setup: Setup, rows: List[tuple]) -> str:
    """Step time (difference in %, and per step in the harness's wall milliseconds: what the
    control plane itself costs, times the scale), trainer and engine idle (differences in points),
    the trainers' mean wait a step for samples and in the weight sync, and the engine calls."""
    lines = ["| schedule | step s: harness | simulator | difference | wall ms a step | trainer idle: harness | "
             "simulator | engine idle: harness | simulator | trainers wait a step: samples, weight sync | "
             "engine calls |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, ours, sim in rows:
        step, ref = ours["step_s"], sim["step_s"]
        lines.append(
            f"| {name} | {step:.1f} | {ref:.1f} | {(step - ref) / ref:+.1%} | {(step - ref) / setup.scale * 1e3:+.0f} | "
            f"{ours['trainer_idle']:.1%} | {sim['trainer_idle']:.1%} | {ours['engine_idle']:.1%} | "
            f"{sim['engine_idle']:.1%} | {ours['wait_s']:.1f} s, {ours['sync_s']:.1f} s | {ours['calls']} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, kind, default, text in (
            ("steps", int, Setup.steps, None), ("warmup", int, Setup.warmup, None),
            ("prompts", int, Setup.prompts_per_step, "prompts a step"), ("group", int, Setup.group, None),
            ("trainers", int, Setup.trainers, "trainer ranks, a replica each"),
            ("trainer-gpus", int, Setup.trainer_gpus, "GPUs a trainer rank stands for (a replica's TP x PP x CP)"),
            ("engines", int, Setup.engines, "engine ranks (above --trainers: a replica's prompts sliced over several)"),
            ("scale", float, Setup.scale, "simulated seconds per wall second"),
            ("partial-tokens", int, Setup.partial_tokens, None), ("eta", int, Setup.eta, "streaming's bound"),
            ("stream-iterations", int, Setup.stream_iterations, "streaming: decode iterations a stand-in step"),
            ("reserve-tokens", int, None, "streaming: KV reserved a sample beyond its prompt"),
            ("sim-schedule", str, Setup.sim_schedule, "the simulator's streaming schedule"),
            ("schedules", str, ",".join(SCHEDULES), None)):
        p.add_argument(f"--{name}", type=kind, default=default, help=text)
    p.add_argument("--recipe", action="store_true", help="the streaming recipe's reservation, eta and trainer passes")
    args = p.parse_args(argv)
    from stapo_megatron.recipes import paper, step_model

    stream = paper.qwen3_8b_stream()  # its trainer's passes, as the dry run counts them
    recipe = dict(reserve_tokens=args.reserve_tokens or paper.STREAM_RESERVE_TOKENS, eta=paper.STREAM_STALENESS,
                  forwards=step_model.recipe_forwards(stream),
                  recompute=stream.model.recompute_granularity == "full") if args.recipe else {}
    setup = Setup(**{**dict(steps=args.steps, warmup=args.warmup, prompts_per_step=args.prompts, group=args.group,
                            trainers=args.trainers, trainer_gpus=args.trainer_gpus, engines=args.engines, scale=args.scale,
                            partial_tokens=args.partial_tokens, eta=args.eta, stream_iterations=args.stream_iterations,
                            reserve_tokens=args.reserve_tokens, sim_schedule=args.sim_schedule), **recipe})
    print(f"Qwen3-8B on H100s (stand-ins), {setup.prompts_per_step} prompts x {setup.group} a step at the paper's "
          f"lengths, {setup.trainers} trainer ranks ({setup.trainer_gpus} GPU(s) each), {setup.engines} engine rank(s) (separate), {setup.steps} steps, "
          f"steady state over the last {setup.steps - setup.warmup}, time scale 1/{setup.scale:g}; partial: oversample "
          f"{setup.oversample}, rounds of {setup.partial_tokens} tokens; streaming: eta {setup.eta}, "
          f"{setup.stream_iterations} decode iteration(s) a stand-in step, KV reserve "
          f"{setup.reserve_tokens or 'max_tokens'} a sample (kv_reserve {generator_reserve(setup):.2f}), simulator schedule {setup.sim_schedule}; trainer: "
          f"{setup.forwards} forward pass(es) and the update{' with full recompute' if setup.recompute else ''}")
    rows = compare(setup, args.schedules.split(","))
    print(table(setup, rows))
    if any(name == "partial" for name, _, _ in rows):
        grouped = simulator_figures(setup, "partial", per_sequence=False)
        print(f"simulator, partial rollouts with group admission (a finished group admits the next prompt's): "
              f"step {grouped['step_s']:.1f} s, trainer idle {grouped['trainer_idle']:.1%}, engine idle "
              f"{grouped['engine_idle']:.1%}")
    if any(name == "streaming" for name, _, _ in rows):
        engine, sim = next((ours, sim) for name, ours, sim in rows if name == "streaming")
        print(f"streaming engine: {engine['mean_running']:.1f} samples running on average, clock behind the "
              f"model by at most {engine['max_lag_s']:.1f} s (the harness's Python); preemptions: harness "
              f"{engine['preemptions']}, simulator {sim['preemptions']}; recomputed prefill tokens: harness "
              f"{engine['recomputed_tokens']}, simulator {sim['recomputed_tokens']}")
        mean = simulator_figures(setup, "streaming", kv_reserve=1.0)
        print(f"simulator, streaming at a KV reservation of the mean sequence (kv_reserve 1, not the generator's "
              f"{generator_reserve(setup):.2f}): step {mean['step_s']:.1f} s, trainer idle "
              f"{mean['trainer_idle']:.1%}, engine idle {mean['engine_idle']:.1%}")


if __name__ == "__main__":
    main()
