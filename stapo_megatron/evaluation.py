"""avg@k evaluation on math benchmarks with the paper's decoding settings.

Owns the evaluation protocol of STAPO (arXiv 2602.15620, as in JustRL): for each problem,
k responses are sampled and scored with the training reward (``stapo_megatron.rewards``);

    avg@k  = mean over problems of (number correct / k)
    pass@k = fraction of problems with at least one correct response

on AIME24, AIME25, AMC23 (k=32) and MATH500, Minerva, OlympiadBench (k=4), each with two decoding
settings: T=1.0 / top-p 1.0 and T=0.7 / top-p 0.9. Users supply the benchmark files (JSONL, see
``load_benchmark``); sampling is a callable so that any engine (vLLM, HF generate, a test stub)
can be evaluated.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Callable, Mapping, Optional, Sequence

from stapo_megatron.data import Example, answer_to_str
from stapo_megatron.rewards import RewardScorer, extract_boxed

GenerateFn = Callable[[list[str], int, float, float], list[list[str]]]
"""generate_fn(questions, n, temperature, top_p) -> n responses per question. ``questions`` are
raw question texts (``Example.prompt``); the callable formats them (``data.format_prompt``) with
its own tokenizer and applies its own max length."""


@dataclasses.dataclass(frozen=True)
class Decoding:
    """One sampling setting of the evaluation."""

    temperature: float
    """Sampling temperature."""

    top_p: float
    """Nucleus sampling threshold (1.0 = the full distribution)."""

    name: str
    """Key of this setting in the results, e.g. ``"T0.7_p0.9"``."""


PAPER_DECODINGS = (Decoding(1.0, 1.0, "T1.0_p1.0"), Decoding(0.7, 0.9, "T0.7_p0.9"))
PAPER_BENCHMARKS = {"aime24": 32, "aime25": 32, "amc23": 32, "math500": 4, "minerva": 4,
                    "olympiadbench": 4}
"""Benchmark file stem -> k of avg@k, as in the paper."""

_QUESTION_FIELDS = ("problem", "question", "prompt")
_ANSWER_FIELDS = ("answer", "final_answer", "solution")


def _benchmark_answer(row: dict, where: str) -> str:
    """The reference answer of a benchmark row (field order: ``_ANSWER_FIELDS``)."""
    if "answer" in row:
        return answer_to_str(row["answer"], where, "answer")
    if "final_answer" in row:
        value = row["final_answer"]
        # OlympiadBench stores a list (several answers for multi-part questions).
        if isinstance(value, list):
            value = ", ".join(str(v) for v in value)
        return answer_to_str(value, where, "final_answer")
    if "solution" in row:
        boxed = extract_boxed(str(row["solution"]))
        if boxed is None:
            raise ValueError(f"{where}: `solution` has no \\boxed{{}} final answer")
        return boxed
    raise ValueError(f"{where}: no answer field; expected one of {_ANSWER_FIELDS}")


def load_benchmark(path: str) -> list[Example]:
    """Load a benchmark from a JSONL file, one problem per line.

    Accepted fields (the first present wins):

    - question: ``problem``, ``question``, ``prompt`` (a string);
    - answer: ``answer`` (string or number), ``final_answer`` (string, number, or a list of
      them, joined with ", " as in OlympiadBench), ``solution`` (a worked solution; its last
      ``\\boxed{}`` is the answer, as in MATH);
    - id (optional): ``id``, ``unique_id``, ``idx``; else ``<file stem>-<line>``.

    Args:
        path: the ``.jsonl`` file.

    Returns:
        The problems in file order.

    Raises:
        ValueError: naming the file and line of a malformed row, or if the file has no rows.
    """
    if not os.path.isfile(path):
        raise ValueError(f"benchmark file {path!r} does not exist")
    stem = os.path.splitext(os.path.basename(path))[0]
    examples = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            field = next((k for k in _QUESTION_FIELDS if k in row), None)
            if field is None or not isinstance(row[field], str) or not row[field].strip():
                raise ValueError(f"{where}: no question; expected a non-empty string in one of "
                                 f"{_QUESTION_FIELDS}")
            row_id = next((row[k] for k in ("id", "unique_id", "idx") if k in row), f"{stem}-{line_no}")
            examples.append(Example(prompt=row[field], answer=_benchmark_answer(row, where),
                                    id=str(row_id)))
    if not examples:
        raise ValueError(f"benchmark file {path!r} has no rows")
    return examples


def avg_at_k(generate_fn: GenerateFn, examples: Sequence[Example], k: int, decoding: Decoding,
             scorer: RewardScorer) -> dict:
    """avg@k and pass@k of one decoding setting on one set of problems.

    Args:
        generate_fn: see ``GenerateFn``; called once with all questions and ``n=k``.
        examples: the problems.
        k: samples per problem.
        decoding: temperature / top-p to sample with.
        scorer: scores responses (the training reward).

    Returns:
        ``{"avg@k": mean over problems of mean correctness over the k samples, "pass@k": fraction
        of problems with a correct sample, "num_problems", "k", "temperature", "top_p",
        "num_timeouts", "num_unparseable"}``.

    Raises:
        ValueError: if k < 1, there are no examples, or generate_fn returns the wrong shape.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not examples:
        raise ValueError("avg_at_k needs at least one example")
    questions = [e.prompt for e in examples]
    responses = generate_fn(questions, k, decoding.temperature, decoding.top_p)
    if len(responses) != len(examples) or any(len(r) != k for r in responses):
        shape = [len(r) for r in responses]
        raise ValueError(f"generate_fn must return {k} responses for each of {len(examples)} "
                         f"questions, got {len(responses)} lists of lengths {shape[:8]}")
    flat_responses = [r for per_question in responses for r in per_question]
    flat_answers = [e.answer for e in examples for _ in range(k)]
    rewards, stats = scorer.score(flat_responses, flat_answers)
    per_problem = [rewards[i * k:(i + 1) * k] for i in range(len(examples))]
    return {
        "avg@k": sum(sum(r) / k for r in per_problem) / len(examples),
        "pass@k": sum(1.0 for r in per_problem if max(r) > 0) / len(examples),
        "num_problems": len(examples),
        "k": k,
        "temperature": decoding.temperature,
        "top_p": decoding.top_p,
        "num_timeouts": stats["num_timeouts"],
        "num_unparseable": stats["num_unparseable"],
    }


def evaluate_suite(generate_fn: GenerateFn, bench_dir: str, scorer: RewardScorer,
                   benchmarks: Mapping[str, int] = PAPER_BENCHMARKS,
                   decodings: Sequence[Decoding] = PAPER_DECODINGS,
                   k_override: Optional[int] = None) -> dict:
    """Run ``avg_at_k`` for every benchmark file found and every decoding setting.

    Args:
        generate_fn: see ``GenerateFn``.
        bench_dir: folder holding ``<name>.jsonl`` for each benchmark name.
        scorer: scores responses.
        benchmarks: name -> k (the paper's six by default).
        decodings: sampling settings (the paper's two by default).
        k_override: use this k for every benchmark (quick runs); None keeps each benchmark's k.

    Returns:
        ``{"benchmarks": {name: {decoding.name: avg_at_k result}}, "mean_avg@k": {decoding.name:
        unweighted mean of avg@k over the benchmarks found}, "missing": [names not found]}``.
        Each missing benchmark is reported with ``warnings.warn`` and skipped.

    Raises:
        ValueError: if ``bench_dir`` is not a folder or two decodings share a name.
    """
    if not os.path.isdir(bench_dir):
        raise ValueError(f"benchmark folder {bench_dir!r} does not exist")
    names = [d.name for d in decodings]
    if len(set(names)) != len(names):
        raise ValueError(f"decoding names must be unique, got {names}")
    results: dict = {"benchmarks": {}, "mean_avg@k": {}, "missing": []}
    for name, k in benchmarks.items():
        path = os.path.join(bench_dir, f"{name}.jsonl")
        if not os.path.isfile(path):
            warnings.warn(f"benchmark {name!r} skipped: {path} not found")
            results["missing"].append(name)
            continue
        examples = load_benchmark(path)
        results["benchmarks"][name] = {
            d.name: avg_at_k(generate_fn, examples, k if k_override is None else k_override, d, scorer)
            for d in decodings
        }
    found = results["benchmarks"]
    for d in decodings:
        if found:
            results["mean_avg@k"][d.name] = sum(r[d.name]["avg@k"] for r in found.values()) / len(found)
    return results
