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
from tests.helpers import REPO_DIR

ROOT = REPO_DIR


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


