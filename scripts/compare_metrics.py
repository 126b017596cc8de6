"""Same maths check: do two runs' ``metrics.jsonl`` hold the same values, wall-clock fields aside?

    .venv/bin/python scripts/compare_metrics.py BEFORE/metrics.jsonl AFTER/metrics.jsonl

Compares row by row, key by key, exactly (a refactor that is not meant to change the maths writes
the same floats with a fixed seed); ignores the wall-clock fields (``time_*``, ``*_tokens_per_s``,
``eta_s``). Prints every difference and exits 1 when there is one, else prints how many rows and
values agreed and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Dict, List


def is_wall_clock(key: str) -> bool:
    """Fields that measure time, not maths."""
    return key.startswith("time_") or key.endswith("_tokens_per_s") or key == "eta_s"


def load_rows(path: str) -> List[Dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def same(a, b, rel_tol: float = 0.0) -> bool:
    """Equal values; NaN equals NaN (an empty statistic is logged as NaN on both sides); with
    ``rel_tol`` two floats within it (relative, or 1e-9 absolute near zero) count as equal."""
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) and math.isnan(b):
            return True
        if rel_tol:
            return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-9)
    return a == b


def differences(before: List[Dict], after: List[Dict], allow_added: bool = False, rel_tol: float = 0.0) -> List[str]:
    """Every row / key whose value differs (wall-clock fields aside), as readable lines;
    ``allow_added``: a key only the later run logs (a new metric) is not a difference;
    ``rel_tol``: floats within it are the same (`same`; 0 = identical, what SAME means)."""
    out = []
    if len(before) != len(after):
        out.append(f"{len(before)} rows before, {len(after)} after")
    for i, (b, a) in enumerate(zip(before, after)):
        keys = {k for k in list(b) + list(a) if not is_wall_clock(k)}
        for key in sorted(keys):
            if key not in b and allow_added:
                continue
            if key not in b or key not in a:
                out.append(f"row {i} ({b.get('kind')} step {b.get('step')}): {key} only "
                           f"{'before' if key in b else 'after'}")
            elif not same(b[key], a[key], rel_tol):
                out.append(f"row {i} ({b.get('kind')} step {b.get('step')}): {key} {b[key]!r} -> {a[key]!r}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--allow-added", action="store_true",
                        help="keys only AFTER logs (metrics a change added) are not differences")
    args = parser.parse_args(argv)
    before, after = load_rows(args.before), load_rows(args.after)
    diffs = differences(before, after, args.allow_added)
    for line in diffs:
        print(line)
    if diffs:
        print(f"DIFFERENT: {len(diffs)} differences")
        return 1
    compared = sum(1 for row in before for k in row if not is_wall_clock(k))
    print(f"SAME: {len(before)} rows, {compared} values identical (wall-clock fields aside)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
