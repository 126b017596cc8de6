"""The evaluation configs: a `Decoding` (sampling setting) and an `EvalSetConfig` (a named set)."""

from __future__ import annotations

import dataclasses
import re
from typing import Tuple

from stapo_megatron.utils import check_at_least

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
