"""Faults of a two-node job, simulated on this machine, and the failure records behind its messages.

Two torchrun agents (``--nnodes 2 --nproc-per-node 1``, c10d rendezvous on 127.0.0.1), one gloo
rank each, run the real launch entry (``tests/helpers/fault_script.py``: `entry.run_recipe`, the tiny
recipe cut to 2 steps) with a fault at a point the run itself marks, never at a wall-clock
moment. What is asserted is the mechanism: exit codes, which rank each node's final message
names, what ended the surviving rank's wait (the configured timeout, a closed connection), which
checkpoint the next launch resumes from. No duration is asserted; the subprocess limits are
only there to fail a hung test.
"""

import os

import pytest

from stapo_megatron.trainer import faults


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
