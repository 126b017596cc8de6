"""Separate placement end to end: engines on their own torchrun ranks, the real trainer
and the real vLLM engine over gloo (tests/helpers/separate_script.py). k = 0 writes the colocated
run's metrics exactly; k = 1 trains every step after the first on samples one update old and a
resumed run starts a new pipeline; a killed engine ends the job naming its rank. The colocated, k = 1
and partial-rollout runs write the reference metrics of tests/assets/reference_metrics/ value for
value (fixed seeds: the same maths, `tests.helpers.reference_metrics`)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.dist_utils import free_port
from tests.helpers.two_node_faults import _root_causes, _two_nodes
from tests.helpers import HELPERS_DIR
from tests.helpers.reference_metrics import reference_differences
from tests.helpers.repo_scripts import compare_metrics

differences, load_rows = compare_metrics.differences, compare_metrics.load_rows

SCRIPT = os.path.join(HELPERS_DIR, "separate_script.py")
SEPARATE = ("rollout.mode=separate", "rollout.separate.engine_ranks=1")


def _launch(nproc: int, run_dir, fault: str = "none", *overrides: str, timeout: int = 900):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--max-restarts", "0",
           "--master-port", str(free_port()), SCRIPT, str(run_dir), fault, *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def _train_rows(run_dir):
    return [r for r in load_rows(os.path.join(run_dir, "metrics.jsonl")) if r["kind"] == "train"]


@pytest.mark.slow  # two launches of the tiny recipe (two and three processes), a few minutes
def test_synchronous_separate_placement_writes_the_colocated_metrics(tmp_path):
    """DP = 2 both ways: the one engine serves both replicas, each with its own seeds (a DP = 1
    run would not notice a replica sampled with another's)."""
    colocated = _launch(2, tmp_path / "colocated")
    assert colocated.returncode == 0, colocated.stderr[-4000:]
    separate = _launch(3, tmp_path / "separate", "none", *SEPARATE)
    assert separate.returncode == 0, separate.stderr[-4000:]
    assert reference_differences("colocated_dp2", tmp_path / "colocated") == []  # the same maths as ever
    before = load_rows(tmp_path / "colocated" / "metrics.jsonl")
    after = load_rows(tmp_path / "separate" / "metrics.jsonl")
    assert [r["kind"] for r in after] == ["eval", "train", "train", "train", "eval"]
    # every value the colocated run logs, exactly (wall-clock fields aside)
    assert differences(before, after) == []
    rows = _train_rows(tmp_path / "separate")
    assert [r["staleness"] for r in rows] == [0.0, 0.0, 0.0]
    # it trained (these three steps silence no token at this seed; the reference metrics pin every value)
    assert any(r["loss"] != 0 for r in rows)
    # the engine's reported busy time is the rollout throughput's denominator
    assert all(r["time_engine_generate"] > 0 and r["rollout_tokens_per_s"] > 0 for r in rows)


@pytest.mark.slow  # two launches with three processes (two trainers, one engine), a few minutes
def test_one_step_off_trains_on_one_update_old_samples_and_resumes_with_a_fresh_pipeline(tmp_path):
    run_dir = tmp_path / "run"
    first = _launch(3, run_dir, "none", *SEPARATE, "rollout.separate.max_staleness=1", "steps=4", "save_every=2",
                    "eval.every=0")
    assert first.returncode == 0, first.stderr[-4000:]
    rows = _train_rows(run_dir)
    assert [r["staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]  # (the exact versions: test_rollout_schedule.py)
    assert reference_differences("one_step_off", run_dir) == []  # the same maths as ever
    # requeued: the next launch resumes from step 4 and regenerates what was in flight
    second = _launch(3, run_dir, "none", *SEPARATE, "rollout.separate.max_staleness=1", "steps=6", "save_every=2",
                     "eval.every=0")
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed from" in second.stdout + second.stderr
    rows = _train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # nothing counted twice
    assert [r["staleness"] for r in rows[4:]] == [0.0, 1.0]


@pytest.mark.slow  # one two-node launch that fails after its first step
def test_killed_engine_ends_the_job_naming_its_rank(tmp_path):
    """Two "nodes" (torchrun agents): the trainer is rank 0 and the engine rank 1 (on one node
    torchrun would SIGTERM the trainer as soon as the engine dies, before it could say why). The
    engine dies at its third generate: 1 = evaluation at step 0 (eval.every=3), 2 = step 0, 3 = step 1."""
    codes, outputs = _two_nodes(tmp_path / "run", "engine-kill:3", *SEPARATE, script=SCRIPT)
    assert codes[0] != 0 and codes[1] != 0, outputs
    (survivor, cause), (killed, killed_cause) = _root_causes(outputs)
    assert (survivor, killed) == (0, 1) and "SIGKILL" in killed_cause
    assert "rank 1 failed first: it ended without a failure record, so it was killed" in cause, cause
    assert "rollout engine 0 (rank 1) sent no samples for request" in cause, cause
    assert len(_train_rows(tmp_path / "run")) == 1  # step 1 was trained and logged; nothing after
    record = json.load(open(tmp_path / "run" / "failures" / "rank_00000.json"))
    assert record["peer_failure"], record


@pytest.mark.slow  # two launches with three processes
def test_warning_signal_saves_and_the_engines_stop_cleanly(tmp_path):
    """Slurm's warning signal reaches every rank through torchrun: the trainers save at the next
    step boundary and stop for a requeue; the engine rank ignores it and stops when told (it
    records no failure); the requeued job resumes."""
    from stapo_megatron.launch.requeue import STOPPED_MARKER
    from stapo_megatron.trainer.preemption import torchrun_env

    run_dir = tmp_path / "run"
    args = [*SEPARATE, "rollout.separate.max_staleness=1", "steps=5", "eval.every=0"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--max-restarts", "0",
           "--master-port", str(free_port()), SCRIPT, str(run_dir), "signal:1", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", **torchrun_env(120))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
    try:
        while not (run_dir / "waiting_for_signal").exists():
            assert proc.poll() is None, proc.stderr.read()[-4000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGUSR1)  # to torchrun only, as Slurm's --signal reaches it
        log = proc.communicate(timeout=600)[1]
    finally:
        proc.kill()
    assert proc.returncode != 0, log[-4000:]
    assert (run_dir / STOPPED_MARKER).exists(), log[-4000:]
    assert not (run_dir / "failures").exists() or os.listdir(run_dir / "failures") == []  # the engine too
    assert [r["step"] for r in _train_rows(run_dir)] == [1, 2]  # the signal arrived in step 2: saved, stopped
    resumed = _launch(3, run_dir, "none", *args)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert [r["step"] for r in _train_rows(run_dir)] == [1, 2, 3, 4, 5]


@pytest.mark.slow  # one launch with three processes
def test_partial_rollouts_train_the_first_finished_groups_and_keep_the_rest(tmp_path):
    """k = 1 with partial rollouts at over-sampling 1.5 and 8-token rounds: every step trains its
    replicas' P groups, the pools carry over-sampled groups between steps, tokens of a policy older
    than the bound are counted (and, with the token-age bound at k, left out of the loss); a resumed run
    goes on from the checkpoint's pool account."""
    partial = ("rollout.mode=partial", "rollout.separate.engine_ranks=1", "rollout.separate.max_staleness=1",
               "rollout.partial.oversample=1.5",
               "rollout.partial.round_tokens=8", "rollout.partial.max_token_age=1", "eval.every=0", "save_every=3")
    run = _launch(3, tmp_path / "run", "none", *partial, "steps=3")
    assert run.returncode == 0, run.stderr[-4000:]
    rows = _train_rows(tmp_path / "run")
    assert [r["num_prompts"] for r in rows] == [16, 16, 16]  # each step's P groups, from the pools
    assert reference_differences("partial", tmp_path / "run") == []  # the same maths as ever
    # resumed from the checkpoint at step 3 with new (empty) pools: the trainers send the prompts
    # that were in flight again (the checkpoint's pool account), and the steps go on
    resumed = _launch(3, tmp_path / "run", "none", *partial, "steps=5")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout and "(step 3)" in resumed.stdout, resumed.stdout[-2000:]
    assert [r["num_prompts"] for r in _train_rows(tmp_path / "run")] == [16] * 5
    assert all(r["pool_groups"] > 0 for r in rows)  # the over-sampled groups stay in flight
    assert rows[0]["stale_tokens"] == 0 and rows[0]["token_age_mean"] == 0
    assert [r["staleness"] >= 1 for r in rows[1:]] == [True, True]  # one update old at least (k = 1)
    # rank 0's oldest token past the bound means stale tokens were counted (over DP)
    assert all(r["stale_tokens"] > 0 for r in rows if r["staleness"] > 1)
    assert all(0 <= r["stale_token_fraction"] <= 1 for r in rows)
