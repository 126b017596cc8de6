"""The tiny MoE recipe (``tiny_moe_demo``) and its routing-disagreement metric: the multi-process and
end-to-end tests (the single-process ones are in ``tests/trainer/test_routing.py``)."""

import importlib.util
import json
import math
import os
import pytest
from tests.helpers import REPO_DIR as ROOT


@pytest.mark.slow
def test_tiny_moe_launch_runs_and_logs_routing(tmp_path):
    """Two RL steps end to end; both sides fp32, so rollout and training route every token alike
    (the router logits of the two kernels differ by ~1e-6, far below their gaps)."""
    pytest.importorskip("nemo_run")
    from tests.helpers.launch_cli import nemo_run

    run_dir = tmp_path / "moe"
    code, out = nemo_run(tmp_path, "launch/stapo_tiny_moe.py", "steps=2", "warmstart.steps=2", "eval.every=0",
                         "prompts_per_step=8", "minibatch_prompts=8", "micro_batch_size=4", "data.num_train=64",
                         "data.num_eval=8", f"output_dir={run_dir}", "--yes", timeout=900)
    assert code == 0, out[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert math.isfinite(r["loss"]) and 0.0 <= r["reward_mean"] <= 1.0
        # every rank's sequences: 8 prompts x G=8, each at least its prompt's tokens
        assert r["routing_tokens"] >= 64 * 10
        assert r["routing_disagreement_mean"] == 0.0 and r["routing_disagreement_max"] == 0.0
        assert r["routing_expert_mismatch"] == 0.0 and r["rollout_expert_load_max"] >= 1.0
    # the demo-moe table of docs/results.md (examples/demo_moe.py) reads the same rows: one line per step
    spec = importlib.util.spec_from_file_location("demo_moe", os.path.join(ROOT, "examples", "demo_moe.py"))
    demo_moe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo_moe)
    lines = demo_moe.table(rows).splitlines()
    assert "layers 0-2, 0-based" in lines[0] and len(lines) == 2 + len(train)
    assert lines[2].startswith(f"| 1 | {train[0]['loss']:+.4f} | {train[0]['reward_mean']:.3f} | 0 / 0 | ")
