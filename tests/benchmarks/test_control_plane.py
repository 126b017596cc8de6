"""benchmarks/control_plane.py at a tiny scale: the real schedule, engine server, transport and
pools on real processes against the sleeping stand-ins, for each schedule. Structure and counts
only (steps done, every sample returned, per-step records complete, one engine call a request),
never timing."""

import os
import sys

import pytest

from tests.helpers import REPO_DIR

sys.path.insert(0, os.path.join(REPO_DIR, "benchmarks"))

import control_plane as cp  # noqa: E402
from sim_model import sample_tokens  # noqa: E402

SETUP = cp.Setup(steps=3, warmup=1, prompts_per_step=4, group=2, scale=1e5, partial_tokens=2048)
"""Three steps of 4 prompts x 2 over two trainers and one engine; a simulated 200 s step sleeps 2 ms."""


@pytest.mark.slow  # five launches of two or three processes, about a minute and a half
@pytest.mark.parametrize("schedule", cp.SCHEDULES)
def test_every_step_trains_every_sample_of_its_replicas(schedule):
    out = cp.run_harness(SETUP, schedule, timeout_s=300)
    per_replica = SETUP.prompts_per_step // SETUP.trainers
    trained = []
    for rank in range(SETUP.trainers):
        rows = out[rank]["rows"]
        assert [r["step"] for r in rows] == list(range(SETUP.steps))
        for r in rows:
            assert set(r) == {"step", "version", "wait", "sync", "train", "end", "tokens", "samples", "groups", "indices"}
            assert (r["groups"], r["samples"]) == (per_replica, per_replica * SETUP.group)
            assert r["tokens"] > 0 and r["train"] > 0
        trained += [i for r in rows for i in r["indices"]]
        versions = [r["version"] for r in rows]
        if schedule == "colocated" or schedule == "k=0":
            assert versions == [0, 1, 2]
        elif schedule == "k=1":
            assert versions == [0, 0, 1]
        elif schedule == "streaming":  # the oldest token's policy: no newer than the step's
            assert versions[0] == 0 and all(v <= s for s, v in enumerate(versions))
        else:  # partial: the request's policy or, for a continued response, an older one
            assert versions[0] == 0 and all(v <= max(0, s - 1) for s, v in enumerate(versions))
        if schedule not in ("partial", "streaming"):  # this replica's share of each step's batch, in order
            assert [r["indices"] for r in rows] == [[p.index for p in SETUP.mine(s, rank)]
                                                    for s in range(SETUP.steps)]
    assert len(trained) == len(set(trained)) == SETUP.steps * SETUP.prompts_per_step  # each prompt trained once
    if schedule == "colocated":
        assert [len(out[r]["calls"]) for r in range(SETUP.trainers)] == [SETUP.steps] * SETUP.trainers
        return
    engine = out[SETUP.trainers]
    assert engine["served"] == SETUP.steps  # every request served, then stopped
    if schedule == "streaming":  # every trained sample has the length drawn for its prompt
        prompts = SETUP.prompts()
        for step in range(SETUP.steps):
            indices = [i for rank in range(SETUP.trainers) for i in out[rank]["rows"][step]["indices"]]
            assert out[0]["rows"][step]["tokens"] == sum(sample_tokens([prompts[i] for i in indices]))
        assert engine["calls"] > 0 and 0 < engine["mean_running"] <= SETUP.prompts_per_step * SETUP.group
    elif schedule != "partial":  # both replicas' slices of a request in one engine call
        assert engine["calls"] == [SETUP.prompts_per_step * SETUP.group] * SETUP.steps
    figures = cp.harness_figures(SETUP, schedule, out)
    assert 0 <= figures["trainer_idle"] <= 1 and 0 <= figures["engine_idle"] <= 1 and figures["step_s"] > 0


def test_the_simulators_kv_reserve_matches_the_generators_reservation():
    """`sim_streaming`'s ``kv_reserve`` for ``--reserve-tokens``: (mean prompt + reserve) / (mean
    prompt + mean response), the reserve capped at the response cap (``max_tokens``), which is
    also the default; the reserve reaches the engines' config as ``rollout.streaming.reserve_tokens``."""
    lengths = SETUP.lengths
    mean_prompt, mean_sequence = sum(lengths.prompt_range) / 2, sum(lengths.prompt_range) / 2 + lengths.mean_response()
    assert cp.generator_reserve(SETUP) == pytest.approx((mean_prompt + 15360) / mean_sequence)
    assert cp.generator_reserve(SETUP) == cp.generator_reserve(cp.Setup(reserve_tokens=10**6))
    at_mean = cp.Setup(reserve_tokens=round(lengths.mean_response()))
    assert cp.generator_reserve(at_mean) == pytest.approx(1.0, abs=1e-4)  # a rounded token
    assert cp._sampling(at_mean, "streaming").streaming.reserve_tokens == round(lengths.mean_response())
    assert cp._sampling(at_mean, "partial").streaming.reserve_tokens is None


RECIPE_SPLIT = cp.Setup(steps=3, warmup=1, prompts_per_step=4, group=2, scale=1e5, trainers=1, engines=2,
                        reserve_tokens=4096, forwards=1, recompute=False)
"""The streaming recipe's split at a tiny scale: one replica's queue over two engines, its
reservation and trainer passes (pi_old only, no recomputation)."""


def test_the_recipe_split_is_simulated_as_built():
    """The simulator beside the harness runs the built queue: one stream a replica over its engines;
    the trainer sleeps the recipe's passes; the engines' config carries the split and the reservation."""
    assert RECIPE_SPLIT.sim_schedule == "queue"
    config = cp._sampling(RECIPE_SPLIT, "streaming")
    assert (config.separate.engine_ranks, config.streaming.reserve_tokens, config.separate.max_staleness) == (2, 4096, 2)
    job = RECIPE_SPLIT.job("streaming")
    assert (job.num_gpus, job.forwards, job.recompute) == (3, 1, False)
    run = cp.streaming(job, RECIPE_SPLIT.prompts(), RECIPE_SPLIT.steps, 2, 2, engine_tp=1,
                       kv_reserve=cp.generator_reserve(RECIPE_SPLIT), schedule=RECIPE_SPLIT.sim_schedule)
    assert run["streams"] == 1 and len(run["step_ends"]) == RECIPE_SPLIT.steps
    assert [p.index for p in RECIPE_SPLIT.mine(1, 0)] == [4, 5, 6, 7]
    assert [p.index for p in cp.Setup(prompts_per_step=4).mine(1, 1)] == [6, 7]  # two trainers: contiguous halves


def test_a_trainer_rank_stands_for_its_replicas_gpus():
    """``trainer_gpus``: one trainer rank as the streaming recipe's TP = 4 replica beside its 12
    engines: the simulator's job counts its 4 GPUs as one replica, the update their share."""
    setup = cp.Setup(trainers=1, trainer_gpus=4, engines=12, prompts_per_step=8)
    job = setup.job("streaming")
    assert (job.num_gpus, job.trainer_replica_gpus) == (16, 4)
    run = cp.streaming(job, setup.prompts(), setup.steps, 12, 2, engine_tp=1, kv_reserve=1.0, schedule="queue")
    assert run["streams"] == 1  # one replica
    tokens = [2000] * 16
    one, four = (sum(cp.trainer_s(cp.QWEN3_8B, cp.H100, job.eff, tokens, g, 1, False)) for g in (1, 4))
    assert four < one


@pytest.mark.slow  # one launch of four processes
def test_one_replica_over_three_engines_shares_its_admission_queue():
    """Streaming with one trainer replica and three engines (the recipe's split, scaled down): the
    engines claim the groups of one queue (which engine runs which depends on timing, so it is not
    asserted), every prompt trains once, each step its P."""
    setup = cp.Setup(steps=3, warmup=1, prompts_per_step=6, group=2, trainers=1, engines=3, scale=1e5)
    out = cp.run_harness(setup, "streaming", timeout_s=300)
    rows = out[0]["rows"]
    assert [(r["step"], r["groups"], r["samples"]) for r in rows] == [(s, 6, 12) for s in range(3)]
    trained = [i for r in rows for i in r["indices"]]
    assert sorted(trained) == sorted(set(trained)) and len(trained) == 18
    engines = [out[r] for r in range(1, 4)]
    assert [e["served"] for e in engines] == [3, 3, 3] and sum(e["calls"] for e in engines) > 0
