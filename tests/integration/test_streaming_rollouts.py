"""Streaming rollouts end to end (`stapo_megatron.serve.stream_pools`): the real trainer, the
real vLLM engines on their own torchrun ranks over gloo (tests/helpers/separate_script.py), one
trainer replica whose admission queue two engines share, eta = 2, evaluation between steps.
Every step trains its P groups; the positions each step trained are written down; a requeued
run resumes from the checkpoint's account and trains every data position exactly once; a
killed engine ends the job naming its rank; dynamic sampling replaces the groups whose rewards are
all equal."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import HELPERS_DIR
from tests.helpers.dist_utils import free_port
from tests.helpers.repo_scripts import compare_metrics
from tests.helpers.two_node_faults import _root_causes, _two_nodes

SCRIPT = os.path.join(HELPERS_DIR, "separate_script.py")
STREAMING = ("rollout.mode=streaming", "rollout.separate.max_staleness=2",
             "loss.rollout_correction.mode=tis")
P = 16  # prompts a step (tests/helpers/separate_script.py's recipe)


def _launch(run_dir, *overrides: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--max-restarts", "0",
           "--master-port", str(free_port()), SCRIPT, str(run_dir), "none", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)


def _train_rows(run_dir):
    return [r for r in compare_metrics.load_rows(os.path.join(run_dir, "metrics.jsonl")) if r["kind"] == "train"]


def _trained_positions(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "rollout_order.jsonl"))]


@pytest.mark.slow  # two launches with three processes (one trainer, two engines), about a minute each
def test_streaming_trains_every_position_once_across_a_requeue(tmp_path):
    run_dir = tmp_path / "run"
    first = _launch(run_dir, *STREAMING, "rollout.separate.engine_ranks=2", "steps=4", "save_every=2", "eval.every=2")
    assert first.returncode == 0, first.stderr[-4000:]
    rows = _train_rows(run_dir)
    assert [r["num_prompts"] for r in rows] == [P] * 4
    # the first step's groups started under the first weights; later ones under older weights than
    # the trained policy, each token's age counted (a group admitted j-th trains at j // P: eta 2)
    assert rows[0]["staleness"] == 0 and rows[0]["token_age_max"] == 0
    assert all(0 <= r["token_age_mean"] <= r["token_age_max"] for r in rows)  # (completion order: no upper bound)
    assert any(r["token_age_max"] > 0 for r in rows)
    # the behaviour-policy correction's weights (tis) are logged, and stale groups move them off 1
    assert all(0 < r["is_weight_mean"] and 0 <= r["is_truncated_fraction"] <= 1 for r in rows)
    kinds = [r["kind"] for r in compare_metrics.load_rows(os.path.join(run_dir, "metrics.jsonl"))]
    assert kinds.count("eval") == 3  # at steps 0, 2 and 4: each drained the engines' running groups first
    order = _trained_positions(run_dir)
    assert [line["step"] for line in order] == [0, 1, 2, 3]
    assert all(len(line["positions"]["0"]) == P for line in order)
    # requeued: resumes at step 4; the positions in flight at the checkpoint are sent again
    second = _launch(run_dir, *STREAMING, "rollout.separate.engine_ranks=2", "steps=6", "save_every=2", "eval.every=0")
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed from" in second.stdout and "(step 4)" in second.stdout, second.stdout[-2000:]
    assert [r["step"] for r in _train_rows(run_dir)] == [1, 2, 3, 4, 5, 6]
    trained = [p for line in _trained_positions(run_dir) for p in line["positions"]["0"]]
    assert sorted(trained) == list(range(6 * P))  # every data position once, none twice


@pytest.mark.slow  # one two-node launch that fails in its second step
def test_an_engine_killed_mid_stream_ends_the_job_naming_its_rank(tmp_path):
    """Trainer rank 0 on the first "node", the engine rank 1 on the second; the engine dies at its
    40th decode iteration, in the middle of the first steps' groups."""
    codes, outputs = _two_nodes(tmp_path / "run", "engine-kill-stream:40", *STREAMING, "rollout.separate.engine_ranks=1",
                                "eval.every=0", script=SCRIPT)
    assert codes[0] != 0 and codes[1] != 0, outputs
    (survivor, cause), (killed, killed_cause) = _root_causes(outputs)
    assert (survivor, killed) == (0, 1) and "SIGKILL" in killed_cause
    # the trainer learns it sending weights or waiting for samples, whichever comes first
    assert "rank 1 failed first: it ended without a failure record, so it was killed" in cause, cause


@pytest.mark.slow  # one launch with three processes
def test_dynamic_sampling_replaces_uniform_groups_from_further_prompts(tmp_path):
    """The tiny recipe's first steps are mostly all-wrong groups: most are dropped and replaced
    (4 rounds at most), every step still trains its P groups, and the dropped positions are
    logged apart from the trained ones."""
    from stapo_megatron.trainer.pool_ledger import EXTRA_POSITIONS

    run_dir = tmp_path / "run"
    run = _launch(run_dir, *STREAMING, "rollout.separate.engine_ranks=1", "rollout.streaming.filter_groups=True", "steps=2",
                  "eval.every=0")
    assert run.returncode == 0, run.stderr[-4000:]
    rows = _train_rows(run_dir)
    assert [r["num_prompts"] for r in rows] == [P, P]
    for r in rows:
        assert 0 < r["filter_dropped_groups"] and 0 < r["filter_drop_rate"] < 1 and 1 <= r["filter_rounds"] <= 4
        assert r["filter_drop_rate"] == r["filter_dropped_groups"] / (r["filter_dropped_groups"] + P)
        assert 0 <= r["filter_uniform_left"] <= P
    for line in _trained_positions(run_dir):
        for replica in ("0", "1"):
            trained, dropped = line["positions"][replica], line["dropped"][replica]
            assert len(trained) == P // 2 and not set(trained) & set(dropped)
            # the step's own prompts that were dropped were replaced from the replacement positions
            own = [p for p in trained + dropped if p < EXTRA_POSITIONS]
            assert len(own) == P // 2 and all(p >= EXTRA_POSITIONS for p in set(trained) - set(own))
