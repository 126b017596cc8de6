"""Faults of a two-node job, simulated on this machine, and the failure records behind its messages:
the multi-process and end-to-end tests (the single-process ones are in
``tests/trainer/test_faults.py``)."""

import json
import os
import subprocess
import pytest
from stapo_megatron.mcore import checkpoint as ckpt
from tests.helpers.dist_utils import free_port
from tests.helpers.two_node_faults import SCRIPT, _record, _root_causes, _torchrun, _two_nodes  # noqa: F401


@pytest.mark.slow  # one two-node launch: 30 s to minutes of imports on a loaded 2-core machine
def test_rank_failing_before_the_group_forms_ends_the_job_naming_it(tmp_path):
    """Bad input on one node: its rank fails before the process group forms. The other rank
    stops after ``init_timeout_s`` (not gloo's 30 minutes), and its node's last message names
    the failed rank and its error, not the store timeout."""
    codes, outputs = _two_nodes(tmp_path / "run", "start", "init_timeout_s=10")
    assert codes[0] != 0 and codes[1] != 0, outputs
    (survivor, survivor_cause), (failed, failed_cause) = _root_causes(outputs)
    assert f"ValueError: injected fault: rank {failed} fails before the process group forms" in failed_cause
    assert (f"PeerFailure: rank {survivor} stopped because another rank failed: rank {failed} failed first"
            in survivor_cause and f"ValueError: injected fault: rank {failed}" in survivor_cause), survivor_cause
    record = _record(tmp_path / "run", survivor)
    assert record["peer_failure"], record
    if survivor == 0:
        # the workers' store lives with rank 0: what ended its wait is the configured init
        # timeout (10 s). (torchrun orders ranks by process id, so the failed node's rank is
        # almost always rank 1; were it rank 0, the survivor would lose the store at once.)
        assert "DistStoreError: wait timeout after 10000ms" in record["error"], record
    assert not _record(tmp_path / "run", failed)["peer_failure"]


@pytest.mark.slow  # two two-node launches of the real trainer (rollouts, rewards, checkpoints)
def test_killed_rank_ends_the_job_and_the_next_launch_resumes(tmp_path):
    run_dir = tmp_path / "run"  # fresh: the tiny model folder is written once, by global rank 0
    # the second node's rank is SIGKILLed as it begins to save step 2 (step 2 is logged, step 1 saved)
    codes, outputs = _two_nodes(run_dir, "kill:2")
    assert codes[0] != 0 and codes[1] != 0, outputs
    (survivor, survivor_cause), (killed, killed_cause) = _root_causes(outputs)
    assert "exitcode  : -9" in killed_cause and "SIGKILL" in killed_cause
    assert (f"PeerFailure: rank {survivor} stopped because another rank failed: rank {killed} failed first: "
            "it ended without a failure record, so it was killed" in survivor_cause), survivor_cause
    # the survivor noticed the closed connection (no timeout involved); the killed rank wrote nothing
    record = _record(run_dir, survivor)
    assert record["peer_failure"] and "by peer" in record["error"], record
    assert _record(run_dir, killed) is None
    assert os.path.basename(ckpt.find_latest(str(run_dir), world_size=2)) == "step_00000001"
    assert os.path.isfile(run_dir / "model" / "config.json")
    assert [n for n in os.listdir(run_dir) if n.startswith("model")] == ["model"]  # no second writer's copy

    codes, outputs = _two_nodes(run_dir, "none")
    assert codes == [0, 0], outputs
    assert any(f"resumed from {run_dir}/checkpoints/step_00000001 (step 1)" in out for out in outputs), outputs
    with open(run_dir / "metrics.jsonl") as f:
        steps = [row["step"] for row in map(json.loads, f) if row["kind"] == "train"]
    assert steps == [1, 2], steps  # step 2, logged before the kill, is not repeated
    assert os.path.basename(ckpt.find_latest(str(run_dir), world_size=2)) == "step_00000002"
    assert _record(run_dir, survivor) is None  # the failed launch's records are gone


@pytest.mark.slow  # starts torchrun (torch's import, ~10 s)
def test_node_never_joining_ends_the_rendezvous(tmp_path):
    """A node that never starts: the other agent gives up after the rendezvous ``join_timeout``,
    which Slurm jobs set through torchrun's PET_RDZV_CONF variable (a node's agent reads its
    options' defaults from PET_* variables)."""
    from stapo_megatron.launch import executors

    assert executors.CLUSTER_ENV["PET_RDZV_CONF"] == f"join_timeout={executors.RDZV_JOIN_TIMEOUT_S}"
    cmd = _torchrun("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                    "--rdzv-id", "lonely", SCRIPT, str(tmp_path / "run"), "none")
    env = dict(os.environ, PET_RDZV_CONF="join_timeout=3")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode != 0
    assert "RendezvousTimeoutError" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # no worker ever started
