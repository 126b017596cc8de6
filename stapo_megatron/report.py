"""Measured results into the README: a generated block between ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->`` is replaced whole, so the README's tables come from the scripts that
measured them (``examples/demo_seeds.py``, ``stapo_megatron.compare``), never typed by hand."""

from __future__ import annotations

import re


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
