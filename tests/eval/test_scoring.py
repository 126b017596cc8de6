"""Tier a: benchmark loading, evaluation sets and avg@k / pass@k on a hand-made generator with known
correctness."""

import json
import os

import pytest
import torch

from stapo_megatron.eval.config import EvalSetConfig
from stapo_megatron.data.examples import Example
from stapo_megatron.eval.scoring import (PAPER_BENCHMARKS, PAPER_DECODINGS, Counts, Decoding, EvalSet, avg_at_k,
                                       evaluate_sets, evaluate_suite, format_table, load_benchmark, load_eval_set,
                                       score_responses, summarize)
from stapo_megatron.rewards.scorer import RewardScorer
from tests.helpers import TESTS_DIR
from tests.helpers.jsonl_files import _write_jsonl

# Exact float comparisons below are sums of a few multiples of 1/4 or 1/3: tolerance 1e-12 is
# only float rounding.
TOL = 1e-12


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(num_workers=2, timeout_s=5.0) as s:
        yield s


class KnownGenerator:
    """Question "q<i>" with answer str(i): returns `num_correct[i]` correct responses of n, then
    wrong ones, and one unboxed response when there is room. Records its calls."""

    def __init__(self, num_correct):
        self.num_correct = num_correct
        self.calls = []

    def __call__(self, questions, n, temperature, top_p):
        self.calls.append((len(questions), n, temperature, top_p))
        out = []
        for q in questions:
            i = int(q[1:])
            c = min(self.num_correct[i], n)
            wrong = [f"so \\boxed{{{i + 1}}}"] * (n - c)
            if wrong:
                wrong[-1] = "I give up"
            out.append([f"... \\boxed{{{i}}}" if j % 2 else f"\\boxed{{{i}.0}}" for j in range(c)] + wrong)
        return out


def test_load_benchmark_fields(tmp_path):
    path = _write_jsonl(tmp_path / "mix.jsonl", [
        {"problem": "P1", "answer": 204, "id": 7},
        {"question": "P2", "final_answer": ["$\\frac{1}{2}$"]},
        {"question": "P3", "final_answer": ["1", "2"], "unique_id": "u3"},
        {"prompt": "P4", "solution": "We get \\boxed{1} then \\boxed{\\sqrt{2}}."},
        "",
        {"problem": "P6", "answer": "x", "solution": "\\boxed{ignored}"},
    ])
    assert load_benchmark(path) == [
        Example("P1", "204", "7"), Example("P2", "\\frac{1}{2}", "mix-2"), Example("P3", "1, 2", "u3"),
        Example("P4", "\\sqrt{2}", "mix-4"), Example("P6", "x", "mix-6"),
    ]


@pytest.mark.parametrize("line, message", [
    ('{"answer": "1"}', r"b.jsonl:2: no question"),
    ('{"problem": "", "answer": "1"}', r"b.jsonl:2: no question"),
    ('{"problem": "q"}', r"b.jsonl:2: no answer: expected one of answer"),
    ('{"problem": "q", "solution": "no box"}', r"b.jsonl:2: `solution` has no \\boxed"),
    ("{oops", r"b.jsonl:2: invalid JSON"),
])
def test_load_benchmark_errors(tmp_path, line, message):
    path = _write_jsonl(tmp_path / "b.jsonl", [{"problem": "ok", "answer": "1"}, line])
    with pytest.raises(ValueError, match=message):
        load_benchmark(path)


def test_avg_at_k_exact(scorer):
    examples = [Example(f"q{i}", str(i), str(i)) for i in range(3)]
    gen = KnownGenerator(num_correct=[4, 1, 0])
    result = avg_at_k(gen, examples, k=4, decoding=PAPER_DECODINGS[1], scorer=scorer)
    assert gen.calls == [(3, 4, 0.7, 0.9)]
    assert abs(result["avg@k"] - (4 / 4 + 1 / 4 + 0 / 4) / 3) < TOL
    assert abs(result["pass@k"] - 2 / 3) < TOL
    # Problem 1 has 3 wrong responses (1 unboxed), problem 2 has 4 (1 unboxed).
    assert {k: result[k] for k in ("num_problems", "k", "temperature", "top_p", "num_timeouts",
                                   "num_unparseable")} == {
        "num_problems": 3, "k": 4, "temperature": 0.7, "top_p": 0.9, "num_timeouts": 0,
        "num_unparseable": 2}


def test_avg_at_k_bad_shapes(scorer):
    examples = [Example("q0", "0", "0")]
    with pytest.raises(ValueError, match="must return 2 responses for each of 1 questions"):
        avg_at_k(lambda q, n, t, p: [["\\boxed{0}"]], examples, 2, PAPER_DECODINGS[0], scorer)
    with pytest.raises(ValueError, match="k must be >= 1"):
        avg_at_k(KnownGenerator([1]), examples, 0, PAPER_DECODINGS[0], scorer)


def test_evaluate_suite(tmp_path, scorer):
    # q0 is right in 2 of 4 samples, q1 never: aime24 (q0, q1) 0.25, math500 (q0) 0.5.
    _write_jsonl(tmp_path / "aime24.jsonl", [{"problem": "q0", "answer": "0"}, {"problem": "q1", "answer": "1"}])
    _write_jsonl(tmp_path / "math500.jsonl", [{"problem": "q0", "solution": "\\boxed{0}"}])

    gen = KnownGenerator(num_correct=[2, 0])
    with pytest.warns(UserWarning, match="skipped") as caught:
        result = evaluate_suite(gen, str(tmp_path), scorer, k_override=4)
    assert len([w for w in caught if "skipped" in str(w.message)]) == 4
    assert result["missing"] == ["aime25", "amc23", "minerva", "olympiadbench"]
    assert set(result["benchmarks"]) == {"aime24", "math500"}
    for name in ("T1.0_p1.0", "T0.7_p0.9"):
        assert result["benchmarks"]["aime24"][name]["avg@k"] == 0.25
        assert result["benchmarks"]["aime24"][name]["pass@k"] == 0.5
        assert result["benchmarks"]["math500"][name]["avg@k"] == 0.5
        assert result["benchmarks"]["math500"][name]["pass@k"] == 1.0
        assert result["mean_avg@k"][name] == 0.375
    assert [c[1:] for c in gen.calls] == [(4, 1.0, 1.0), (4, 0.7, 0.9)] * 2

    # Without k_override each benchmark uses the paper's k.
    gen = KnownGenerator(num_correct=[40, 0])
    only = {"aime24": PAPER_BENCHMARKS["aime24"], "math500": PAPER_BENCHMARKS["math500"]}
    result = evaluate_suite(gen, str(tmp_path), scorer, benchmarks=only,
                            decodings=(Decoding(0.6, 0.95, "custom"),))
    assert [c[1] for c in gen.calls] == [32, 4]
    assert result["benchmarks"]["aime24"]["custom"]["avg@k"] == 0.5
    assert result["benchmarks"]["math500"]["custom"]["avg@k"] == 1.0
    assert abs(result["mean_avg@k"]["custom"] - 0.75) < TOL


def test_evaluate_suite_bad_inputs(tmp_path, scorer):
    with pytest.raises(ValueError, match="does not exist"):
        evaluate_suite(KnownGenerator([]), str(tmp_path / "nope"), scorer)
    with pytest.raises(ValueError, match="decoding names must be unique"):
        evaluate_suite(KnownGenerator([]), str(tmp_path), scorer,
                       decodings=(Decoding(1.0, 1.0, "a"), Decoding(0.7, 0.9, "a")))


def test_decoding_names():
    assert Decoding.from_name("T0.7_p0.9") == Decoding(0.7, 0.9, "T0.7_p0.9")
    assert Decoding.from_name("T0_p1") == Decoding(0.0, 1.0, "T0_p1")
    for bad in ("0.7/0.9", "T0.7", "T-1_p1.0", "t0.7_p0.9"):
        with pytest.raises(ValueError, match="expected T<temperature>_p<top_p>"):
            Decoding.from_name(bad)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        Decoding.from_name("T1.0_p0")


def test_counts_add_over_shards_and_keep_the_float32_quotient(scorer):
    # Two "DP ranks" score disjoint problems; their summed counts give the whole set's avg@k.
    examples = [Example(f"q{i}", str(i), str(i)) for i in range(3)]
    gen = KnownGenerator(num_correct=[3, 1, 0])
    responses = gen([e.prompt for e in examples], 3, 1.0, 1.0)
    whole = score_responses(responses, examples, 3, scorer)
    parts = [score_responses(responses[:1], examples[:1], 3, scorer),
             score_responses(responses[1:], examples[1:], 3, scorer)]
    assert [sum(c) for c in zip(*(p.as_list() for p in parts))] == whole.as_list()
    assert whole.as_list() == [4.0, 9.0, 2.0, 3.0, 0, 2]
    d = PAPER_DECODINGS[0]
    assert summarize(whole, 3, d)["avg@k"] == 4 / 9 and summarize(whole, 3, d)["pass@k"] == 2 / 3
    # the trainer's DP sums are one float32 tensor: avg@k is then the float32 quotient (the value
    # `eval_accuracy` always had), not the float64 one
    reduced = Counts(*torch.tensor(whole.as_list()))
    assert summarize(reduced, 3, d)["avg@k"] == float(torch.tensor(4.0) / torch.tensor(9.0)) != 4 / 9
    # a rank with no problems (more ranks than problems) contributes zeros
    assert score_responses([], [], 3, scorer).as_list() == [0, 0.0, 0.0, 0.0, 0, 0]


def test_evaluate_sets_with_field_mapping_and_table(tmp_path, scorer):
    # OlympiadBench-like rows under other names: the mapping reads them, a list answer is joined
    path = _write_jsonl(tmp_path / "olymp.jsonl", [{"q": "q0", "ans": {"v": ["0"]}}, {"q": "q1", "ans": {"v": [1]}}])
    config = EvalSetConfig(name="olymp", path=path, k=2, decodings=("T0.6_p0.95",), prompt_field="q",
                           answer_field="ans.v")
    olymp = load_eval_set(config)
    assert olymp.examples == [Example("q0", "0", "olymp-1"), Example("q1", "1", "olymp-2")]
    assert olymp.decodings == (Decoding(0.6, 0.95, "T0.6_p0.95"),)
    math = EvalSet("math", [Example("q0", "0", "a")], 4)  # the paper's two decodings
    gen = KnownGenerator(num_correct=[2, 0])
    results = evaluate_sets(gen, [olymp, math], scorer)
    assert [c[1:] for c in gen.calls] == [(2, 0.6, 0.95), (4, 1.0, 1.0), (4, 0.7, 0.9)]
    assert results["sets"]["olymp"]["T0.6_p0.95"]["avg@k"] == 0.5
    assert results["sets"]["math"]["T1.0_p1.0"]["avg@k"] == 0.5
    assert results["mean_avg@k"] == {"T0.6_p0.95": 0.5, "T1.0_p1.0": 0.5, "T0.7_p0.9": 0.5}
    assert format_table(results).splitlines() == [
        "| set | problems | k | T0.6_p0.95 avg@k | T0.6_p0.95 pass@k | T1.0_p1.0 avg@k | T1.0_p1.0 pass@k "
        "| T0.7_p0.9 avg@k | T0.7_p0.9 pass@k |",
        "|---|---|---|---|---|---|---|---|---|",
        "| olymp | 2 | 2 | 0.5000 | 0.5000 |  |  |  |  |",
        "| math | 1 | 4 |  |  | 0.5000 | 1.0000 | 0.5000 | 1.0000 |",
        "| mean |  |  | 0.5000 |  | 0.5000 |  | 0.5000 |  |",
    ]
    with pytest.raises(ValueError, match=r"olymp.jsonl:1: no field 'question' \(prompt_field = 'question'\)"):
        load_eval_set(EvalSetConfig(name="x", path=path, prompt_field="question"))
    with pytest.raises(ValueError, match="evaluation set names must be unique"):
        evaluate_sets(gen, [math, math], scorer)


def test_benchmark_from_hf_dataset_folder():
    folder = os.path.join(TESTS_DIR, "assets", "math_dataset")
    examples = load_benchmark(folder)  # `question` and `final_answer` found without a mapping
    assert [(e.prompt, e.answer, e.id) for e in examples][2:] == [
        ("Name both roots of x^2=1.", "1, -1", "12"), ("What is 10/4?", "\\frac{5}{2}", "13")]
