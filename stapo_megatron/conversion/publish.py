"""Atomic output directories and progress reporting for the converter.

Outputs are written into a hidden sibling directory and renamed into place only after every
file is written and flushed, so an interrupted conversion never leaves anything at the output
path that looks complete (a leftover ``.<name>.partial-*`` directory is safe to delete).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from typing import Iterator, Optional, Sequence, TextIO

from stapo_megatron.utils import format_bytes


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_output_dir(out: str, overwrite: bool, inputs: Sequence[str] = ()) -> None:
    """Refuse an existing non-empty output directory unless ``overwrite`` is set, and an output
    that is, contains or lies inside one of ``inputs`` (replacing it would delete the input).

    Paths are compared after resolving symlinks, so a link to the input is the input.
    """
    real_out = os.path.realpath(out)
    overlaps = []
    for inp in inputs:
        real_in = os.path.realpath(inp)
        if real_out == real_in:
            overlaps.insert(0, (inp, "is"))  # the most specific report first
        elif _within(real_out, real_in):
            overlaps.append((inp, "lies inside"))
        elif _within(real_in, real_out):
            overlaps.append((inp, "contains"))
    if overlaps:
        inp, how = overlaps[0]
        raise ValueError(f"output {out} {how} the input {inp}; choose an output directory outside the input")
    if os.path.exists(out) and not os.path.isdir(out):
        raise FileExistsError(f"output path {out} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise FileExistsError(f"output directory {out} exists and is not empty (pass --overwrite to replace it)")


@contextlib.contextmanager
def staged_output(out: str, overwrite: bool = False, inputs: Sequence[str] = ()) -> Iterator[str]:
    """Yield a temporary directory next to ``out``; on success rename it to ``out``.

    On any exception the temporary directory is removed and ``out`` is left untouched.
    """
    check_output_dir(out, overwrite, inputs)
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        _fsync_dir(tmp)
        if os.path.isdir(out):
            # Move the old output aside first so `out` is never a half-deleted directory.
            old = os.path.join(parent, f".{os.path.basename(out)}.old-{os.getpid()}")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Progress:
    """Progress (tensors and bytes) on stderr: a live line on a terminal, a line every 5 s in logs."""

    def __init__(self, label: str, total_items: int, total_bytes: int, stream: Optional[TextIO] = None):
        self.label, self.total_items, self.total_bytes = label, total_items, total_bytes
        self.stream = stream or sys.stderr
        self.items = self.bytes = 0
        self._start = self._last = time.monotonic()
        self._lock = threading.Lock()  # the DCP writer calls back from several threads
        self._tty = self.stream.isatty()

    def update(self, nbytes: int, items: int = 1) -> None:
        """Count finished work and redraw if due."""
        with self._lock:
            self.items += items
            self.bytes += nbytes
            now = time.monotonic()
            if now - self._last >= (0.25 if self._tty else 5.0):
                self._last = now
                self._draw(now, final=False)

    def close(self) -> None:
        """Print the final line."""
        self._draw(time.monotonic(), final=True)

    def _draw(self, now: float, final: bool) -> None:
        elapsed = max(now - self._start, 1e-9)
        line = (
            f"[{self.label}] {self.items}/{self.total_items} tensors, "
            f"{format_bytes(self.bytes)}/{format_bytes(self.total_bytes)}, "
            f"{format_bytes(self.bytes / elapsed)}/s, {elapsed:.1f}s"
        )
        if self._tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
