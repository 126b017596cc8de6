"""The save on the scheduler's warning signal (Slurm ``--signal=USR1@S``), with a real SIGUSR1 sent:
the multi-process and end-to-end tests (the single-process ones are in
``tests/trainer/test_preemption.py``)."""

import os
import signal
import subprocess
import sys
import tempfile
import time
import pytest
from stapo_megatron.mcore import checkpoint as ckpt
from stapo_megatron.trainer.preemption import torchrun_env
from tests.helpers.checkpoint_runs import SCRIPT, STEPS, _rows, _run

WAIT_LIMIT_S = 300.0
"""Upper bound on waiting for the run to reach its waiting point (a hang guard, not a timing)."""


@pytest.mark.slow
def test_warning_signal_to_torchrun_saves_the_next_step_and_resume_continues(tmp_path):
    """~40 s: two torchrun launches of the 2-rank checkpoint script."""
    from tests.helpers.dist_utils import free_port

    run_dir, K = tmp_path / "run", 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           SCRIPT, str(run_dir), str(STEPS), f"signal:{K}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", **torchrun_env(WAIT_LIMIT_S))
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        deadline = time.monotonic() + WAIT_LIMIT_S
        while not (run_dir / "waiting_for_signal").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run never reached step 2"
            time.sleep(0.1)
        proc.send_signal(signal.SIGUSR1)  # to torchrun only, as Slurm's --signal reaches it
        returncode = proc.wait(timeout=WAIT_LIMIT_S)
        err.seek(0)
        log = err.read().decode(errors="replace")
    # torchrun ends non-zero after forwarding the signal: the sbatch script requeues the job
    assert returncode != 0, log
    # no regular saves in this mode: the only checkpoint is the one the signal asked for, of the
    # step after the one running when it arrived, and the run stopped there
    names = sorted(n for n in os.listdir(run_dir / "checkpoints") if n.startswith("step_"))
    assert names == [f"step_{K + 1:08d}"], names
    assert ckpt.find_latest(str(run_dir), world_size=2).endswith(names[0])
    assert [r["step"] for r in _rows(run_dir)] == list(range(1, K + 2))

    returncode, log = _run(run_dir)  # the requeued job
    assert returncode == 0, log
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert {r["resumed"] for r in rows[K + 1:]} == {f"step_{K + 1:08d}"}
