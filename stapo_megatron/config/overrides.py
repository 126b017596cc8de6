"""The one override parser: ``key=value`` overrides applied to a configuration dataclass.

Driven by the dataclass fields alone (``stapo_megatron.config``): a dotted key (``loss.tau_p``) or
a nested dict (``{"loss": {"tau_p": 0.01}}``, what NeMo-Run hands over for a section) names a
field; its annotation decides which values it takes. ``launch.entry.build_config`` applies it for
the ``nemo-run`` command (its pre-launch check and its dry run) and for the Python API alike, so
an override is accepted or refused the same way everywhere.

Errors name the field: an unknown one with the closest field names ("did you mean ..."), a
renamed one (a dataclass's ``RENAMED_FIELDS``, e.g. ``reward_workers`` -> ``reward.workers``) with
its new key, a wrongly typed value with the expected type, a value given for a whole section with
the section's fields; the dataclasses' own checks (``__post_init__``) run on the result.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from typing import Any, Dict, List, Mapping, Optional

from stapo_megatron.utils import MAX_SUGGESTIONS, closest_fields, unknown_field_error  # noqa: F401  (this module's API)

def renamed_field_error(prefix: str, old: str, new: str, value: Any) -> ValueError:
    """The error for a key of an earlier version, naming its new spelling: a key (``reward_workers``
    -> ``reward.workers``), a whole setting (``rollout.streaming`` -> ``mode='streaming'``), or
    alternatives joined by " or "."""
    if "=" not in new and " or " not in new:
        return ValueError(f"{prefix}{old} is now {prefix}{new}: write {prefix}{new}={value!r} "
                          f"(the flat key was replaced by the {new.partition('.')[0]!r} section)")
    spelled = " or ".join(f"{prefix}{key}" + ("" if "=" in key else f"={value!r}") for key in new.split(" or "))
    return ValueError(f"{prefix}{old}={value!r} is no longer a setting: write {spelled}")


def check_value(where: str, value: Any, annotation: Any) -> Any:
    """``value`` for a simple field type (int/float/bool/str, Optional), else ValueError.

    A number given for a str field becomes its text, and so does ``none`` (read as None) for a
    str field that cannot be None, such as ``loss.rollout_correction.mode=none``: the command
    line cannot tell them apart. Other annotations (dicts, tuples) are passed through to the
    dataclass's own checks.
    """
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return value
        inner = [a for a in args if a is not type(None)]
        annotation = inner[0] if len(inner) == 1 else None
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }.get(annotation)
    if annotation is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if annotation is str and value is None:
        return "none"
    if ok is not None and not ok(value):
        raise ValueError(f"override {where}={value!r}: expected {annotation.__name__}, got {type(value).__name__}")
    return value


def _optional_section(annotation: Any) -> Optional[type]:
    """The dataclass of an ``Optional[SomeConfig]`` field (a section that may be None), else None."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    is_optional = typing.get_origin(annotation) is typing.Union and len(args) == 1
    return args[0] if is_optional and dataclasses.is_dataclass(args[0]) else None


def apply_overrides(obj: Any, overrides: Mapping[str, Any], prefix: str = "", check: bool = True) -> Any:
    """A copy of dataclass ``obj`` with ``overrides`` applied (dotted keys or nested dicts).

    Args:
        obj: a configuration dataclass (``TrainerConfig``, ``WarmStartConfig``, any section).
        overrides: ``{"steps": 1, "loss.tau_p": 0.01, "rollout": {"top_p": 0.9}}``.
        prefix: how ``obj`` is reached from the root, for messages (``"warmstart."``).
        check: False: ``obj``'s own ``__post_init__`` does not run on the copy (its sections'
            still do), so that a caller can list every problem of a configuration that the
            dataclass refuses at its first one (`launch.entry.build_config`).
    Raises:
        ValueError: an unknown field (with the closest names), a value of the wrong type for an
            int/float/bool/str field, or whatever the dataclasses' ``__post_init__`` refuses.
    """
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    changes: Dict[str, Any] = {}
    renamed = getattr(type(obj), "RENAMED_FIELDS", {})
    for head, value in _by_field(overrides).items():
        if head not in names:
            if head in renamed:
                raise renamed_field_error(prefix, head, renamed[head], value)
            raise unknown_field_error(f"{prefix}{head}", obj, head)
        current = getattr(obj, head)
        section = _optional_section(hints[head])
        if current is None and section is not None and isinstance(value, Mapping):
            current = section()  # an optional section off by default (``lora``): its fields turn it on
        if dataclasses.is_dataclass(current) and isinstance(value, Mapping):
            value = apply_overrides(current, value, f"{prefix}{head}.")
        elif value is None and section is not None:
            pass  # ``lora=none``: the optional section off
        elif dataclasses.is_dataclass(current) and not isinstance(value, type(current)):
            if head in renamed:
                raise renamed_field_error(prefix, head, renamed[head], value)
            raise ValueError(f"override {prefix}{head}={value!r}: {prefix}{head} is a section "
                             f"({type(current).__name__}); set its fields, {prefix}{head}.FIELD=VALUE")
        else:
            value = check_value(f"{prefix}{head}", value, hints[head])
        changes[head] = value
    if check:
        return dataclasses.replace(obj, **changes)
    unchecked = copy.copy(obj)
    for name, value in changes.items():
        setattr(unchecked, name, value)
    return unchecked


def _by_field(overrides: Mapping[str, Any]) -> Dict[str, Any]:
    """``overrides`` by the field each names: the dotted keys and nested dicts of one section
    merged into one dict, so that a section's fields that depend on each other (``rollout.mode``
    and ``rollout.separate.engine_ranks``) are applied, and checked, together."""
    fields: Dict[str, Any] = {}
    for key, value in overrides.items():
        head, _, rest = key.partition(".")
        if rest:
            value = {rest: value}
        known = fields.get(head)
        if isinstance(known, Mapping) and isinstance(value, Mapping):
            value = {**known, **value}
        fields[head] = value
    return fields
