"""Tier a: boxed-answer extraction, math-verify equivalences, and the time-bounded RewardScorer."""

import threading
import time

import pytest

from stapo_megatron.rewards import scorer as rewards_module
from stapo_megatron.rewards.answers import (STATUS_BAD_ANSWER, STATUS_OK, STATUS_UNPARSEABLE, extract_boxed,
                                           math_reward, score_response)
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


@pytest.mark.parametrize("text, expected", [
    ("The answer is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
    ("first \\boxed{1}, then \\boxed{ 2 } wins", "2"),  # the last box, stripped
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are not structure
    ("\\boxed{a_{b_{c}}} and text {}", "a_{b_{c}}"),
    ("$\\boxed 5$.", "5"),  # brace-less form
    ("\\boxed 7.", "7"),
    ("\\boxed{}", ""),
    ("no box here", None),
    ("\\boxed{3} then cut off \\boxed{\\frac{1}{", None),  # last box truncated
    ("\\boxedx", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("response, answer", [
    ("\\boxed{0.5}", "1/2"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{\\frac12}", "\\frac{1}{2}"),
    ("\\boxed{3.0}", "3"),
    ("\\boxed{3}", "3.0"),
    ("\\boxed{-4}", "-4"),
    ("\\boxed{1+x}", "x+1"),
    ("\\boxed{\\{2,1\\}}", "\\{1,2\\}"),
    ("\\boxed{x=2}", "2"),
    ("\\boxed{8}", "$8$"),  # reference in math mode
    ("\\boxed{8}", "\\boxed{8}"),  # boxed reference
    ("\\boxed{Yes}", "Yes"),  # exact text match needs no parsing
])
def test_math_reward_equivalent(response, answer):
    assert math_reward("Reasoning...\n" + response, answer) == 1.0


@pytest.mark.parametrize("response, answer", [
    ("\\boxed{4}", "3"),
    ("\\boxed{0.51}", "1/2"),
    ("\\boxed{x+2}", "x+1"),
    ("\\boxed{3} ... actually \\boxed{5}", "3"),  # only the last box counts
    ("the answer is 3", "3"),  # no box
    ("\\boxed{\\frac{}{}}", "3"),  # parses (to something), still wrong
])
def test_math_reward_wrong(response, answer):
    assert math_reward(response, answer) == 0.0


@pytest.mark.parametrize("response", ["", "}{", "\\boxed{", "\\boxed{}", "\\boxed{}{}}",
                                      "\x00\x01", "\\boxed{" * 50])
def test_garbage_scores_zero_unparseable(response):
    assert score_response(response, "3") == (0.0, STATUS_UNPARSEABLE)


def test_statuses():
    assert score_response("\\boxed{3}", "3") == (1.0, STATUS_OK)
    assert score_response("\\boxed{4}", "3") == (0.0, STATUS_OK)
    assert score_response("\\boxed{4}", "}{") == (0.0, STATUS_BAD_ANSWER)


def test_math_reward_off_main_thread():
    # math-verify's own signal timeouts would raise here; ours are disabled.
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("\\boxed{\\frac{2}{4}}", "0.5")))
    t.start()
    t.join()
    assert out == [1.0]


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


# -- boxed_exact_match on answers in the benchmarks' published forms (issue 36, item 2) ---------

@pytest.mark.parametrize("response,answer,reward", [
    ("\\boxed{12}", "12.0", 1.0),  # amc23 publishes integer answers as floats
    ("\\boxed{12.0}", "12", 1.0),
    ("\\boxed{0.5}", "0.50", 1.0),
    ("\\boxed{13}", "12.0", -1.0),
    ("\\boxed{120}", "12.0", -1.0),
    ("\\boxed{2, -2}", "$2$, $-2$", 1.0),  # OlympiadBench's final_answer list, joined as before
    ("\\boxed{-2, 2}", "$2$, $-2$", 1.0),  # a set of answers: any order
    ("\\boxed{2}", "$2$, $-2$", -1.0),  # half of the answers is wrong
    ("\\boxed{2, -2}", "2, -2", 1.0),  # as prepare_data now writes it
    ("\\boxed{(2,1)}", "(1,2)", -1.0),  # an ordered pair is one answer, not a set
])
def test_boxed_exact_match_on_published_answers(response, answer, reward):
    from stapo_megatron.rewards.functions import boxed_exact_match

    assert boxed_exact_match(f"so the answer is {response}.", answer) == (reward, STATUS_OK)
