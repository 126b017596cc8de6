"""Small helpers every wing uses: the one dotted-path loader and registry lookup, the config
field checks (an unknown field refused with the closest names: `unknown_field_error`), the seed stride and the seed
streams' hash (`stream_seed`), a function's name in messages (`qualname`), the one way sizes are
written in messages (`format_bytes`), the device of a collective, and a local job's free port
and rank environment (`free_port`, `local_rank_env`).

Imports nothing of the package (a leaf), so any module may use it without an import circle.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import socket
from typing import Any, Callable, Dict, List, Mapping, Union

SEED_STRIDE = 1_000_003
"""The prime that keeps seed streams apart: the rollout seeds (``seed x SEED_STRIDE``), the random
controls (``loss.seed x SEED_STRIDE``, `method.registry`) and a micro-batch's part on CP rank r
(``seed + r x SEED_STRIDE``, `batch.context_parallel`; `trainer.seeds.Seeds` documents every stream)."""


def is_dotted_path(path: Any) -> bool:
    """Whether ``path`` has the form of a dotted path (``pkg.module:name`` or ``pkg.module.name``)
    rather than a plain registry name."""
    return isinstance(path, str) and (":" in path or "." in path)


def load_dotted(path: str, field: str) -> Any:
    """The object a dotted path ``package.module:name`` or ``package.module.name`` names (a user
    plug-in: a method, a reward function, a warm-start target, a rollout engine class); a
    ValueError naming ``field`` and the path if there is none."""
    module_name, sep, name = path.partition(":")
    if not sep:
        module_name, _, name = path.rpartition(".")
    if not module_name or not name or "." in name:
        raise ValueError(f"{field} = {path!r} is not a dotted path 'package.module:name' or 'package.module.name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{field} = {path!r} does not name an importable object: cannot import module "
                         f"{module_name!r}: {e}") from None
    if not hasattr(module, name):
        raise ValueError(f"{field} = {path!r} does not name an importable object: module {module_name!r} has no "
                         f"attribute {name!r}")
    return getattr(module, name)


def free_port() -> int:
    """A TCP port free on this machine now (the OS picks it), for a job of local processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_rank_env(rank: int, world_size: int, port: int) -> Dict[str, str]:
    """torch.distributed's environment of rank ``rank`` of a ``world_size``-process job on this
    machine (its rendezvous at 127.0.0.1:``port``), as torchrun would set it."""
    return dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))


def lookup_registered(name: str, table: Mapping[str, Any], field: str, from_object: Callable[[Any, str], Any]) -> Any:
    """The entry of a registry ``table`` (the methods, the objectives) called ``name``, or the one a
    dotted path names (``from_object(load_dotted(name, field), name)``); a ValueError naming
    ``field``, the valid names (and the closest) for an unknown name."""
    if name in table:
        return table[name]
    if is_dotted_path(name):
        return from_object(load_dotted(name, field), name)
    close = difflib.get_close_matches(str(name), table, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    kind = field.rpartition(".")[2]
    raise ValueError(f"{kind} must be one of {tuple(table)}, got {name!r}{hint} (a user {kind}: its dotted path "
                     f"'pkg.module:fn')")


def check_at_least(obj: Any, minimum: int, *names: str) -> None:
    """ValueError unless each integer field ``names`` of ``obj`` is >= ``minimum``."""
    for name in names:
        value = getattr(obj, name)
        if value < minimum:
            raise ValueError(f"{type(obj).__name__}.{name} must be >= {minimum}, got {value}")


def collective_device(group: Any = None) -> Any:
    """The device (a ``torch.device``) of tensors passed to collectives over ``group`` (a
    ``torch.distributed`` process group; None: the default one): the current CUDA device for NCCL,
    the CPU for gloo (or when torch.distributed is not initialised)."""
    import torch  # here, not at the top: the reward workers and the config import this leaf without torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
"""`format_bytes`'s units, each 1024 times the one before."""


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest unit of `BYTE_UNITS` that keeps the number >= 1, with at least
    three significant figures (``0 B``, ``512 B``, ``64.0 KiB``, ``1.18 MiB``, ``768 MiB``, ``12.0 GiB``),
    so that a message shows a size of any magnitude (a full disk has 0 B free, not "0.00 GiB")."""
    value, unit = float(nbytes), 0
    while abs(value) >= 1024 and unit < len(BYTE_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{nbytes:.0f} B"
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{digits}f} {BYTE_UNITS[unit]}"


MAX_SUGGESTIONS = 3
"""Closest field names offered for an unknown override."""


def closest_fields(name: str, fields: List[str]) -> List[str]:
    """Up to `MAX_SUGGESTIONS` field names that resemble ``name`` (difflib ratio >= 0.6), best first."""
    return difflib.get_close_matches(name, fields, n=MAX_SUGGESTIONS)


def unknown_field_error(where: str, obj: Any, name: str) -> ValueError:
    """The error for an override of a field ``obj`` does not have, naming the closest ones."""
    names = [f.name for f in dataclasses.fields(obj)]
    close = closest_fields(name, names)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    return ValueError(
        f"unknown override {where}: {type(obj).__name__} has no field {name!r}{hint} (fields: {', '.join(names)})"
    )


def stream_seed(*parts: Union[str, int]) -> int:
    """The start of the seed stream named by ``parts`` (a tag, then integers): a 62-bit hash, so
    that adding a stream's positions (a step's samples) stays below 2^63, what every sampler
    accepts. The same parts give the same seed on every machine and Python (no ``hash()``)."""
    text = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


def qualname(fn: Callable) -> str:
    """``module.qualname`` of a function, for messages and re-registration (the method and objective
    registries)."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
