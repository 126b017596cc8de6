"""The real launch entry (`entry.run_recipe`, tiny recipe) with a separate ``rollout.mode``
or colocated, and an optional fault on the engine rank, for tests/integration/test_separate_placement.py.

    torchrun --nproc-per-node N tests/helpers/separate_script.py OUTPUT_DIR FAULT [key=value ...]

FAULT: ``none``; ``engine-kill:K``: the engine rank SIGKILLs itself as it begins its K-th
``generate`` (counted from 1; a point of the run, never a wall-clock moment);
``engine-kill-stream:K``: the same at its K-th decode iteration of streaming rollouts;
``trainer-kill:K``: trainer rank 0 SIGKILLs itself after training step K (0-based: its rows and
its line of the rollout order are written, its checkpoint is not); ``signal:K``:
trainer rank 0 writes ``<run_dir>/waiting_for_signal`` after training step K (0-based) and waits
there for the scheduler's warning signal. The ``key=value``
arguments are `entry.parse_arguments`' (``rollout.separate.max_staleness=1``).
"""

import os
import signal
import sys
import time

from stapo_megatron.launch import entry
from stapo_megatron.serve import server
from stapo_megatron.trainer.loop import Trainer

SMALL = dict(
    steps=3, prompts_per_step=16, minibatch_prompts=8, save_every=0, seed=7,
    eval=dict(every=3), data=dict(num_eval=16),
    warmstart=dict(steps=20),
)
"""The tiny recipe cut to a few steps that still learn (a warm-started policy: rewards, silenced tokens)."""


def _wait_for_signal_after(step: int) -> None:
    """Trainer rank 0, after training step ``step`` (0-based): write ``waiting_for_signal`` and
    wait there until the warning signal has arrived (the test sends it to torchrun)."""
    train_step = Trainer.train_step

    def train_then_wait(self, s):
        out = train_step(self, s)
        if s == step and int(os.environ["RANK"]) == 0:
            open(os.path.join(self.cfg.run_dir, "waiting_for_signal"), "w").close()
            while not self.stop_signal.received:
                time.sleep(0.05)
        return out

    Trainer.train_step = train_then_wait


def _inject(fault: str) -> None:
    kind, _, where = fault.partition(":")
    if kind not in ("none", "engine-kill", "engine-kill-stream", "trainer-kill", "signal"):
        raise ValueError(f"unknown FAULT {fault!r}")
    if kind == "none":
        return
    if kind == "signal":
        return _wait_for_signal_after(int(where))
    if kind == "engine-kill-stream":
        return _kill_at_iteration(int(where))
    if kind == "trainer-kill":
        return _kill_trainer_after(int(where))
    build = server.build_engine

    def build_dying(*args, **kwargs):
        engine = build(*args, **kwargs)
        generate, calls = engine.generate, [0]

        def generate_or_die(*a, **k):
            calls[0] += 1
            if calls[0] == int(where):
                os.kill(os.getpid(), signal.SIGKILL)
            return generate(*a, **k)

        engine.generate = generate_or_die
        return engine

    server.build_engine = build_dying


def _kill_at_iteration(iteration: int) -> None:
    """The engine rank SIGKILLs itself as it begins its ``iteration``-th streamed decode iteration."""
    from stapo_megatron.serve.streaming import StreamingGenerator

    step, calls = StreamingGenerator.step, [0]

    def step_or_die(self):
        calls[0] += 1
        if calls[0] == iteration:
            os.kill(os.getpid(), signal.SIGKILL)
        return step(self)

    StreamingGenerator.step = step_or_die


def _kill_trainer_after(step: int) -> None:
    """Trainer rank 0 SIGKILLs itself as training step ``step`` (0-based) returns."""
    train_step = Trainer.train_step

    def train_then_die(self, s):
        out = train_step(self, s)
        if s == step and int(os.environ["RANK"]) == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    Trainer.train_step = train_then_die


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


if __name__ == "__main__":
    output_dir, fault = sys.argv[1], sys.argv[2]
    _inject(fault)
    entry.run_recipe("tiny", output_dir=output_dir, **_merge(SMALL, entry.parse_arguments(sys.argv[3:])))
