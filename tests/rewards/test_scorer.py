"""Tier a: the reward worker processes: a batch scored in order, a time bound in worker CPU seconds
(not wall-clock), a worker that hangs, sleeps or raises, and bad arguments."""

import threading
import time

import pytest

from stapo_megatron.rewards import scorer as rewards_module
from stapo_megatron.rewards.answers import STATUS_OK
from stapo_megatron.rewards.scorer import RewardScorer


# sympy never finishes comparing this with 1 (checked: > 20 s); a real hang, not a test hook.
SLOW_RESPONSE = "so the answer is \\boxed{10^{10^{10^{10}}}}"


def _sleepy_score(response, answer):
    """Test hook run inside the workers: "spin" burns CPU for ever (a pathological parse), "sleep"
    blocks without using CPU, "raise" raises; anything else is correct."""
    if response == "spin":
        while True:
            pass
    if response == "sleep":
        time.sleep(600)
    if response == "raise":
        raise RuntimeError("boom")
    return 1.0, STATUS_OK


def _idle_then_correct(response, answer):
    """Test hook: blocks 1.5 s without using CPU, then scores 1."""
    time.sleep(1.5)
    return 1.0, STATUS_OK


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(num_workers=2, timeout_s=2.0) as s:
        yield s


def test_scorer_batch(scorer):
    responses = ["\\boxed{1/2}", "no box", "\\boxed{3.0}", "\\boxed{4}", "\\boxed{7}"]
    answers = ["0.5", "1", "3", "5", "}{"]
    rewards, stats = scorer.score(responses, answers)
    assert rewards == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert stats == {"num_timeouts": 0, "num_unparseable": 1, "num_bad_answers": 1, "num_errors": 0}
    assert scorer.score([], []) == ([], dict.fromkeys(stats, 0))


def test_scorer_from_thread_bounds_slow_expression(scorer):
    out = {}

    def run():
        t0 = time.monotonic()
        out["result"] = scorer.score(["\\boxed{2}", SLOW_RESPONSE, "\\boxed{6/3}"], ["2", "1", "2"])
        out["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=600)
    rewards, stats = out["result"]
    assert rewards == [1.0, 0.0, 1.0]
    assert stats["num_timeouts"] == 1
    # The killed worker was replaced: the pool still scores.
    assert scorer.score(["\\boxed{5}"] * 3, ["5", "5", "6"])[0] == [1.0, 1.0, 0.0]


def test_scorer_timeout_and_error_paths_with_hook(monkeypatch):
    # The blocked ("sleep") worker is caught by the wall-clock backstop, made short here.
    monkeypatch.setattr(rewards_module, "_ITEM_WALL_FACTOR", 20.0)
    with RewardScorer(num_workers=1, timeout_s=0.5, score_fn=_sleepy_score) as s:
        s.start()
        rewards, stats = s.score(["a", "spin", "raise", "sleep", "b"], ["1"] * 5)
    # One worker: the items after "spin" and "sleep" only ran because it was killed and replaced.
    assert rewards == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert stats["num_timeouts"] == 2 and stats["num_errors"] == 1
    with pytest.raises(RuntimeError, match="after close"):
        s.score(["a"], ["1"])


def test_scorer_limit_counts_worker_cpu_not_wall_clock(monkeypatch):
    """A worker that waits for a core (here: blocked, using no CPU) past ``timeout_s`` of wall time
    is not cut: on a loaded machine a wall-clock limit would score correct answers 0."""
    monkeypatch.setattr(rewards_module, "_ITEM_WALL_FACTOR", 1e6)

    with RewardScorer(num_workers=1, timeout_s=0.2, score_fn=_idle_then_correct) as s:
        rewards, stats = s.score(["idle"], ["1"])
    assert rewards == [1.0] and stats["num_timeouts"] == 0


def test_scorer_bad_arguments(scorer):
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        scorer.score(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="num_workers"):
        RewardScorer(num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardScorer(timeout_s=0)
