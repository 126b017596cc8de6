"""A small resumable training run for the checkpoint tests (torchrun, 2 ranks: DP=2).

Trains a tiny GPTModel with the STAPO loss on synthetic rollouts, saving a checkpoint after every
step and resuming from the newest complete one on start. Appends ``{"step", "loss", "resumed"}``
rows to ``<run_dir>/losses.jsonl`` (rank 0).

    torchrun --nproc-per-node 2 tests/helpers/ckpt_train_script.py RUN_DIR STEPS [KILL_AT]

KILL_AT makes every rank SIGKILL itself at a point of the run it names, so a test crashes the
job at exactly that point whatever the machine's speed: ``update:K`` in the policy update of
step K (step K-1's checkpoint is complete, step K's not begun), ``save:K`` inside step K's
checkpoint save (the model and optimizer shards are written to the temporary directory, the
RNG and trainer state are not).

KILL_AT ``signal:K`` instead tests the save on the scheduler's warning signal: no regular saves;
the run installs `SaveOnSignal`, writes ``<run_dir>/waiting_for_signal`` after step K and waits
there until the signal has arrived (sent by the test, to torchrun or to the ranks); step K+1
then runs, and its step boundary saves and stops with `REQUEUE_EXIT_CODE`, as the trainer does.
"""

import json
import os
import signal
import sys
import time

import torch

from stapo_megatron.mcore import checkpoint as ckpt
from stapo_megatron.method.config import LossConfig
from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
from stapo_megatron.mcore.parallel import destroy_parallel, init_parallel
from stapo_megatron.trainer.preemption import SaveOnSignal, StoppedForRequeue
from stapo_megatron.mcore.config import OptimConfig
from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
from stapo_megatron.recipes.synthetic import build_tiny_gpt, synthetic_rollouts, tiny_gpt_config

VOCAB, PROMPT, RESPONSE = 384, 4, 12


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_inside_save() -> None:
    """Wrap the RNG-state capture, which runs after the shards are written and before publishing."""
    take_rng_state = ckpt._rng_state

    def rng_state_then_die():
        take_rng_state()
        _die()

    ckpt._rng_state = rng_state_then_die


def main(run_dir: str, steps: int, kill_at: str = "") -> None:
    kill_phase, _, kill_step = kill_at.partition(":")
    kill_step = int(kill_step) if kill_step else -1
    groups = init_parallel(1, 1)
    rank = torch.distributed.get_rank()
    dp, dp_rank = torch.distributed.get_world_size(groups.dp), torch.distributed.get_rank(groups.dp)
    model = build_tiny_gpt(tiny_gpt_config(), VOCAB, PROMPT + RESPONSE)
    model, optimizer = wrap_model_and_optimizer(model, OptimConfig(lr=1e-2))
    start, resumed = 0, None
    os.makedirs(run_dir, exist_ok=True)
    stop = SaveOnSignal().install()
    latest = ckpt.find_latest(run_dir)
    if latest:
        start = ckpt.load_checkpoint(latest, model, optimizer)["step"]
        resumed = os.path.basename(latest)
    for step in range(start, steps):
        mbs, _ = synthetic_rollouts(4, 4, PROMPT, RESPONSE, VOCAB, seed=step, micro_batch_size=2)
        mine = mbs[dp_rank::dp]
        ctx = PassContext(model, PROMPT + RESPONSE, groups=groups)
        old_policy_pass(ctx, [mine])
        # a random number drawn each step: resumed RNG state must reproduce it
        noise = torch.rand(1).item()
        if kill_phase == "update" and step + 1 == kill_step:
            _die()
        metrics = policy_update(ctx, optimizer, mine, LossConfig(tau_p=0.003)).metrics
        if kill_phase == "save" and step + 1 == kill_step:
            _kill_inside_save()
        save = lambda: ckpt.save_checkpoint(run_dir, step + 1, model, optimizer, {"note": "test"})  # noqa: E731
        if kill_phase != "signal":
            save()
        if rank == 0:
            with open(os.path.join(run_dir, "losses.jsonl"), "a") as f:
                f.write(json.dumps({"step": step + 1, "loss": metrics["loss"], "noise": noise,
                                    "grad_norm": metrics["grad_norm"], "resumed": resumed}) + "\n")
        if step + 1 < steps and stop.stop_now(saved=kill_phase != "signal", save=save):
            destroy_parallel()
            raise StoppedForRequeue(step + 1)
        if kill_phase == "signal" and step + 1 == kill_step:
            _wait_for_signal(run_dir, stop, rank)
    destroy_parallel()


def _wait_for_signal(run_dir: str, stop: SaveOnSignal, rank: int) -> None:
    """Tell the test (a file) that every rank waits, then wait until this rank got the signal."""
    torch.distributed.barrier()
    if rank == 0:
        open(os.path.join(run_dir, "waiting_for_signal"), "w").close()
    while not stop.received:
        time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
