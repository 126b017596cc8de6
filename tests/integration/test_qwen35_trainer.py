"""End to end: STAPO steps of the real trainer on a tiny Qwen3.5 (``tiny_qwen35_demo``'s model: three
gated delta-net layers, then gated full attention) with HF-engine rollouts synced every step, math
rewards and Megatron (packed micro-batches: the delta net runs per sequence of ``cu_seqlens``).
The policy is barely warm-started, so the reward is `tests/helpers/digit_reward.py`'s dense one."""

import json
import math
import os
import subprocess
import sys

import pytest

from stapo_megatron.mcore import checkpoint as ckpt
from tests.helpers import HELPERS_DIR, REPO_DIR
from tests.helpers.dist_utils import _free_port


pytestmark = pytest.mark.slow

STEPS, WARMSTART_STEPS = 2, 2

SYNCED_MEAN_ATOL, SYNCED_MAX_ATOL = 1e-4, 1e-3
"""Engine vs trainer log-probs at k = 0 (both fp32, synced before each step's rollouts): the bounds of
the Qwen3 trainer test (tests/integration/test_trainer.py); the tiny Qwen3.5's own fixed-sequence
bound, 2 x FP32_LOGIT_TOL x logit scale, is derived in tests/integration/test_qwen35_rollouts.py."""


def test_stapo_steps_on_a_tiny_qwen35(tmp_path):
    from stapo_megatron.recipes.tiny import prepare_tiny_model

    model_dir, run_dir = tmp_path / "model", tmp_path / "run"
    prepare_tiny_model(str(model_dir), "tiny_qwen35")
    with open(model_dir / "config.json") as f:
        assert json.load(f)["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={_free_port()}",
           os.path.join(HELPERS_DIR, "qwen35_trainer_script.py"), str(run_dir), str(model_dir), str(STEPS),
           str(WARMSTART_STEPS)]
    # the script names the test reward by its dotted path: the checkout on the children's path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_DIR, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        print(f"step {r['step']}: loss {r['loss']:+.4g}, reward {r['reward_mean']:.3f}, grad_norm {r['grad_norm']:.3g}, "
              f"approx_kl {r['approx_kl']:.3g}, rollout_train_logprob_diff {r['rollout_train_logprob_diff']:.3g}, "
              f"max {r['mismatch_abs_logprob_diff_max']:.3g}, silenced {r['silenced_count']}")
        assert math.isfinite(r["loss"]) and r["skipped"] == 0 and 0 < r["reward_mean"] < 1 and r["grad_norm"] > 0
        assert r["num_prompts"] == 8 and r["response_len_mean"] > 0
        # the engine samples with the weights Megatron trains (synced before every step's rollouts)
        assert r["rollout_train_logprob_diff"] < SYNCED_MEAN_ATOL and r["mismatch_abs_logprob_diff_max"] < SYNCED_MAX_ATOL
        assert r["mismatch_token_flagged_fraction"] == 0
    assert any(r["silenced_count"] > 0 for r in train), "the loose tau_p must make S2T silence tokens"
    # two mini-batches a step: where the second one's pi differs from pi_old, the first update moved the weights
    assert any(r["approx_kl"] > 0 for r in train)
    latest = ckpt.find_latest(str(run_dir), world_size=1)
    assert latest is not None and latest.endswith(f"step_{STEPS:08d}")
