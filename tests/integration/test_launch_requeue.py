"""The requeue rules of the job scripts (`stapo_megatron.launch.requeue`), run in real bash: the
multi-process and end-to-end tests (the single-process ones are in
``tests/launch/test_requeue.py``)."""

import os
import subprocess
import pytest
from tests.helpers.launch_cli import SAVE


FAKE_SLURM = {
    # the rendered script asks scontrol for the node list and srun for the head node's address;
    # the job's own srun runs the "training" of FAKE_TRAINING
    "scontrol": '#!/bin/bash\nif [ "$1" = show ]; then echo node1; else echo "$@" >> "$CALLS"; fi\n',
    "srun": '#!/bin/bash\nfor a in "$@"; do [ "$a" = hostname ] && { echo 127.0.0.1; exit 0; }; done\n'
            'bash -c "$FAKE_TRAINING"\n',
}


@pytest.mark.slow
@pytest.mark.parametrize("training, requeued", [
    (SAVE + "exit 1", True),  # a crash after a new checkpoint
    ("exit 1", False),  # a crash without one
    ('echo 5 > "$RUN/stopped_for_requeue"; exit 1', True),  # the save signal
])
def test_the_rendered_nemo_run_script_requeues_what_can_progress(tmp_path, training, requeued):
    """NeMo-Run's own sbatch script of a dry run, run in bash with fake Slurm commands on PATH."""
    pytest.importorskip("nemo_run")
    from tests.helpers.launch_cli import nemo_run, sbatch_script

    run_dir = tmp_path / "run"
    code, out = nemo_run(tmp_path, "launch/stapo_8b.py", "--dryrun", f"output_dir={run_dir}",
                         "run.executor.account=a", "run.executor.container_image=img",
                         f"run.executor.tunnel.job_dir={tmp_path}/jobs",
                         f"run.executor.container_mounts=['{tmp_path}:{tmp_path}']")
    assert code == 0, out
    script = tmp_path / "job.sh"
    script.write_text(sbatch_script(out))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in FAKE_SLURM.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (run_dir / "checkpoints" / "step_00000010").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step_00000010\n")
    calls = tmp_path / "calls"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0",
           "SLURM_JOB_NODELIST": "node1", "CALLS": str(calls), "FAKE_TRAINING": f"RUN={run_dir}; {training}"}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    made = calls.read_text().splitlines() if calls.exists() else []
    assert made == (["requeue 77"] if requeued else []), proc.stdout + proc.stderr
    assert ("requeue 1 of " if requeued else "not requeued") in proc.stdout, proc.stdout
