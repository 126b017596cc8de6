"""Tier a: the +1/-1 boxed exact-match reward on answers in the benchmarks' published forms."""

import pytest

from stapo_megatron.rewards.answers import STATUS_OK


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
