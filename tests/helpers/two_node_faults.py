"""A two-node job simulated on this machine for the fault tests: two torchrun agents (c10d
rendezvous on 127.0.0.1, one rank each) running ``fault_script.py`` (or another script with the
same arguments), the root cause each agent prints, and the failure record a rank leaves."""

import json
import os
import subprocess
import sys
import tempfile
import uuid

from stapo_megatron.trainer import faults
from tests.helpers import HELPERS_DIR
from tests.helpers.dist_utils import free_port, kill_marked

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
    port, marker = free_port(), f"{os.getpid()}-{uuid.uuid4().hex}"
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
