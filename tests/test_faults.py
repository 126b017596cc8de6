"""Faults of a two-node job, simulated on this machine, and the failure records behind its messages.

Two torchrun agents (``--nnodes 2 --nproc-per-node 1``, c10d rendezvous on 127.0.0.1), one gloo
rank each, run the real launch entry (``tests/fault_script.py``: `entry.run_recipe`, the tiny
recipe cut to 2 steps) with a fault at a point the run itself marks, never at a wall-clock
moment. What is asserted is the mechanism: exit codes, which rank each node's final message
names, what ended the surviving rank's wait (the configured timeout, a closed connection), which
checkpoint the next launch resumes from. No duration is asserted; the subprocess limits are
only there to fail a hung test.
"""

import json
import os
import subprocess
import sys
import tempfile
import uuid

import pytest

from stapo_megatron.mcore import checkpoint as ckpt
from stapo_megatron.trainer import faults
from tests.dist_utils import _free_port, kill_marked

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "fault_script.py")
ROOT_CAUSE = "Root Cause (first observed failure):"


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--max-restarts", "0", *args]


def _two_nodes(output_dir, fault, *overrides):
    """Start the fault script under two torchrun agents; (exit code, output) of each agent.

    The first agent hosts the rendezvous store (as the first node of a Slurm job does); the
    fault is injected on the second one's rank. (Were the failing node the store's host, the
    other agent would lose the store and end at once with torchrun's own
    RendezvousConnectionError, stopping its rank before it could name the failed one.)
    """
    port, marker = _free_port(), f"{os.getpid()}-{uuid.uuid4().hex}"
    logs = [tempfile.TemporaryFile() for _ in range(2)]
    agents = []
    for node, log in enumerate(logs):
        cmd = _torchrun("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                        "--rdzv-id", "faults", "--rdzv-conf", f"join_timeout=300,is_host={int(node == 0)}",
                        SCRIPT, str(output_dir), fault, *overrides)
        env = dict(os.environ, OMP_NUM_THREADS="1", STAPO_TEST_LAUNCH=marker, STAPO_TEST_FAULTY_NODE=str(node))
        agents.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    try:
        codes = [agent.wait(timeout=1200) for agent in agents]  # only a hung test ever gets there
    finally:
        for agent in agents:
            agent.kill()
        kill_marked(marker)
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read().decode(errors="replace"))
        log.close()
    return codes, outputs


def _root_causes(outputs):
    """Each agent's last message, the root cause torchrun prints, and the global rank it names
    (torchrun orders the nodes' ranks by its own node ids): [(rank, cause)] by node."""
    causes = []
    for out in outputs:
        assert ROOT_CAUSE in out, out[-3000:]
        cause = out.rsplit(ROOT_CAUSE, 1)[1]
        causes.append((int(cause.split("rank      : ", 1)[1].split()[0]), cause))
    assert sorted(rank for rank, _ in causes) == [0, 1], outputs
    return causes


def _record(run_dir, rank):
    path = faults.record_path(str(run_dir), rank)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


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
    cmd = _torchrun("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
                    "--rdzv-id", "lonely", SCRIPT, str(tmp_path / "run"), "none")
    env = dict(os.environ, PET_RDZV_CONF="join_timeout=3")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode != 0
    assert "RendezvousTimeoutError" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # no worker ever started


def test_first_failure_names_the_rank(tmp_path, monkeypatch):
    """Records of one launch: an error of a rank's own beats lost connections, the earliest
    first; with none, the rank without a record (killed) is named; other launches' records
    are ignored."""
    run_dir = str(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "3")
    for rank, error in ((0, RuntimeError("[pair.cc:553] Connection closed by peer [10.0.0.2]:4021")),
                        (2, ValueError("bad row 17 in data.jsonl"))):
        monkeypatch.setenv("RANK", str(rank))
        faults.write_record(run_dir, error)
    records = faults.read_records(run_dir)
    assert [r["rank"] for r in records] == [0, 2] and [r["peer_failure"] for r in records] == [True, False]
    assert faults.first_failure(records, 3).startswith("rank 2 failed first (")
    assert faults.first_failure(records, 3).endswith("ValueError: bad row 17 in data.jsonl")
    assert faults.first_failure(records[:1], 3) == (
        "no rank recorded an error of its own; ranks without a record (killed, or not failed yet): [1, 2]")
    assert faults.first_failure(records[:1], 2).startswith("rank 1 failed first: it ended without a failure record")

    # rank 0 fails with a lost connection: a PeerFailure naming rank 2, raised once
    monkeypatch.setenv("RANK", "0")
    lost = faults.failed(run_dir, RuntimeError("Connection reset by peer"))
    assert isinstance(lost, faults.PeerFailure) and "rank 2 failed first" in str(lost)
    assert faults.failed(run_dir, lost) is lost  # an outer handler passes it on as it is
    own = ValueError("x")
    assert faults.failed(run_dir, own) is own  # an error of its own is raised as it is

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the next launch sees none of these
    assert faults.read_records(run_dir) == []
    faults.clear_record(run_dir)  # and a rank starting removes its own old record
    assert not os.path.exists(faults.record_path(run_dir, 0))


@pytest.mark.parametrize("error, peer", [
    (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:22915"), True),
    (RuntimeError("Read error [127.0.0.1]:13700: Connection reset by peer"), True),
    (ValueError("rollout.temperature must be finite"), False),
    (RuntimeError("3 consecutive steps had a NaN/Inf loss"), False),
])
def test_peer_failures_are_told_from_a_rank_s_own(error, peer):
    assert faults.is_peer_failure(error) is peer


def test_store_errors_are_peer_failures():
    import torch.distributed as dist

    assert faults.is_peer_failure(dist.DistStoreError("wait timeout after 10000ms, keys: /default_pg/0//cpu//0/1"))
