"""benchmarks/sim_async.py (the asynchronous schedule's model) against cases worked out by hand.

Every case uses a decode model where one iteration costs exactly 1 s (no KV, per-sequence or
prefill cost), training costs (tokens / trainer GPUs) s and a weight transfer 1 s, so each
schedule's timeline can be written down (the comments give it).
"""

import os
import sys

import pytest

from tests.helpers import REPO_DIR

sys.path.insert(0, os.path.join(REPO_DIR, "benchmarks"))

import sim_async as sim  # noqa: E402

ONE_SECOND = sim.DecodeModel(weight_s=1.0, kv_s_per_token=0.0, seq_s=0.0, prefill_s_per_token=0.0)
# 8 x params x tokens / (1e12 x gpus) = tokens / gpus seconds; transfer 2 x params / 250e9 = 1 s
CAL = sim.Calibration(num_gpus=2, engine_tp=1, params=1.25e11, layers=0, train_tflops=1.0,
                      colocated_sync_s=1.0, transfer_gb_per_s=250.0)


def _batch(first_index):
    """Two prompts of 1 token with one response each, of 2 and 4 tokens: 3 + 5 = 8 tokens."""
    return [sim.Prompt(first_index, 1, [2]), sim.Prompt(first_index + 1, 1, [4])]


def test_the_closed_form_of_m_iterations_sums_the_iterations():
    model = sim.DecodeModel(weight_s=0.5, kv_s_per_token=0.01, seq_s=0.1, prefill_s_per_token=0.0)
    contexts, m = [10, 30, 7], 5
    by_hand = sum(0.5 + 0.1 * len(contexts) + 0.01 * sum(c + j for c in contexts) for j in range(m))
    assert model.time(sum(contexts), len(contexts), m) == pytest.approx(by_hand, rel=1e-12)
    assert model.iterations_within(sum(contexts), len(contexts), by_hand, 100) == m


def test_an_engine_waits_for_kv_room_before_a_response_starts():
    # room for 1 context token: the 4-token response starts only when the 2-token one
    # has finished at t = 2, and then runs 4 iterations: done at 6, not at 4
    model = sim.DecodeModel(weight_s=1.0, kv_s_per_token=0.0, seq_s=0.0, prefill_s_per_token=0.0,
                            kv_capacity_tokens=1)
    engine = sim.Engine(model)
    engine.admit(sim.Prompt(0, 1, [2, 4]), version=0)
    assert [t for t, _, _ in engine.run()] == [2.0, 6.0]


def test_colocated_timeline():
    # per step: engines of 2 and 4 iterations -> 4 s, train 8 tokens / 2 GPUs = 4 s, sync 1 s
    r = sim.colocated(CAL, [_batch(0), _batch(2)], model=ONE_SECOND)
    assert r["time_s"] == 18.0
    assert r["tokens_per_s_per_gpu"] == pytest.approx(16 / 18 / 2)
    assert r["trainer_wait"] == pytest.approx(1 - 8 / 18)
    assert r["engine_idle"] == pytest.approx(1 - (2 + 4 + 2 + 4) / (2 * 18))


@pytest.mark.parametrize("k, total", [
    # k = 0: generate 0-4, train 4-12, weights at 13; generate 13-17, train 17-25
    (0, 25.0),
    # k = 1: the second batch (policy version 0) is generated 4-8 while the first trains 4-12; train 12-20
    (1, 20.0),
])
def test_separate_timeline(k, total):
    r = sim.separate(CAL, [_batch(0), _batch(2)], engine_gpus=1, k=k, model=ONE_SECOND)
    assert r["time_s"] == total
    assert r["trainer_wait"] == pytest.approx(1 - 16 / total)


def test_partial_rollout_timeline_and_staleness():
    # one prompt in flight, one per step. Prompt 0 (2 tokens) is done at 2 and trains 2-5 (3 tokens);
    # prompt 1, admitted at 2 under version 0, decodes 2-5, pauses 5-6 for the new weights, ends at 7,
    # and trains 7-12 (5 tokens) as a sample one version stale
    prompts = [sim.Prompt(0, 1, [2]), sim.Prompt(1, 1, [4]), sim.Prompt(2, 1, [2]), sim.Prompt(3, 1, [2])]
    cal = sim.Calibration(**{**CAL.__dict__, "num_gpus": 2})
    r = sim.partial(cal, prompts, steps=2, per_step=1, engine_gpus=1, oversample=0.0, model=ONE_SECOND)
    assert r["time_s"] == 12.0
    assert r["staleness"] == {0: 1, 1: 1}
    assert r["tokens_per_s_per_gpu"] == pytest.approx(8 / 12 / 2)
