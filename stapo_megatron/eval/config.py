"""The evaluation configs: the trainer's ``eval`` section (`EvalConfig`: when and how the held-out
set and the named sets are sampled), a named set (`EvalSetConfig`, parsed by `eval_set_configs`)
and a sampling setting (`Decoding`)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Dict, List, Optional, Tuple

from stapo_megatron.rollout.config import SamplingSettings
from stapo_megatron.utils import check_at_least, unknown_field_error

@dataclasses.dataclass(frozen=True)
class Decoding:
    """One sampling setting of the evaluation."""

    temperature: float
    """Sampling temperature."""

    top_p: float
    """Nucleus sampling threshold (1.0 = the full distribution)."""

    name: str
    """Key of this setting in the results, e.g. ``"T0.7_p0.9"``."""

    @classmethod
    def from_name(cls, name: str) -> "Decoding":
        """The decoding a name ``T<temperature>_p<top_p>`` stands for (``"T0.7_p0.9"``).

        Raises:
            ValueError: for another form, a negative temperature or a top_p outside (0, 1].
        """
        match = _DECODING_NAME.fullmatch(name) if isinstance(name, str) else None
        if match is None:
            raise ValueError(f"decoding {name!r}: expected T<temperature>_p<top_p>, e.g. 'T0.7_p0.9'")
        temperature, top_p = float(match.group(1)), float(match.group(2))
        if not 0 < top_p <= 1:
            raise ValueError(f"decoding {name!r}: top_p must be in (0, 1], got {top_p}")
        return cls(temperature, top_p, name)

    def settings(self, k: int, max_tokens: int, seed: Optional[int]) -> SamplingSettings:
        """The `SamplingSettings` of ``k`` samples per problem at this decoding, at most
        ``max_tokens`` tokens each, the first seeded ``seed``."""
        return SamplingSettings(k, self.temperature, self.top_p, max_tokens, seed)


_DECODING_NAME = re.compile(r"T(\d+(?:\.\d+)?)_p(\d+(?:\.\d+)?)")


@dataclasses.dataclass
class EvalSetConfig:
    """A named evaluation set: avg@k / pass@k of each decoding (`stapo_megatron.eval.scoring`)."""

    name: str = ""
    """Name in the metrics (``eval/<name>/<decoding>/avg@<k>``) and tables, e.g. "aime24"."""
    path: str = ""
    """JSONL/parquet file or HF dataset folder, one problem per row."""
    k: int = 4
    """Samples per problem (the paper: 32 on AIME24/25 and AMC23, 4 on the others)."""
    decodings: Tuple[str, ...] = ("T1.0_p1.0", "T0.7_p0.9")
    """Sampling settings, each named ``T<temperature>_p<top_p>`` (the paper's two by default)."""
    prompt_field: str = ""
    """Field of the question ("" = the first of `problem`, `question`, `prompt`)."""
    answer_field: str = ""
    """Field of the answer ("" = the first of `answer`, `final_answer`, `solution`; a field
    named `solution` is a worked solution whose last \\boxed{} is the answer)."""

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise ValueError(f"EvalSetConfig.name must be non-empty without '/' (it is part of metric names), "
                             f"got {self.name!r}")
        if not self.path:
            raise ValueError(f"EvalSetConfig {self.name!r}: path is empty")
        check_at_least(self, 1, "k")
        self.decodings = tuple(self.decodings)
        if not self.decodings or len(set(self.decodings)) != len(self.decodings):
            raise ValueError(f"EvalSetConfig {self.name!r}: decodings must be non-empty and unique, "
                             f"got {self.decodings}")
        for name in self.decodings:
            Decoding.from_name(name)  # ValueError naming the expected form


@dataclasses.dataclass
class EvalConfig:
    """In-training evaluation (`stapo_megatron.eval.evaluator.Evaluator`): the held-out set
    (``data.eval_path``, ``eval_accuracy``) and the named sets, at step 0, every ``every`` steps
    and at the end."""

    every: int = 10
    """Evaluation (held-out set and ``sets``) every this many steps (and at step 0 and the
    end); 0 = never."""
    temperature: float = 0.0
    """Held-out decoding temperature (0 = greedy)."""
    samples: int = 1
    """Samples per held-out prompt (avg@k with k = this)."""
    max_response_len: Optional[int] = None
    """Maximum response tokens of evaluation, the held-out set and ``sets`` (the paper:
    20480); None = the training rollouts' ``rollout.max_response_len``."""
    sets: List[EvalSetConfig] = dataclasses.field(default_factory=list)
    """Named evaluation sets scored with the held-out set (every ``every`` steps, at step 0
    and the end), sampled with ``max_response_len`` tokens at most (as the held-out set);
    dicts of `EvalSetConfig` fields, or one string ``name=..,path=..;...`` (what a ``key=value``
    override gives), are accepted (`eval_set_configs`); in the string, ``bench_dir=DIR`` stands
    for the paper's benchmarks found in DIR (``scripts/prepare_data.py bench``'s folder)."""

    def __post_init__(self):
        check_at_least(self, 0, "every")
        check_at_least(self, 1, "samples")
        if self.max_response_len is not None:
            check_at_least(self, 1, "max_response_len")
        if not (0 <= self.temperature and math.isfinite(self.temperature)):
            raise ValueError(f"eval.temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        self.sets = eval_set_configs(self.sets)


def eval_set_configs(sets: Any) -> List[EvalSetConfig]:
    """``TrainerConfig.eval.sets`` (and ``stapo-eval --set``) as `EvalSetConfig` objects.

    Takes `EvalSetConfig` objects, dicts of its fields, or one string (what the command line can
    carry): sets separated by ";", each ``name=..,path=..[,k=4][,prompt_field=..]
    [,answer_field=..][,decodings=T1.0_p1.0+T0.7_p0.9]``, or ``bench_dir=DIR``: the paper's
    benchmarks found in DIR (`paper_eval_set_configs`). An unknown field is refused with the
    closest field names; names must be unique.
    """
    if isinstance(sets, str):
        sets = [fields for spec in sets.split(";") if spec.strip() for fields in _eval_set_specs(spec)]
    if not isinstance(sets, (list, tuple)):
        raise ValueError(f"eval.sets must be a list of EvalSetConfig (or dicts of its fields) or a string "
                         f"'name=..,path=..;...', got {type(sets).__name__}")
    out = []
    for i, entry in enumerate(sets):
        if isinstance(entry, dict):
            names = {f.name for f in dataclasses.fields(EvalSetConfig)}
            unknown = [key for key in entry if key not in names]
            if unknown:
                raise unknown_field_error(f"eval.sets[{i}].{unknown[0]}", EvalSetConfig(name="x", path="x"), unknown[0])
            entry = EvalSetConfig(**entry)
        if not isinstance(entry, EvalSetConfig):
            raise ValueError(f"eval.sets[{i}] must be an EvalSetConfig or a dict, got {type(entry).__name__}")
        out.append(entry)
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"eval.sets names must be unique, got {names}")
    return out


PAPER_BENCHMARKS = {"aime24": 32, "aime25": 32, "amc23": 32, "math500": 4, "minerva": 4,
                    "olympiadbench": 4}
"""Benchmark file stem -> k of avg@k, as in the paper."""
BENCH_DIR_KEY = "bench_dir"
"""The ``eval.sets`` string item that stands for the paper's benchmarks in one folder."""


def paper_eval_set_configs(bench_dir: str, benchmarks: Dict[str, int] = PAPER_BENCHMARKS) -> List[EvalSetConfig]:
    """``TrainerConfig.eval.sets`` for the paper's benchmarks in ``bench_dir`` (the folder
    ``scripts/prepare_data.py bench`` writes): one `EvalSetConfig` per ``<name>.jsonl`` found,
    with the paper's k and both decodings. ValueError if the folder holds none of them."""
    if not os.path.isdir(bench_dir):
        raise ValueError(f"benchmark folder {bench_dir!r} does not exist")
    found = [EvalSetConfig(name=name, path=os.path.join(bench_dir, f"{name}.jsonl"), k=k)
             for name, k in benchmarks.items() if os.path.isfile(os.path.join(bench_dir, f"{name}.jsonl"))]
    if not found:
        raise ValueError(f"benchmark folder {bench_dir!r} has none of {', '.join(f'{n}.jsonl' for n in benchmarks)} "
                         "(write them with scripts/prepare_data.py bench)")
    return found


def _eval_set_specs(spec: str) -> List[Any]:
    """The sets of one ``;``-separated item: ``bench_dir=DIR`` (the paper's benchmarks there, as
    `EvalSetConfig` objects) or one set's fields (a dict)."""
    key, sep, value = spec.partition("=")
    if sep and key.strip() == BENCH_DIR_KEY:
        if "," in value:
            raise ValueError(f"eval set {spec!r}: {BENCH_DIR_KEY}=DIR takes no other fields")
        return list(paper_eval_set_configs(value.strip()))
    return [_eval_set_fields(spec)]


def _eval_set_fields(spec: str) -> Dict[str, Any]:
    """The fields of one ``name=..,path=..,k=4,decodings=T1.0_p1.0+T0.7_p0.9`` set, typed."""
    fields: Dict[str, Any] = {}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"eval set {spec!r}: expected FIELD=VALUE pairs separated by commas, got {item!r}")
        fields[key.strip()] = value.strip()
    if "k" in fields:
        try:
            fields["k"] = int(fields["k"])
        except ValueError:
            raise ValueError(f"eval set {spec!r}: k must be an integer, got {fields['k']!r}") from None
    if "decodings" in fields:
        fields["decodings"] = tuple(fields["decodings"].split("+"))
    return fields
