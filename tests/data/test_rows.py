"""Tier a: one data row as an `Example`: where the question, the answer and the id are looked for
(DAPO-Math-17k's chat prompt and nested ground truth, MATH's worked solution, OlympiadBench's list
of answers), and each malformed row named with its location and the fields it has."""

import math

import pytest

from stapo_megatron.data.rows import DAPO_POSTFIX, DAPO_PREFIX, Example, answer_to_str, example_from_row, field_value


def test_dapo_row_chat_prompt_nested_answer_and_index():
    row = {"prompt": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": DAPO_PREFIX + "What is 6 x 7?" + DAPO_POSTFIX}],
           "reward_model": {"ground_truth": "42"}, "extra_info": {"index": 17}}
    assert example_from_row(row, "d.parquet:1", "d-1") == Example(prompt="What is 6 x 7?", answer="42", id="17")


def test_math_solution_is_its_last_box_and_a_list_joins():
    row = {"problem": "x?", "solution": "first \\boxed{1}, then \\boxed{\\frac{1}{2}}"}
    assert example_from_row(row, "m.jsonl:3", "m-3") == Example(prompt="x?", answer="\\frac{1}{2}", id="m-3")
    olympiad = {"question": "roots?", "final_answer": ["$2$", "$-2$"], "unique_id": "ob/5"}
    assert example_from_row(olympiad, "o:1", "o-1") == Example(prompt="roots?", answer="2, -2", id="ob/5")
    # a named field is the answer as it stands, even when it is called `solution`
    named = example_from_row({"q": "y?", "solution": "7"}, "w:1", "w-1", prompt_field="q", answer_field="solution")
    assert (named.prompt, named.answer) == ("y?", "7")


def test_answers_as_text():
    assert answer_to_str(12.0, "a:1", "answer") == "12"  # amc23 writes integer answers as floats
    assert answer_to_str(0.5, "a:1", "answer") == "0.5" and answer_to_str(" 7 ", "a:1", "answer") == "7"
    with pytest.raises(ValueError, match=r"^a:1: `answer` is nan \(a missing value\), not an answer$"):
        answer_to_str(math.nan, "a:1", "answer")
    with pytest.raises(ValueError, match=r"^a:1: `answer` must be a string or number, got bool$"):
        answer_to_str(True, "a:1", "answer")


def test_a_missing_field_names_the_setting_and_the_fields_present():
    with pytest.raises(ValueError) as info:
        field_value({"reward_model": {"style": "rule"}}, "reward_model.ground_truth", "f:2", "answer_field")
    assert str(info.value) == ("f:2: no field 'reward_model.ground_truth' (answer_field = "
                               "'reward_model.ground_truth'); fields present in 'reward_model': ['style']")
    with pytest.raises(ValueError, match=r"^f:4: no question: expected one of prompt, problem, question .* "
                                         r"fields present: \['answer', 'text'\]$"):
        example_from_row({"text": "hi", "answer": "1"}, "f:4", "f-4")
    with pytest.raises(ValueError, match=r"^f:5: no answer: expected one of answer, reward_model.ground_truth, "
                                         r"final_answer, solution .* fields present: \['prompt'\]$"):
        example_from_row({"prompt": "hi"}, "f:5", "f-5")
    with pytest.raises(ValueError, match=r"^f:6: `solution` has no \\boxed\{\} final answer$"):
        example_from_row({"problem": "p", "solution": "no box"}, "f:6", "f-6")
