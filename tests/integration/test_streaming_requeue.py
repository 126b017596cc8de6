"""A streaming run killed with positions in flight, then requeued (`stapo_megatron.trainer.
stream_pools`, `stapo_megatron.serve.partial.PoolLedger`): the real trainer and one real vLLM
engine on their own torchrun ranks over gloo (tests/helpers/separate_script.py), eta = 2.

The trainer is SIGKILLed as step 3 returns (its line of ``rollout_order.jsonl`` written, its
checkpoint not): the last checkpoint is step 2's, whose account holds the 3 P positions of steps
2-4 sent and not trained. The requeued run sends them again first; the order log is cut back to
the checkpoint (`RunLogger.resume_from`), so it ends with one line per step and every data
position trained exactly once, in either stream order."""

import json
import os
import subprocess
import sys
import tempfile
import uuid

import pytest

from tests.helpers import HELPERS_DIR
from tests.helpers.dist_utils import free_port, kill_marked

SCRIPT = os.path.join(HELPERS_DIR, "separate_script.py")
P = 4  # prompts a step: the least that keeps a step's groups in flight beside the next steps'
STEPS = 6
STREAMING = ("rollout.mode=streaming", "rollout.separate.engine_ranks=1", "rollout.separate.max_staleness=2",
             f"prompts_per_step={P}", f"minibatch_prompts={P}", "rollout.group_size=4",
             f"steps={STEPS}", "save_every=2", "eval.every=0", "warmstart.steps=0")
"""The tiny recipe cut to what the account needs: one engine, four prompts of four samples a step,
no warm-start (the rewards do not matter here), a checkpoint every two steps."""


def _launch(run_dir, fault: str, *overrides: str):
    """torchrun the script (one trainer rank, one engine rank): (exit code, stdout, stderr's tail).

    A trainer rank SIGKILLed leaves its reward workers behind, holding its output open: every
    process of the launch carries a marker in its environment, and what is left of it afterwards
    is killed (the outputs go to files, so the launch's end is not its orphans' end).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
           "--master-port", str(free_port()), SCRIPT, str(run_dir), fault, *STREAMING, *overrides]
    marker = f"{os.getpid()}-{uuid.uuid4().hex}"
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", STAPO_TEST_LAUNCH=marker)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            code = subprocess.run(cmd, stdout=out, stderr=err, env=env, timeout=900).returncode
        finally:
            kill_marked(marker)
        out.seek(0), err.seek(0)
        return code, out.read().decode(errors="replace"), err.read().decode(errors="replace")[-4000:]


def _order(run_dir):
    with open(os.path.join(run_dir, "rollout_order.jsonl")) as f:
        return [json.loads(line) for line in f]


def _ledger_at(run_dir, step: int) -> dict:
    """The checkpoint of ``step``'s account (one training rank)."""
    from stapo_megatron.mcore.checkpoint import read_trainer_state

    state = read_trainer_state(os.path.join(run_dir, "checkpoints", f"step_{step:08d}"))
    assert state["step"] == step
    (ledger,) = state["pool_ledgers"]
    return ledger


@pytest.mark.slow  # two launches of two processes (one trainer, one engine), under a minute each
@pytest.mark.parametrize("stream_order", ["completion", "admission"])
def test_a_kill_with_positions_in_flight_requeues_every_position_once(tmp_path, stream_order):
    run_dir = tmp_path / "run"
    order = f"rollout.streaming.order={stream_order}"
    code, _, err = _launch(run_dir, "trainer-kill:3", order)
    assert code != 0, err  # killed as step 3 returned: steps 0-3 logged, step 2's checkpoint the last
    killed = _order(run_dir)
    assert [line["step"] for line in killed] == [0, 1, 2, 3]
    ledger = _ledger_at(run_dir, 2)
    trained_before = [p for line in killed[:2] for p in line["positions"]["0"]]
    in_flight = [p for p, _ in ledger["in_flight"]]
    # steps 2, 3 and 4 were asked (eta 2) and none trained: 3 P positions in flight at the checkpoint
    assert ledger["sent_upto"] == 5 * P and len(in_flight) == 3 * P
    assert sorted(trained_before + in_flight) == list(range(5 * P))
    if stream_order == "admission":  # the data order, whatever the timing
        assert [line["positions"]["0"] for line in killed] == [list(range(s * P, (s + 1) * P)) for s in range(4)]

    code, out, err = _launch(run_dir, "none", order)
    assert code == 0, err
    assert "resumed from" in out and "(step 2)" in out, out[-2000:]
    resumed = _order(run_dir)
    assert [line["step"] for line in resumed] == list(range(STEPS))  # one line per step
    assert resumed[:2] == killed[:2]  # what the checkpoint trained is kept as it was
    assert all(len(line["positions"]["0"]) == P for line in resumed)
    trained = [p for line in resumed for p in line["positions"]["0"]]
    assert sorted(trained) == list(range(STEPS * P))  # every data position once, none twice
    if stream_order == "admission":  # the positions in flight at the checkpoint were sent again first
        assert trained == list(range(STEPS * P))
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in metrics if r["kind"] == "train"] == list(range(1, STEPS + 1))
