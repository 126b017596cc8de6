"""Measured results into the docs: a generated block between ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->`` is replaced whole, so the tables of ``docs/results.md`` (and the README's
expected result) come from the scripts that measured them (``examples/demo_seeds.py``,
``examples/demo_moe.py``, ``stapo_megatron.runlog.compare``), never typed by hand."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The checkout holding this package."""
RESULTS_PAGE = os.path.join("docs", "results.md")
"""The page (relative to the checkout) that holds the generated result blocks."""


def fill_block(path: str, name: str, text: str) -> None:
    """Replace the ``name`` block of the markdown file ``path`` by ``text``.

    Raises:
        ValueError: the file has no such block (the markers are written once, by hand, where the
            block belongs).
    """
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    with open(path) as f:
        content = f.read()
    if content.count(begin) != 1 or content.count(end) != 1 or content.index(begin) > content.index(end):
        raise ValueError(f"{path} has no single {begin} ... {end} block to fill")
    block = f"{begin}\n{text.rstrip()}\n{end}"
    content = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, content, flags=re.S)
    with open(path, "w") as f:
        f.write(content)


def runs_commit(run_dirs) -> str:
    """The commit(s) the runs were made at, from their ``provenance.json`` (``stapo_megatron.runlog.provenance``):
    ``"a640050"``, ``"a640050 (dirty)"``, several joined with ", ", or ``"unknown"`` when no run
    recorded one. A results block names the code that produced its numbers, not the checkout that
    summarised them."""
    import json
    import os

    commits = []
    for run_dir in run_dirs:
        path = os.path.join(run_dir, "provenance.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            git = json.load(f).get("git") or {}
        if git.get("commit"):
            label = git["commit"][:7] + (" (dirty)" if git.get("dirty") else "")
            if label not in commits:
                commits.append(label)
    return ", ".join(commits) or "unknown"


def machine() -> str:
    """The machine a results block was measured on: "x86_64, 2 cores, Python 3.11.7"."""
    import os
    import platform

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
