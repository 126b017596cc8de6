"""Tier a: the math-verify reward: the last \\boxed{} of a response, equivalence and its statuses,
and scoring off the main thread."""

import threading

import pytest

from stapo_megatron.rewards.answers import (STATUS_BAD_ANSWER, STATUS_OK, STATUS_UNPARSEABLE, extract_boxed,
                                           math_reward, score_response)


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
