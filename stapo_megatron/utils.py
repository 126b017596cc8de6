"""Small helpers every wing uses: the one dotted-path loader and the config field checks.

Imports nothing of the package (a leaf), so any module may use it without an import circle.
"""

from __future__ import annotations

import importlib
from typing import Any


def load_dotted(path: str, field: str) -> Any:
    """The object a dotted path ``package.module.name`` names (a user plug-in: a reward function,
    a warm-start target, a rollout engine class); a ValueError naming ``field`` if there is none."""
    module_name, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{field} = {path!r} does not name an importable object: {e}") from None


def check_at_least(obj: Any, minimum: int, *names: str) -> None:
    """ValueError unless each integer field ``names`` of ``obj`` is >= ``minimum``."""
    for name in names:
        value = getattr(obj, name)
        if value < minimum:
            raise ValueError(f"{type(obj).__name__}.{name} must be >= {minimum}, got {value}")
