"""Final answers of math responses and the math-verify reward (``reward="math_verify"``).

Owns what one response scores: the last ``\\boxed{...}`` of a response (`extract_boxed`), and
the binary reward R_i of docs/design.md's step 2, 1.0 when that answer is mathematically
equivalent to the reference and 0.0 otherwise (`score_response`). Scoring untrusted model text
under a time bound is `stapo_megatron.rewards.scorer.RewardScorer`'s.

- math-verify bounds its own parse/verify time with ``signal.alarm``, which only works on the
  main thread of the main interpreter. Here its timeouts are disabled (``parsing_timeout=None``,
  ``timeout_seconds=None``) and the scorer's worker processes bound time instead. (Some inputs
  really do hang sympy: checking ``\\boxed{10^{10^{10^{10}}}}`` against ``1`` never finishes.)
- Model text is never ``eval``-ed: it only goes through math-verify's LaTeX (antlr) extraction.
  math-verify's plain-expression extraction (``ExprExtractionConfig``) is not used, because it
  calls ``sympy.parse_expr``, which evaluates Python code.
"""

from __future__ import annotations

import logging
from typing import Optional

from math_verify import LatexExtractionConfig, parse, verify

# What a scoring function reports besides the reward (RewardScorer counts these).
STATUS_OK = "ok"  # both sides parsed (or matched exactly); the reward is the verdict
STATUS_UNPARSEABLE = "unparseable"  # no final \boxed{} in the response, or math-verify cannot parse it
STATUS_BAD_ANSWER = "bad_answer"  # the reference answer itself cannot be parsed

_BOXED = "\\boxed"
# Only the boxed LaTeX extractor (see the module docstring for why no plain-expression extractor).
_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0),)
class _DropDisabledTimeoutWarning(logging.Filter):
    """math-verify warns once per process that its timeouts are off; here that is intended."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutWarning())


def extract_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed`` in ``text``.

    Accepted forms: ``\\boxed{...}`` with balanced braces (escaped ``\\{`` / ``\\}`` do not count
    as braces, so ``\\boxed{\\{1,2\\}}`` gives ``\\{1,2\\}``), and ``\\boxed 5`` without braces
    (the token up to the next whitespace or ``$``, as Qwen-Math's grader accepts). A last box
    that is cut off (unbalanced, e.g. a truncated response) gives None: it is the final answer
    that counts, and it was never finished.

    Args:
        text: a model response.

    Returns:
        The boxed text, stripped of surrounding whitespace, or None if there is no usable box.
    """
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    i = start + len(_BOXED)
    if text.startswith(" ", i):
        token = text[i:].lstrip(" ").split("$")[0].split()
        return token[0].rstrip(".") if token else None
    if not text.startswith("{", i):
        return None
    depth = 0
    j = i
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2  # skip the escaped character (\{, \}, \\)
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
        j += 1
    return None


def _parse_boxed(content: str) -> list:
    """math-verify parse of a boxed answer, its signal timeout disabled (RewardScorer bounds time)."""
    return parse(f"\\boxed{{{content}}}", extraction_config=_EXTRACTION, parsing_timeout=None)


def _reference_content(answer: str) -> str:
    """A reference answer as plain LaTeX: an inner ``\\boxed{}`` or surrounding ``$`` removed."""
    answer = answer.strip()
    boxed = extract_boxed(answer) if _BOXED in answer else None
    if boxed is not None:
        return boxed
    return answer.strip("$").strip()


def score_response(response: str, answer: str) -> tuple[float, str]:
    """Reward and status of one response (no time bound; see ``RewardScorer``).

    An exact text match of the boxed answer with the reference counts as correct without parsing
    (also covers references math-verify cannot parse); otherwise both are parsed with math-verify
    and compared with ``verify(gold, prediction)`` (numeric tolerance, symbolic equality).

    Args:
        response: the model response.
        answer: the reference final answer (may itself be boxed or in ``$...$``).

    Returns:
        (1.0 or 0.0, one of ``STATUS_OK``, ``STATUS_UNPARSEABLE``, ``STATUS_BAD_ANSWER``).
    """
    predicted = extract_boxed(response)
    if predicted is None:
        return 0.0, STATUS_UNPARSEABLE
    reference = _reference_content(answer)
    if predicted == reference:
        return 1.0, STATUS_OK
    gold = _parse_boxed(reference)
    if not gold:
        return 0.0, STATUS_BAD_ANSWER
    prediction = _parse_boxed(predicted)
    if not prediction:
        return 0.0, STATUS_UNPARSEABLE
    return float(verify(gold, prediction, timeout_seconds=None)), STATUS_OK


def math_reward(response: str, answer: str) -> float:
    """1.0 if the response's last boxed answer equals ``answer`` (math-verify), else 0.0.

    Unparseable responses score 0.0. This call has no time bound (math-verify's signal-based
    timeouts are disabled so that it works off the main thread); score untrusted model text
    through ``RewardScorer``, which bounds it.

    Args:
        response: the model response.
        answer: the reference final answer.

    Returns:
        1.0 or 0.0.
    """
    return score_response(response, answer)[0]


