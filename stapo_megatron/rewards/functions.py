"""The reward functions a run can choose (``TrainerConfig.reward.name``): a name of `REWARDS` or a dotted path.

A reward function is a picklable module-level ``(response, answer) -> (reward, status)`` that
`stapo_megatron.rewards.scorer.RewardScorer` runs in its time-bounded worker processes; the status is
one of ``rewards.STATUS_*`` (counted in the step metrics). Shipped:

- ``math_verify`` (`stapo_megatron.rewards.answers.score_response`): 1.0 when the last ``\\boxed{}`` is
  equivalent to the reference under math-verify, else 0.0 (the project's original reward);
- ``boxed_exact_match`` (`boxed_exact_match`): the paper's rule-based reward. STAPO follows
  JustRL, which uses DAPO's rule: +1 when the last ``\\boxed{}`` equals the reference after the
  normalisation of Minerva (Lewkowycz et al. 2022, appendix D; DAPO's ``math_dapo``), else -1.

A model-based verifier (the paper's text names CompassVerifier-3B) plugs in the same way: a
module-level function with this signature, given by its dotted path (docs/data.md, "Rewards").
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Dict, Tuple

from stapo_megatron.rewards.answers import STATUS_OK, STATUS_UNPARSEABLE, extract_boxed, score_response
from stapo_megatron.utils import load_dotted

ScoreFn = Callable[[str, str], Tuple[float, str]]


@dataclasses.dataclass(frozen=True)
class Reward:
    """One reward function and the reward of a response it could not score."""

    name: str
    """A name of `REWARDS`, or the dotted path it was imported from."""
    score_fn: ScoreFn
    """``(response, answer) -> (reward, status)``, module level (it is pickled to the workers)."""
    failure_reward: float
    """The reward of a timed-out or failed check (`RewardScorer.failure_reward`)."""


# -- Minerva's answer normalisation (Lewkowycz et al. 2022, appendix D) ------------------------

# Textual variants rewritten first, in this order (spaces go, "\text{and}" becomes a comma).
_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
# Units and filler words removed after that.
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "ft", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters",
    "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)
# Wrappers whose content is kept: (pattern, replacement).
_UNWRAP = (
    (r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$"),
    (r"(\\text\{)(.*?)(\})", r"\2"),
    (r"(\\textbf\{)(.*?)(\})", r"\2"),
    (r"(\\overline\{)(.*?)(\})", r"\2"),
    (r"(\\boxed\{)(.*)(\})", r"\2"),
    (r"(frac)([^{])(.)", r"frac{\2}{\3}"),  # \frac12 -> \frac{1}{2}
    (r"(sqrt)([^{])", r"sqrt{\2}"),  # \sqrt2 -> \sqrt{2}
)


def normalize_answer(answer: str) -> str:
    """A final answer in Minerva's normal form: the right-hand side of a last ``=``, no spaces,
    units, ``\\text{}``/``\\boxed{}``/``$`` wrappers, ``\\frac12`` as ``\\frac{1}{2}``, and
    thousands separators of plain integers dropped (``100,000`` -> ``100000``)."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expression in _REMOVED:
        answer = answer.replace(expression, "")
    for pattern, replacement in _UNWRAP:
        answer = re.sub(pattern, replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return _canonical_number(answer.strip())


# A plain decimal number: "12", "-3", "12.0", "0.50" (what a benchmark stores as a float).
_DECIMAL = re.compile(r"-?\d+\.\d+|-?\d+")
# Several answers each in its own $...$, comma-separated: OlympiadBench's "$2$, $-2$".
_DOLLAR_LIST = re.compile(r"\s*\$[^$]*\$(\s*,\s*\$[^$]*\$)+\s*")


def _canonical_number(answer: str) -> str:
    """A decimal without trailing zeros after its point: "12.0" -> "12", "0.50" -> "0.5"
    (amc23 publishes its integer answers as floats); anything else unchanged."""
    if _DECIMAL.fullmatch(answer) and "." in answer:
        answer = answer.rstrip("0").rstrip(".")
    return "0" if answer == "-0" else answer


def _top_level_parts(answer: str) -> list:
    """``answer`` split at the commas outside any bracket: the items of a multi-answer list."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(answer):
        depth += c in "([{"
        depth -= c in ")]}"
        if c == "," and depth == 0:
            parts.append(answer[start:i])
            start = i + 1
    return parts + [answer[start:]]


def same_answer(predicted: str, reference: str) -> bool:
    """Whether two final answers agree after `normalize_answer`: equal, or both lists of several
    answers (top-level commas) with the same items in any order (OlympiadBench's multi-answer
    problems: ``\\boxed{-2, 2}`` answers ``"$2$, $-2$"``; half of the list does not)."""
    if _DOLLAR_LIST.fullmatch(reference):  # Minerva's "$...$" unwrap would keep the first item only
        reference = reference.replace("$", "")
    predicted, reference = normalize_answer(predicted), normalize_answer(reference)
    if predicted == reference:
        return True
    parts_p, parts_r = _top_level_parts(predicted), _top_level_parts(reference)
    return len(parts_r) > 1 and sorted(map(_canonical_number, parts_p)) == sorted(map(_canonical_number, parts_r))


def boxed_exact_match(response: str, answer: str) -> Tuple[float, str]:
    """+1.0 if the response's last ``\\boxed{}`` equals ``answer`` (`same_answer`),
    else -1.0 (also without a finished box: the status is then ``STATUS_UNPARSEABLE``).

    The reference may itself be boxed or in ``$...$``; both sides are normalised alike.
    """
    predicted = extract_boxed(response)
    if predicted is None:
        return -1.0, STATUS_UNPARSEABLE
    reference = extract_boxed(answer) if "\\boxed" in answer else None
    reference = answer if reference is None else reference
    return (1.0 if same_answer(predicted, reference) else -1.0), STATUS_OK


REWARDS: Dict[str, Reward] = {r.name: r for r in (
    Reward("math_verify", score_response, failure_reward=0.0),
    Reward("boxed_exact_match", boxed_exact_match, failure_reward=-1.0),
)}
"""The shipped reward functions, by name."""


def get_reward(name: str) -> Reward:
    """The `Reward` called ``name``, or the module-level function at dotted path ``name``
    (failure reward 0). ValueError naming the shipped ones if it is neither."""
    if name in REWARDS:
        return REWARDS[name]
    module_name = name.rpartition(".")[0]
    if not module_name:
        raise ValueError(f"reward must be one of {tuple(REWARDS)} or a dotted path module.function, got {name!r}")
    try:
        fn = load_dotted(name, "reward")
    except ValueError as e:
        raise ValueError(f"{e}; nor is it one of {tuple(REWARDS)}") from None
    if not callable(fn):
        raise ValueError(f"reward {name!r} names {type(fn).__name__}, not a function (response, answer) -> (reward, status)")
    return Reward(name, fn, failure_reward=0.0)
