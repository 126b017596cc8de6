"""The doctor's rows: one `Check` per component, how a check function's outcome becomes one, and
the table and JSON they print as.

A check function returns a `Check` (pass with measured values, or skip with the reason); an
exception it raises becomes a failed row whose reason is the exception's type and message, so
one broken component never hides the rows after it.
"""

from __future__ import annotations

import dataclasses
import json
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclasses.dataclass
class Check:
    """One row of the doctor's report."""

    name: str
    """What was checked (``versions``, ``nccl_bandwidth``, ``vllm_engine`` ...)."""
    status: str
    """``pass``, ``fail`` or ``skip``."""
    detail: str = ""
    """The reason (fail, skip) or the headline numbers (pass), one line."""
    values: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """Measured numbers and facts, for ``--json``."""
    seconds: float = 0.0
    """Wall time of the check."""

    def __post_init__(self):
        if self.status not in (PASS, FAIL, SKIP):
            raise ValueError(f"Check.status must be one of {(PASS, FAIL, SKIP)}, got {self.status!r}")


def passed(name: str, detail: str, **values) -> Check:
    return Check(name, PASS, detail, values)


def skipped(name: str, reason: str, **values) -> Check:
    return Check(name, SKIP, reason, values)


def failed(name: str, reason: str, **values) -> Check:
    return Check(name, FAIL, reason, values)


def within(name: str, what: str, value: float, bound: float, **values) -> Check:
    """Pass when ``value <= bound``, else fail; the row says both numbers."""
    detail = f"{what} {value:.3g} (bound {bound:.3g})"
    return Check(name, PASS if value <= bound else FAIL, detail, dict(values, value=value, bound=bound))


def run_check(name: str, fn: Callable[[], Check]) -> Check:
    """Run one check, timed; an exception becomes a failed row naming it (the traceback's last
    frame in ``values['where']``)."""
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 -- every failure of a component is a row, not a crash
        frames = traceback.extract_tb(e.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        result = failed(name, f"{type(e).__name__}: {e}".splitlines()[0][:300], where=where)
    result.seconds = round(time.perf_counter() - start, 2)
    return result


def format_table(checks: Sequence[Check], device: Optional[str] = None) -> str:
    """Fixed-width rows: name, status, seconds, detail; first a ``device: NAME`` line when
    ``device`` is given (the log then names the machine it came from)."""
    width = max([len(c.name) for c in checks] + [5])
    lines = [f"device: {device}"] if device is not None else []
    lines.append(f"{'check':<{width}}  status  {'time':>7}  detail")
    for c in checks:
        lines.append(f"{c.name:<{width}}  {c.status.upper():<6}  {c.seconds:>6.1f}s  {c.detail}")
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, FAIL, SKIP)}
    lines.append(f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped")
    return "\n".join(lines)


def to_json(checks: Sequence[Check], facts: Optional[Dict[str, Any]] = None) -> str:
    """The rows (and facts about the machine) as one JSON document."""
    return json.dumps(dict(facts or {}, checks=[dataclasses.asdict(c) for c in checks]), indent=2, default=str)


def exit_code(checks: Sequence[Check]) -> int:
    """0 when nothing failed, 1 otherwise (skips are not failures)."""
    return int(any(c.status == FAIL for c in checks))


def select(names: Sequence[str], only: Optional[List[str]], skip: Optional[List[str]]) -> List[str]:
    """The check names to run: ``only`` (if given) minus ``skip``; unknown names are a ValueError."""
    for given in (only or []) + (skip or []):
        if given not in names:
            raise ValueError(f"unknown check {given!r}; the checks are {list(names)}")
    chosen = [n for n in names if not only or n in only]
    return [n for n in chosen if n not in (skip or [])]
