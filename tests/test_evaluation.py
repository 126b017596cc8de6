"""Tier a: benchmark loading and avg@k / pass@k on a hand-made generator with known correctness."""

import json

import pytest

from stapo_megatron.data import Example
from stapo_megatron.evaluation import (PAPER_BENCHMARKS, PAPER_DECODINGS, Decoding, avg_at_k,
                                       evaluate_suite, load_benchmark)
from stapo_megatron.rewards import RewardScorer

# Exact float comparisons below are sums of a few multiples of 1/4 or 1/3: tolerance 1e-12 is
# only float rounding.
TOL = 1e-12


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(num_workers=2, timeout_s=5.0) as s:
        yield s


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


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
        Example("P1", "204", "7"), Example("P2", "$\\frac{1}{2}$", "mix-2"), Example("P3", "1, 2", "u3"),
        Example("P4", "\\sqrt{2}", "mix-4"), Example("P6", "x", "mix-6"),
    ]


@pytest.mark.parametrize("line, message", [
    ('{"answer": "1"}', r"b.jsonl:2: no question"),
    ('{"problem": "", "answer": "1"}', r"b.jsonl:2: no question"),
    ('{"problem": "q"}', r"b.jsonl:2: no answer field"),
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
