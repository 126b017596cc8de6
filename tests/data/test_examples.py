"""Tier a: dataset loading (plain, DAPO-Math-17k, parquet), reasoning-gym splits, prompt formatting."""

import json
import os
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stapo_megatron.data.examples import (DAPO_POSTFIX, DAPO_PREFIX, JUSTRL_PROMPT_TEMPLATE, SUFFIX, Example,
                                 format_prompt, load_examples, reasoning_gym_split, tokenize_prompts)
from stapo_megatron.data.tokenizer import build_char_tokenizer
from tests.helpers import TESTS_DIR

PLAIN_ROWS = [
    {"prompt": "What is 1+1?", "answer": "2"},
    {"prompt": "Half of 1?", "answer": "\\frac{1}{2}", "id": "q-half"},
    {"prompt": "AIME-style", "answer": 204},
]
DAPO_ROWS = [
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": DAPO_PREFIX + "Find $x$ if $x+1=35$." + DAPO_POSTFIX}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "34", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"},
    },
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "system", "content": "ignored"},
                   {"role": "user", "content": "No wrapper here."}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "7", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "b"},
    },
]
DAPO_EXPECTED = [
    Example(prompt="Find $x$ if $x+1=35$.", answer="34", id="9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"),
    Example(prompt="No wrapper here.", answer="7", id="b"),
]


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(str(tmp_path_factory.mktemp("tok")))


def test_load_plain_jsonl(tmp_path):
    examples = load_examples(_write_jsonl(tmp_path / "train.jsonl", PLAIN_ROWS))
    assert examples == [
        Example(prompt="What is 1+1?", answer="2", id="train-1"),
        Example(prompt="Half of 1?", answer="\\frac{1}{2}", id="q-half"),
        Example(prompt="AIME-style", answer="204", id="train-3"),
    ]


def test_load_dapo_layout_jsonl_and_parquet(tmp_path):
    assert load_examples(_write_jsonl(tmp_path / "dapo.jsonl", DAPO_ROWS)) == DAPO_EXPECTED
    path = str(tmp_path / "dapo.parquet")
    pq.write_table(pa.Table.from_pylist(DAPO_ROWS), path)
    assert load_examples(path) == DAPO_EXPECTED


def test_load_plain_parquet(tmp_path):
    path = str(tmp_path / "plain.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": "p1", "answer": "1"}, {"prompt": "p2", "answer": "2"}]), path)
    assert load_examples(path) == [Example("p1", "1", "plain-1"), Example("p2", "2", "plain-2")]


def test_dedupe_warns_with_count(tmp_path):
    path = _write_jsonl(tmp_path / "dup.jsonl", DAPO_ROWS * 3)
    assert len(load_examples(path)) == 6
    with pytest.warns(UserWarning, match="dropped 4 rows"):
        assert load_examples(path, dedupe=True) == DAPO_EXPECTED


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", r"bad.jsonl:2: invalid JSON"),
    ('["a list"]', r"bad.jsonl:2: expected a JSON object"),
    ('{"answer": "1"}', r"bad.jsonl:2: no question"),
    ('{"prompt": "q"}', r"bad.jsonl:2: no answer"),
    ('{"prompt": "q", "answer": ""}', r"bad.jsonl:2: `answer` is empty"),
    ('{"prompt": "q", "answer": null}', r"bad.jsonl:2: `answer` must be a string or number"),
    ('{"prompt": 5, "answer": "1"}', r"bad.jsonl:2: `prompt` must be a string or a list"),
    ('{"prompt": [{"role": "assistant", "content": "x"}], "answer": "1"}', r"bad.jsonl:2: .*no user message"),
])
def test_bad_rows_name_file_and_line(tmp_path, bad_line, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", [PLAIN_ROWS[0], bad_line, PLAIN_ROWS[1]])
    with pytest.raises(ValueError, match=message):
        load_examples(path)


def test_bad_parquet_row_and_bad_files(tmp_path):
    path = str(tmp_path / "bad.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "answer": "1"}, {"prompt": "q", "answer": None}]), path)
    with pytest.raises(ValueError, match=r"bad.parquet:row 2: `answer` must be"):
        load_examples(path)
    with pytest.raises(ValueError, match="expected a .jsonl or .parquet"):
        load_examples(_write_jsonl(tmp_path / "x.csv", PLAIN_ROWS))
    with pytest.raises(ValueError, match="does not exist"):
        load_examples(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="has no rows"):
        load_examples(_write_jsonl(tmp_path / "empty.jsonl", []))


ARITH = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=("+",),
             allow_parentheses=False, allow_negation=False)


def test_reasoning_gym_split_disjoint_and_deterministic():
    train, held_out = reasoning_gym_split("basic_arithmetic", 200, 50, seed=7, **ARITH)
    assert (len(train), len(held_out)) == (200, 50)
    train_q = {e.prompt for e in train}
    held_q = {e.prompt for e in held_out}
    assert len(train_q) == 200 and len(held_q) == 50 and not train_q & held_q
    for e in train[:20]:  # answers are right: "Calculate a + b."
        a, b = e.prompt.removeprefix("Calculate ").rstrip(".").split(" + ")
        assert int(e.answer) == int(a) + int(b)
    again = reasoning_gym_split("basic_arithmetic", 200, 50, seed=7, **ARITH)
    assert again == (train, held_out)
    # The held-out set does not depend on num_train; another seed gives other problems.
    assert reasoning_gym_split("basic_arithmetic", 20, 50, seed=7, **ARITH)[1] == held_out
    assert reasoning_gym_split("basic_arithmetic", 20, 50, seed=8, **ARITH)[1] != held_out


def test_reasoning_gym_split_too_few_unique_questions():
    # One-digit a + b: reasoning-gym draws operands from 0..10, so 121 distinct questions.
    tiny = dict(ARITH, max_digits=1)
    with pytest.raises(ValueError, match="gave only 121 unique questions"):
        reasoning_gym_split("basic_arithmetic", 130, 10, seed=0, **tiny)
    with pytest.raises(ValueError, match="must be >= 0"):
        reasoning_gym_split("basic_arithmetic", -1, 10, seed=0)


def test_format_prompt(tok):
    expected_content = "What is 1+1? " + SUFFIX
    assert format_prompt(tok, "What is 1+1?\n", use_chat_template=False) == expected_content
    assert format_prompt(tok, "What is 1+1?") == (
        "<|im_start|>user\n" + expected_content + "<|im_end|>\n<|im_start|>assistant\n")

    class NoTemplate:
        chat_template = None
        name_or_path = "base-model"

    with pytest.raises(ValueError, match="'base-model' has no chat template"):
        format_prompt(NoTemplate(), "q")


def test_justrl_prompt_wrapper(tok):
    # JustRL's wrapper (the paper recipes'): question, newline, suffix; braces of the suffix stay
    justrl = format_prompt(tok, "What is {x}?", template=JUSTRL_PROMPT_TEMPLATE)
    assert justrl == "<|im_start|>user\nWhat is {x}?\n" + SUFFIX + "<|im_end|>\n<|im_start|>assistant\n"
    assert SUFFIX.endswith("\\boxed{}.")


def test_tokenize_prompts_drops_long_with_one_warning(tok):
    examples = [Example("1+1?", "2", "a"), Example("x" * 200, "1", "long1"), Example("2+2?", "4", "b"),
                Example("y" * 300, "1", "long2")]
    # Character tokenizer: 1 token per char; the template adds <|im_start|> user \n ... <|im_end|>
    # \n <|im_start|> assistant \n = 19 tokens, the content is question + " " + SUFFIX.
    overhead = 19 + 1 + len(SUFFIX)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ids, kept, num_dropped = tokenize_prompts(tok, examples, max_prompt_len=overhead + 100)
    assert [str(w.message) for w in caught] == [
        f"dropped 2 of 4 prompts longer than max_prompt_len={overhead + 100} tokens "
        "(first ids: ['long1', 'long2'])"]
    assert num_dropped == 2 and [e.id for e in kept] == ["a", "b"]
    assert [len(x) for x in ids] == [overhead + 4, overhead + 4]
    assert ids[0] == tok.encode(format_prompt(tok, "1+1?"))
    # Exactly at the limit is kept.
    assert tokenize_prompts(tok, examples[:1], max_prompt_len=overhead + 4)[2] == 0
    with pytest.raises(ValueError, match="max_prompt_len must be positive"):
        tokenize_prompts(tok, examples, max_prompt_len=0)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_answer_is_refused_naming_file_and_row(tmp_path, value):
    # parquet/pandas store a missing answer as NaN; str() would make it the answer "nan"
    # (and a response \boxed{nan} would score 1).
    path = str(tmp_path / "nan.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "answer": 1.5}, {"prompt": "q2", "answer": value}]), path)
    with pytest.raises(ValueError, match=rf"nan.parquet:row 2: `answer` is {value} \(a missing value\)"):
        load_examples(path)
    dapo = dict(DAPO_ROWS[0], reward_model={"ground_truth": value})
    path = str(tmp_path / "dapo.parquet")
    pq.write_table(pa.Table.from_pylist([dapo]), path)
    with pytest.raises(ValueError, match=r"dapo.parquet:row 1: `reward_model.ground_truth` is"):
        load_examples(path)


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "q", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid UTF-8 \(invalid continuation byte at byte 15"):
        load_examples(str(path))


def test_every_prompt_too_long_is_an_error(tok):
    # An empty training or held-out set must stop the run at setup, not log eval_accuracy = nan.
    examples = [Example("x" * 200, "1", "long1"), Example("y" * 300, "1", "long2")]
    overhead = 19 + 1 + len(SUFFIX)  # see test_tokenize_prompts_drops_long_with_one_warning
    message = (rf"all 2 prompts are longer than max_prompt_len=50 tokens \(shortest {200 + overhead}, "
               rf"longest {300 + overhead}; first ids \['long1', 'long2'\]\)")
    with pytest.raises(ValueError, match=message):
        tokenize_prompts(tok, examples, max_prompt_len=50)
    assert tokenize_prompts(tok, [], max_prompt_len=50) == ([], [], 0)  # no held-out set asked for


DATA_DIR = os.path.join(TESTS_DIR, "assets")
"""HF dataset folders written by the real `datasets` package (tests/assets/make_hf_datasets.py)."""


def test_hf_dataset_folder_with_field_mapping():
    # two shards, read in state.json's order; a list answer is joined, a dotted field reads a nested one
    folder = os.path.join(DATA_DIR, "math_dataset")
    examples = load_examples(folder, prompt_field="question", answer_field="final_answer")
    assert [(e.prompt, e.answer) for e in examples] == [
        ("What is 1+1?", "2"), ("What is 2+3?", "5"), ("Name both roots of x^2=1.", "1, -1"),
        ("What is 10/4?", "\\frac{5}{2}")]
    assert [e.id for e in examples] == ["10", "11", "12", "13"]  # the rows' `idx` (data.rows.ID_FIELDS)
    nested = load_examples(folder, prompt_field="question", answer_field="meta.gt")
    assert [e.answer for e in nested] == ["2", "5", "\\pm 1", "2.5"]
    # one split of a DatasetDict is a dataset folder
    assert load_examples(os.path.join(DATA_DIR, "math_dict", "test"), prompt_field="question",
                         answer_field="meta.gt") == [Example("What is 10/4?", "2.5", "13")]


def test_field_mapping_in_jsonl_and_missing_fields(tmp_path):
    path = _write_jsonl(tmp_path / "mapped.jsonl", [{"q": "p1", "sol": {"final": 3}, "answer": "ignored"}])
    assert load_examples(path, prompt_field="q", answer_field="sol.final") == [Example("p1", "3", "mapped-1")]
    # only the prompt named: the answer is found as in the plain layout
    assert load_examples(path, prompt_field="q") == [Example("p1", "ignored", "mapped-1")]
    with pytest.raises(ValueError, match=r"mapped.jsonl:1: no field 'question' \(prompt_field = 'question'\); "
                                         r"fields present: \['answer', 'q', 'sol'\]"):
        load_examples(path, prompt_field="question")
    with pytest.raises(ValueError, match=r"mapped.jsonl:1: no field 'sol.gt' \(answer_field = 'sol.gt'\); "
                                         r"fields present in 'sol': \['final'\]"):
        load_examples(path, prompt_field="q", answer_field="sol.gt")
    with pytest.raises(ValueError, match=r"mapped.jsonl:1: no question: expected one of prompt, problem, question "
                                         r"\(or name its field with prompt_field\)"):
        load_examples(path)


def test_hf_dataset_folder_errors(tmp_path):
    with pytest.raises(ValueError, match=r"math_dict' is an HF DatasetDict with splits \['train', 'test'\]: "
                                         r"give one split's folder, e.g. '.*math_dict/train'"):
        load_examples(os.path.join(DATA_DIR, "math_dict"))
    with pytest.raises(ValueError, match="is a folder but not an HF dataset folder"):
        load_examples(str(tmp_path))
    (tmp_path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    with pytest.raises(ValueError, match="names 'data-00000-of-00001.arrow', which is not in"):
        load_examples(str(tmp_path))
