"""The tiny MoE recipe (``tiny_moe_demo``) and its routing-disagreement metric.

- tier a: `route_disagreement` / `routing_metrics` on hand-made routes; the recipe's layout.
- slow: ``nemo-run launch/stapo_tiny_moe.py`` for 2 RL steps (2 processes, EP=2 over gloo, HF
  engine rollouts), its metrics read back from metrics.jsonl.
"""

import importlib.util
import json
import math
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_route_disagreement_counts_sets_not_orders():
    from stapo_megatron.trainer.routing import route_disagreement, routing_metrics

    # 3 tokens x 2 layers, top-2 of 4 experts
    rollout = torch.tensor([[[0, 1], [2, 3]], [[1, 0], [0, 2]], [[3, 2], [1, 3]]])
    train = torch.tensor([[[1, 0], [2, 3]], [[1, 2], [0, 2]], [[0, 1], [1, 3]]])
    differ, missed = route_disagreement(rollout, train, 4)
    assert differ.tolist() == [[False, False], [True, False], [True, False]]  # order within the set is ignored
    assert missed.tolist() == [[0, 0], [1, 0], [2, 0]]
    train_map = torch.zeros(3, 2, 4, dtype=torch.bool).scatter_(-1, train, True)  # Megatron's routing_map layout
    assert torch.equal(route_disagreement(rollout, train_map, 4)[0], differ)
    counts = torch.stack([differ.sum(0), missed.sum(0), torch.full((2,), 3)]).double()
    row = routing_metrics(counts, top_k=2)
    assert row["routing_disagreement_mean"] == pytest.approx((2 / 3 + 0) / 2)
    assert row["routing_disagreement_max"] == pytest.approx(2 / 3)
    assert row["routing_expert_mismatch"] == pytest.approx(3 / (2 * 6))  # 3 of 12 chosen experts moved
    assert row["routing_tokens"] == 3
    with pytest.raises(ValueError, match="same tokens"):
        route_disagreement(rollout, train[:2], 4)


def test_rollout_expert_load_counts_every_routed_token():
    from stapo_megatron.rollout.base import Sample
    from stapo_megatron.trainer.routing import rollout_expert_load

    routes = torch.tensor([[[0, 1], [2, 3]], [[1, 0], [0, 2]], [[3, 2], [1, 3]]])
    sample = Sample(token_ids=[1], logprobs=[0.0], text="", finish_reason="stop", routed_experts=routes)
    load = rollout_expert_load([sample, sample], 4)
    # layer 0 sends tokens to {0,1}, {0,1}, {2,3}; layer 1 to {2,3}, {0,2}, {1,3}; two samples
    assert load.tolist() == [[4, 4, 2, 2], [2, 2, 4, 4]]


def test_tiny_moe_recipe_layout():
    from stapo_megatron.launch.entry import build_config
    from stapo_megatron.recipes.tiny import tiny_qwen3_moe_config

    cfg, warmstart = build_config("tiny_moe", output_dir="runs/x")
    assert cfg.model.expert_model_parallel_size == 2 and cfg.rollout.engine == "hf" and cfg.rollout.routing_every == 1
    assert warmstart.steps > 0 and cfg.steps <= 10
    config = tiny_qwen3_moe_config(100, 1, 0)
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (4, 2, True)
    with pytest.raises(ValueError, match="routing_every"):
        build_config("tiny_moe", rollout={"routing_every": -1})


@pytest.mark.slow
def test_tiny_moe_launch_runs_and_logs_routing(tmp_path):
    """Two RL steps end to end; both sides fp32, so rollout and training route every token alike
    (the router logits of the two kernels differ by ~1e-6, far below their gaps)."""
    pytest.importorskip("nemo_run")
    from tests.test_launch import nemo_run

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
    # the README's demo-moe table (examples/demo_moe.py) reads the same rows: one line per step
    spec = importlib.util.spec_from_file_location("demo_moe", os.path.join(ROOT, "examples", "demo_moe.py"))
    demo_moe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo_moe)
    lines = demo_moe.table(rows).splitlines()
    assert "layers 0-2, 0-based" in lines[0] and len(lines) == 2 + len(train)
    assert lines[2].startswith(f"| 1 | {train[0]['loss']:+.4f} | {train[0]['reward_mean']:.3f} | 0 / 0 | ")
