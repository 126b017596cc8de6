"""The real launch entry (`entry.run_recipe`, tiny recipe, 2 steps) with a fault injected, for
the fault tests: tests/helpers/two_node_faults.py starts it under two torchrun agents (two "nodes",
one rank each).

    torchrun ... tests/helpers/fault_script.py OUTPUT_DIR FAULT [key=value ...]

FAULT names a point of the run, so that a test fails the job there whatever the machine's
speed (never at a wall-clock moment); the rank that fails is the one whose agent has
``STAPO_TEST_FAULTY_NODE=1`` in its environment:

    none         no fault
    start        the rank raises ValueError before the process group forms (bad input on
                 one node)
    kill:K       the rank SIGKILLs itself as it begins to save step K's checkpoint (step K is
                 logged; step K-1's checkpoint, the script saves every step, is the last
                 complete one)

The ``key=value`` arguments are further top-level overrides (``init_timeout_s=10``).
"""

import ast
import os
import signal
import sys

from stapo_megatron.launch import entry
from stapo_megatron.trainer.loop import Trainer

SMALL = dict(
    steps=2, prompts_per_step=2, minibatch_prompts=2, micro_batch_size=2, save_every=1, eval=dict(every=0),
    data=dict(num_train=8, num_eval=2),
    # transformers rollouts: no vLLM engine to start (the faults are the trainer's, not vLLM's)
    rollout=dict(engine="hf", group_size=2, max_response_len=8),
    warmstart=dict(steps=0),
)
"""The tiny recipe cut to the least that still trains and checkpoints on two ranks."""


def _inject(fault: str) -> None:
    kind, _, where = fault.partition(":")
    if kind not in ("none", "start", "kill"):
        raise ValueError(f"unknown FAULT {fault!r}")
    if os.environ.get("STAPO_TEST_FAULTY_NODE") != "1":
        return
    if kind == "start":
        def fail(*args, **kwargs):
            raise ValueError(f"injected fault: rank {os.environ['RANK']} fails before the process group forms")

        entry.init_process_group = fail
    elif kind == "kill":
        save = Trainer._save

        def save_or_die(self, step):
            if step == int(where):
                os.kill(os.getpid(), signal.SIGKILL)
            return save(self, step)

        Trainer._save = save_or_die


if __name__ == "__main__":
    output_dir, fault = sys.argv[1], sys.argv[2]
    overrides = {k: ast.literal_eval(v) for k, v in (arg.split("=", 1) for arg in sys.argv[3:])}
    _inject(fault)
    entry.run_recipe("tiny", output_dir=output_dir, **{**SMALL, **overrides})
