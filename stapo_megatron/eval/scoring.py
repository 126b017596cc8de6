"""avg@k evaluation on math benchmarks with the paper's decoding settings: the one place avg@k is scored.

Owns the evaluation protocol of STAPO (arXiv 2602.15620, as in JustRL): for each problem,
k responses are sampled and scored with the training reward (``stapo_megatron.rewards.scorer``);

    avg@k  = mean over problems of (number correct / k)  (correct = a positive reward)
    pass@k = fraction of problems with at least one correct response

on AIME24, AIME25, AMC23 (k=32) and MATH500, Minerva, OlympiadBench (k=4), each with two decoding
settings: T=1.0 / top-p 1.0 and T=0.7 / top-p 0.9. Users supply the benchmark files (JSONL,
parquet or HF dataset folders, see ``load_benchmark``); sampling is a callable (``GenerateFn``)
so that any engine can be evaluated (``engine_generate_fn`` wraps the project's rollout engines).

Three users: the trainer (``Trainer.evaluate``: the held-out set and ``TrainerConfig.eval.sets``,
sampled over DP ranks, scored with ``score_responses``, summed over DP and summarized with
``summarize``), the ``stapo-eval`` command (``stapo_megatron.eval.cli``) and the Python API
(``avg_at_k``, ``evaluate_sets``, ``evaluate_suite``).
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

from stapo_megatron.data.examples import Example, load_examples
from stapo_megatron.eval.config import PAPER_BENCHMARKS, Decoding, EvalSetConfig, paper_eval_set_configs  # noqa: F401
from stapo_megatron.eval.generate import EvalProgress, GenerateFn, Response, length_stats
from stapo_megatron.rewards.scorer import RewardScorer



PAPER_DECODINGS = (Decoding(1.0, 1.0, "T1.0_p1.0"), Decoding(0.7, 0.9, "T0.7_p0.9"))

@dataclasses.dataclass
class EvalSet:
    """A loaded evaluation set: its problems, k and decodings."""

    name: str
    """Name in metrics and tables."""
    examples: list[Example]
    """The problems."""
    k: int
    """Samples per problem."""
    decodings: tuple[Decoding, ...] = PAPER_DECODINGS
    """Sampling settings."""


def load_benchmark(path: str, prompt_field: str = "", answer_field: str = "") -> list[Example]:
    """A benchmark's problems: ``load_examples`` (the one row reader, `stapo_megatron.data.rows`:
    MATH's ``problem`` / ``solution``, OlympiadBench's ``final_answer`` lists, AIME's numbers, or
    the fields ``prompt_field`` / ``answer_field`` name), with a missing file named as a benchmark.

    Raises:
        ValueError: naming the file and line of a malformed row, or if the file is missing or empty.
    """
    if not os.path.exists(path):
        raise ValueError(f"benchmark file {path!r} does not exist")
    return load_examples(path, prompt_field=prompt_field, answer_field=answer_field)


def load_eval_set(cfg: EvalSetConfig) -> EvalSet:
    """An `EvalSetConfig`'s problems, loaded (``load_benchmark``), with its k and decodings."""
    return EvalSet(cfg.name, load_benchmark(cfg.path, cfg.prompt_field, cfg.answer_field), cfg.k,
                   tuple(Decoding.from_name(d) for d in cfg.decodings))


@dataclasses.dataclass
class Counts:
    """The sums avg@k and pass@k are computed from. They add over disjoint sets of problems (DP
    ranks): each field may be a Python number or a 0-d tensor (the trainer all-reduces them as
    one float32 tensor, ``as_list`` order, and passes the reduced elements back in)."""

    num_correct: Any
    """Samples with a positive reward (correct under 1/0 and +1/-1 rewards alike)."""
    num_samples: Any
    """Number of samples (problems x k)."""
    num_solved: Any
    """Problems with at least one sample of positive reward."""
    num_problems: Any
    """Problems."""
    num_timeouts: Any = 0
    """Samples whose reward check ran out of time."""
    num_unparseable: Any = 0
    """Samples without a parseable final answer."""

    def as_list(self) -> list:
        """The fields in declaration order (``Counts(*counts.as_list())`` rebuilds it)."""
        return [getattr(self, f.name) for f in dataclasses.fields(self)]


def score_responses(responses: Sequence[Sequence[str]], examples: Sequence[Example], k: int,
                    scorer: RewardScorer, rewards_out: Optional[list] = None) -> Counts:
    """Score ``k`` responses per problem against the problems' answers; ``rewards_out``, if
    given, is extended with each response's reward (problem by problem), e.g. for sample tables.

    Raises:
        ValueError: if ``responses`` is not ``k`` responses for each example.
    """
    if len(responses) != len(examples) or any(len(r) != k for r in responses):
        shape = [len(r) for r in responses]
        raise ValueError(f"generate_fn must return {k} responses for each of {len(examples)} "
                         f"questions, got {len(responses)} lists of lengths {shape[:8]}")
    flat_responses = [r for per_question in responses for r in per_question]
    flat_answers = [e.answer for e in examples for _ in range(k)]
    rewards, stats = scorer.score(flat_responses, flat_answers) if flat_responses else ([], {})
    per_problem = [rewards[i * k:(i + 1) * k] for i in range(len(examples))]
    if rewards_out is not None:
        rewards_out.extend(rewards)
    return Counts(num_correct=float(sum(1 for r in rewards if r > 0)), num_samples=float(len(rewards)),
                  num_solved=float(sum(1 for r in per_problem if max(r) > 0)),
                  num_problems=float(len(examples)), num_timeouts=stats.get("num_timeouts", 0),
                  num_unparseable=stats.get("num_unparseable", 0))


def summarize(counts: Counts, k: int, decoding: Decoding) -> dict:
    """avg@k / pass@k of ``counts``, as ``avg_at_k`` returns them.

    avg@k is ``num_correct / num_samples``: with k samples of every problem that is the mean over
    problems of their fraction of correct samples, and it is the trainer's ``eval_accuracy``.
    """
    if float(counts.num_problems) < 1:
        raise ValueError("avg@k needs at least one problem")
    return {
        "avg@k": float(counts.num_correct / counts.num_samples),
        "pass@k": float(counts.num_solved / counts.num_problems),
        "num_problems": int(counts.num_problems),
        "k": k,
        "temperature": decoding.temperature,
        "top_p": decoding.top_p,
        "num_timeouts": int(counts.num_timeouts),
        "num_unparseable": int(counts.num_unparseable),
    }


def avg_at_k(generate_fn: GenerateFn, examples: Sequence[Example], k: int, decoding: Decoding,
             scorer: RewardScorer, progress: Optional[EvalProgress] = None,
             on_sample: Optional[Callable[[dict], None]] = None, set_name: str = "") -> dict:
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
        "num_timeouts", "num_unparseable", "response_length", "truncation_rate" (`length_stats`),
        "generation_s", "scoring_s"}``.
        progress: reports the set's start and scoring (`EvalProgress`).
        on_sample: called with each sample's record (``set``, ``decoding``, ``id``, ``prompt``,
            ``sample``, ``response``, ``reward``, ``response_length``, ``truncated``).
        set_name: the set's name in the progress lines and records.

    Raises:
        ValueError: if k < 1, there are no examples, or generate_fn returns the wrong shape.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not examples:
        raise ValueError("avg_at_k needs at least one example")
    if progress is not None:
        progress.start(f"{set_name} {decoding.name}".strip(), len(examples), k)
    started = time.perf_counter()
    responses = generate_fn([e.prompt for e in examples], k, decoding.temperature, decoding.top_p)
    generated = time.perf_counter()
    rewards: list = []
    result = summarize(score_responses(responses, examples, k, scorer, rewards), k, decoding)
    result.update(length_stats(responses), generation_s=generated - started,
                  scoring_s=time.perf_counter() - generated)
    if progress is not None:
        progress.scored(len(rewards), result["scoring_s"], result)
    if on_sample is not None:
        for i, (example, per_question) in enumerate(zip(examples, responses)):
            for j, response in enumerate(per_question):
                known = isinstance(response, Response)
                on_sample({"set": set_name, "decoding": decoding.name, "id": example.id, "prompt": example.prompt,
                           "sample": j, "response": str(response), "reward": rewards[i * k + j],
                           "response_length": response.num_tokens if known else None,
                           "truncated": response.truncated if known else None})
    return result


def evaluate_sets(generate_fn: GenerateFn, sets: Sequence[EvalSet], scorer: RewardScorer,
                  k_override: Optional[int] = None, progress: Optional[EvalProgress] = None,
                  on_sample: Optional[Callable[[dict], None]] = None) -> dict:
    """``avg_at_k`` of every set with every one of its decodings.

    Args:
        generate_fn: see ``GenerateFn``.
        sets: the loaded sets (``load_eval_set``).
        scorer: scores responses.
        k_override: use this k for every set (quick runs); None keeps each set's k.
        progress, on_sample: see ``avg_at_k``.

    Returns:
        ``{"sets": {name: {decoding.name: avg_at_k result}}, "mean_avg@k": {decoding.name:
        unweighted mean of avg@k over the sets evaluated with that decoding}}``.

    Raises:
        ValueError: if two sets share a name, or one set's decodings share a name.
    """
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise ValueError(f"evaluation set names must be unique, got {names}")
    results: dict = {"sets": {}, "mean_avg@k": {}}
    for s in sets:
        decoding_names = [d.name for d in s.decodings]
        if len(set(decoding_names)) != len(decoding_names):
            raise ValueError(f"decoding names must be unique, got {decoding_names}")
        k = s.k if k_override is None else k_override
        results["sets"][s.name] = {d.name: avg_at_k(generate_fn, s.examples, k, d, scorer, progress, on_sample, s.name)
                                   for d in s.decodings}
    by_decoding: dict = {}
    for per_decoding in results["sets"].values():
        for name, result in per_decoding.items():
            by_decoding.setdefault(name, []).append(result["avg@k"])
    results["mean_avg@k"] = {name: sum(v) / len(v) for name, v in by_decoding.items()}
    return results


def paper_sets(bench_dir: str, decodings: Sequence[Decoding] = PAPER_DECODINGS,
               benchmarks: Mapping[str, int] = PAPER_BENCHMARKS) -> tuple[list[EvalSet], list[str]]:
    """The paper's benchmarks found in ``bench_dir`` as ``<name>.jsonl`` (fields auto-detected).

    Returns:
        (the loaded sets, the names not found; each missing one is reported with ``warnings.warn``).

    Raises:
        ValueError: if ``bench_dir`` is not a folder.
    """
    if not os.path.isdir(bench_dir):
        raise ValueError(f"benchmark folder {bench_dir!r} does not exist")
    found, missing = [], []
    for name, k in benchmarks.items():
        path = os.path.join(bench_dir, f"{name}.jsonl")
        if not os.path.isfile(path):
            warnings.warn(f"benchmark {name!r} skipped: {path} not found")
            missing.append(name)
            continue
        found.append(EvalSet(name, load_benchmark(path), k, tuple(decodings)))
    return found, missing


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
    names = [d.name for d in decodings]
    if len(set(names)) != len(names):
        raise ValueError(f"decoding names must be unique, got {names}")
    sets, missing = paper_sets(bench_dir, decodings, benchmarks)
    results = evaluate_sets(generate_fn, sets, scorer, k_override)
    return {"benchmarks": results["sets"], "mean_avg@k": results["mean_avg@k"], "missing": missing}


def format_table(results: dict) -> str:
    """``evaluate_sets`` results as a markdown table: a row per set (problems, k), avg@k and pass@k
    per decoding, and a last row with the mean avg@k over the sets."""
    decodings = list(results["mean_avg@k"])
    header = ["set", "problems", "k"] + [f"{d} {m}" for d in decodings for m in ("avg@k", "pass@k")]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for name, per_decoding in results["sets"].items():
        first = next(iter(per_decoding.values()))
        cells = [name, str(first["num_problems"]), str(first["k"])]
        for d in decodings:
            r = per_decoding.get(d)
            cells += [f"{r['avg@k']:.4f}", f"{r['pass@k']:.4f}"] if r else ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    mean = ["mean", "", ""] + [c for d in decodings for c in (f"{results['mean_avg@k'][d]:.4f}", "")]
    lines.append("| " + " | ".join(mean) + " |")
    return "\n".join(lines) + "\n"
