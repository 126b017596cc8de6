"""Tier a: a training step's metrics: the MoE metrics averaged over the step's mini-batch updates
(none for a dense model), and the line printed per step with its optional parts (the routing
disagreement of a MoE policy, separate placement's engine times)."""

import pytest

from stapo_megatron.trainer.step_metrics import format_row, moe_metrics

ROW = dict(step=3, eta_s=90.0, rollout_tokens_per_s=1234.4, train_tokens_per_s=567.6, reward_mean=0.25,
           entropy_mean=1.5, silenced_count=7, silenced_fraction=0.0125, tau_h=2.345, loss=-0.01234,
           clip_fraction=0.1, response_len_mean=12.34, rollout_train_logprob_diff=2e-7,
           mismatch_abs_logprob_diff_max=3e-6, mismatch_token_flagged_fraction=0.005, silenced_flagged_count=1,
           time_rollout=1.25, time_reward=0.5, time_old_logprob=0.75, time_train=2.0, time_weight_sync=0.25)


def test_moe_metrics_are_the_mean_over_updates_and_none_when_dense():
    updates = [{"loss": 1.0, "moe/load_balancing_loss": 0.5, "moe/layer_0_load_max": 1.25},
               {"loss": 2.0, "moe/load_balancing_loss": 1.5, "moe/layer_0_load_max": 1.75}]
    assert moe_metrics(updates) == {"moe/load_balancing_loss": 1.0, "moe/layer_0_load_max": 1.5}
    assert moe_metrics([{"loss": 1.0}]) == {} and moe_metrics([]) == {}


def test_the_step_line():
    line = format_row(ROW, steps=10)
    assert line.startswith("step 3/10 (30%) ETA ")
    for part in ("tok/s rollout 1234 train 568", "reward 0.250", "entropy 1.500", "silenced 7 (1.2500%) tau_H 2.345",
                 "loss -0.0123 clip 0.100", "len 12.3", "|dlogp| 2.0e-07 max 3.0e-06", "flagged 0.50% (silenced 1)",
                 "rollout 1.2s reward 0.5s old 0.8s train 2.0s sync 0.2s"):
        assert part in line, part
    assert "routing diff" not in line and "stale" not in line


def test_the_step_line_of_a_moe_policy_with_separate_engines():
    row = dict(ROW, routing_disagreement_mean=0.0158, routing_disagreement_max=0.05, rollout_expert_load_max=1.4,
               staleness=1.0, time_engine_generate=3.5, time_engine_idle=0.5, time_engine_load=0.25)
    line = format_row(row, steps=10)
    assert line.endswith("sync 0.2s | routing diff 1.58% max 5.00% load 1.40 | stale 1 engine gen 3.5s idle 0.5s "
                         "load 0.2s")


@pytest.mark.parametrize("missing", ["reward_mean", "time_train"])
def test_a_row_without_a_metric_the_line_needs_is_an_error(missing):
    with pytest.raises(KeyError, match=missing):
        format_row({k: v for k, v in ROW.items() if k != missing}, steps=10)
