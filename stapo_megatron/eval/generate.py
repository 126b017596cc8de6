"""Sampling for evaluation: the ``GenerateFn`` contract, responses that carry their length, the
progress lines of ``stapo-eval`` and ``engine_generate_fn`` over the project's rollout engines.
Scoring is `stapo_megatron.eval.scoring`'s."""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Callable, Optional, Sequence, TextIO

from stapo_megatron.data.examples import format_prompt
from stapo_megatron.rollout.config import SamplingSettings

GenerateFn = Callable[[list[str], int, float, float], list[list[str]]]
"""generate_fn(questions, n, temperature, top_p) -> n responses per question. ``questions`` are
raw question texts (``Example.prompt``); the callable formats them (``data.format_prompt``) with
its own tokenizer and applies its own max length. A response may be a `Response` (a str with
its token count and whether it was cut at the length limit): the results then hold response
lengths and the truncation rate."""


class Response(str):
    """A sampled response's text, with its length in tokens and whether the length limit cut it."""

    num_tokens: int
    truncated: bool

    def __new__(cls, text: str, num_tokens: int, truncated: bool) -> "Response":
        response = super().__new__(cls, text)
        response.num_tokens, response.truncated = int(num_tokens), bool(truncated)
        return response

    def __reduce__(self):  # pickles with its fields (reward workers receive plain copies anyway)
        return Response, (str(self), self.num_tokens, self.truncated)


class EvalProgress:
    """Progress lines of an evaluation on ``stream`` (stderr by default): per set and decoding,
    the prompts generated of the total with the rate so far, then the responses scored.

    `evaluate_sets` calls `start` and `scored`; a ``GenerateFn`` from `engine_generate_fn` given the
    same object calls `generated` after each chunk of prompts.
    """

    def __init__(self, stream: Optional[TextIO] = None, prefix: str = "stapo-eval: "):
        self.stream, self.prefix = stream, prefix
        self.label, self.total, self.k, self.started = "", 0, 0, time.perf_counter()

    def _line(self, text: str) -> None:
        stream = self.stream or sys.stderr
        print(f"{self.prefix}{text}", file=stream, flush=True)

    def start(self, label: str, total: int, k: int) -> None:
        """A set and decoding starts: ``total`` prompts, ``k`` samples each."""
        self.label, self.total, self.k, self.started = label, total, k, time.perf_counter()
        self._line(f"{label}: generating {total} prompts x {k} samples")

    def generated(self, done: int) -> None:
        """``done`` of the `start`'s prompts have their samples."""
        elapsed = time.perf_counter() - self.started
        rate = done / elapsed if elapsed > 0 else float("inf")
        self._line(f"{self.label}: {done}/{self.total} prompts generated ({rate:.2f} prompts/s, "
                   f"{elapsed:.0f} s)")

    def scored(self, num_responses: int, seconds: float, result: dict) -> None:
        """The set's responses were scored in ``seconds``; ``result`` is its `avg_at_k` result."""
        rate = num_responses / seconds if seconds > 0 else float("inf")
        self._line(f"{self.label}: {num_responses} responses scored in {seconds:.1f} s ({rate:.1f}/s); "
                   f"avg@k {result['avg@k']:.4f}, pass@k {result['pass@k']:.4f}")


def length_stats(responses: Sequence[Sequence[str]]) -> dict:
    """``{"response_length": {"mean", "min", "max"} in tokens, "truncation_rate"}`` of `Response`
    samples (None for both when the responses carry no token counts)."""
    flat = [r for per_question in responses for r in per_question]
    if not flat or not all(isinstance(r, Response) for r in flat):
        return {"response_length": None, "truncation_rate": None}
    lengths = [r.num_tokens for r in flat]
    return {"response_length": {"mean": sum(lengths) / len(lengths), "min": min(lengths), "max": max(lengths)},
            "truncation_rate": sum(r.truncated for r in flat) / len(flat)}


PROGRESS_SEQUENCES = 512
"""With progress, `engine_generate_fn` samples a set in chunks of prompts holding at least this
many sequences (and at most a tenth of the set): large enough batches for the engine."""


def engine_generate_fn(engine: Any, tokenizer: Any, max_tokens: int, use_chat_template: bool = True,
                       seed: Optional[int] = 0, progress: Optional[EvalProgress] = None) -> GenerateFn:
    """A ``GenerateFn`` sampling with a rollout engine (``rollout.registry.build_engine``).

    Questions are formatted and tokenized as the trainer does (``data.format_prompt``, no added
    special tokens); prompt i's j-th sample is seeded ``seed + i n + j`` by the engine, so the
    same engine, seed and problems give the trainer's evaluation samples.

    Args:
        engine: a `VLLMEngine` or `HFEngine`.
        tokenizer: the policy's tokenizer.
        max_tokens: response length limit.
        use_chat_template: see ``data.format_prompt``.
        seed: the engine's per-call seed (None: the engine's own RNG stream).
        progress: report the prompts done after each chunk (`EvalProgress.generated`); a chunk
            starting at prompt ``c`` is seeded ``seed + c n``, so the samples are the same.

    The responses are `Response` objects (their token counts; truncated = finished by the length
    limit).
    """
    def generate(questions: list[str], n: int, temperature: float, top_p: float) -> list[list[str]]:
        texts = [format_prompt(tokenizer, q, use_chat_template) for q in questions]
        ids = [list(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        chunk = len(ids) or 1
        if progress is not None:
            chunk = max(math.ceil(PROGRESS_SEQUENCES / n), math.ceil(len(ids) / 10), 1)
        settings, samples = SamplingSettings(n, temperature, top_p, max_tokens, seed), []
        for start in range(0, len(ids), chunk):
            samples += settings.skip(start).generate(engine, ids[start:start + chunk])
            if progress is not None:
                progress.generated(min(start + chunk, len(ids)))
        return [[Response(s.text, len(s.token_ids), s.finish_reason == "length") for s in group]
                for group in samples]

    return generate
