"""`LoraConfig`: which linears of a Megatron-Core GPTModel get low-rank adapters, and their shape.

The adapters themselves (`stapo_megatron.mcore.lora`) add ``(alpha / rank) * B A x`` to the output
of each targeted linear (Hu et al. 2021, eq. 3: h = W0 x + B A x, scaled by alpha / r). This module
imports no Megatron, so the config tree can compose it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Tuple

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Megatron-Core's names of the linears an adapter can wrap: the attention's fused QKV and output
projection (column- and row-parallel), the MLP's fused gate/up and down projection (column- and
row-parallel)."""
EXPERT_TARGETS = ("linear_fc1", "linear_fc2")
"""Of ``LORA_TARGETS``, those a mixture-of-experts layer's experts have (with ``experts=True``)."""


@dataclasses.dataclass
class LoraConfig:
    """Low-rank adapters on the base model's parallel linears (the base frozen)."""

    rank: int = 16
    """r: the adapters' inner dimension (A is r x in, B is out x r). At most the smallest full
    (unsharded) dimension of every targeted linear; checked when the adapters are added."""
    alpha: float = 32.0
    """The adapter's output is scaled by ``alpha / rank`` (so a change of rank keeps the update's
    size at a given learning rate, as PEFT and Megatron-Bridge scale it)."""
    dropout: float = 0.0
    """Dropout probability on the adapter's input (the base path sees the input undropped)."""
    target_modules: List[str] = dataclasses.field(default_factory=lambda: list(LORA_TARGETS))
    """Which linears get adapters, by Megatron-Core's name: any of ``LORA_TARGETS``."""
    experts: bool = False
    """Also adapt the mixture-of-experts experts' ``linear_fc1`` / ``linear_fc2`` (those in
    ``target_modules``), one adapter per expert; False leaves the experts frozen and unadapted.
    Needs experts built from Megatron's parallel linears (the local spec's ``SequentialMLP``)
    and expert-TP 1."""
    seed: int = 0
    """Seed of A's initialisation. Each adapter's A is drawn at full size from a generator keyed
    by this seed and the adapter's place in the model (global layer, module, global expert), then
    sharded: the same adapters at any TP / PP / EP layout."""

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"lora.rank must be a positive integer, got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"lora.alpha must be finite and > 0, got {self.alpha!r}")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.target_modules, str):
            raise ValueError(f"lora.target_modules must be a list of module names, got the string "
                             f"{self.target_modules!r}")
        self.target_modules = list(self.target_modules)
        if not self.target_modules:
            raise ValueError(f"lora.target_modules is empty: name at least one of {LORA_TARGETS}")
        unknown = [name for name in self.target_modules if name not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"lora.target_modules: {unknown} are not adaptable linears; choose among {LORA_TARGETS}")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"lora.target_modules names a module twice: {self.target_modules}")
        if self.experts and not set(self.target_modules) & set(EXPERT_TARGETS):
            raise ValueError(f"lora.experts=True but lora.target_modules {self.target_modules} names none of the "
                             f"experts' linears {EXPERT_TARGETS}")

    @property
    def scaling(self) -> float:
        """``alpha / rank``: the factor on the adapter's output."""
        return self.alpha / self.rank


def rank_problems(config: LoraConfig, shapes: Dict[str, Tuple[int, int]], where: str = "") -> List[str]:
    """Each target of ``config`` whose linear is narrower than ``config.rank``: ``shapes`` gives the
    model's (in, out) full dimensions by target name (those it lacks are not checked; the
    adapters skip them). The same rule as `stapo_megatron.mcore.lora.apply_lora`'s, for a check
    before any model is built (the launch's dry run)."""
    problems = []
    for target in config.target_modules:
        if target in shapes and config.rank > min(shapes[target]):
            fan_in, fan_out = shapes[target]
            problems.append(f"lora.rank {config.rank} is larger than {target}'s smaller dimension "
                            f"{min(fan_in, fan_out)} (in {fan_in}, out {fan_out}){where}")
    return problems
