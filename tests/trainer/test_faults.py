"""Faults of a two-node job, simulated on this machine, and the failure records behind its messages.

Two torchrun agents (``--nnodes 2 --nproc-per-node 1``, c10d rendezvous on 127.0.0.1), one gloo
rank each, run the real launch entry (``tests/helpers/fault_script.py``: `entry.run_recipe`, the tiny
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
from tests.helpers.dist_utils import _free_port, kill_marked
from tests.helpers import TESTS_DIR, HELPERS_DIR

HERE = TESTS_DIR
SCRIPT = os.path.join(HELPERS_DIR, "fault_script.py")
ROOT_CAUSE = "Root Cause (first observed failure):"


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--max-restarts", "0", *args]


def _two_nodes(output_dir, fault, *overrides, script=SCRIPT):
    """Start the fault script (or ``script``, same arguments) under two torchrun agents; (exit
    code, output) of each agent.

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
                        script, str(output_dir), fault, *overrides)
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
