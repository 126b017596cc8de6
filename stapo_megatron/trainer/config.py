"""`WarmStartConfig`: the supervised warm-start before RL (`stapo_megatron.trainer.warmstart`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from stapo_megatron.utils import check_at_least

@dataclasses.dataclass
class WarmStartConfig:
    """Supervised warm-start before RL (the CPU demo: a fresh tiny model has zero reward)."""

    steps: int = 0
    """SFT optimizer steps (0 = none)."""
    lr: float = 1e-3
    """SFT learning rate (a separate AdamW; RL starts with fresh optimizer state)."""
    prompts_per_step: int = 32
    """Prompts per SFT step over all DP ranks."""
    target_template: str = "\\boxed{{{answer}}}"
    """Target response for an example; ``{answer}`` is replaced (end-of-sequence appended)."""
    target_fn: str = ""
    """Dotted path of a function ``(Example) -> str`` giving the target response instead of
    ``target_template`` (end-of-sequence appended), e.g. a worked solution; empty = the template."""
    label_smoothing: float = 0.0
    """Label smoothing eps of the SFT loss: (1 - eps) NLL + eps CE(uniform over the vocabulary).
    A pure-SFT tiny model puts ~1e-5 on every off-target token, so its samples never contain
    the low-probability tokens S2T is about; eps leaves the tail a pretrained LLM has."""
    save_to: str = ""
    """If set, the warm-started weights are also saved there (model only) before RL starts, so
    other runs can start from them with ``ModelConfig.megatron_ckpt`` and no warm-start."""
    seed: Optional[int] = None
    """Seeds the warm-start (the initial weights and its prompt order) apart from the RL run;
    None = ``TrainerConfig.seed``. Fixed, every RL seed starts from the same warm-started weights."""
    cache_dir: str = ""
    """If set, the warm-started weights are cached in ``<cache_dir>/<key>``, ``key`` a hash of
    everything that determines them (this config, the model folder's config, the data, the
    parallel layout; `stapo_megatron.trainer.warmstart`); a later run with the same key loads them
    instead of training. The recipe stays the source of truth: change it and the key changes."""

    def __post_init__(self):
        check_at_least(self, 0, "steps")
        check_at_least(self, 1, "prompts_per_step")
        if not (0 <= self.label_smoothing < 1):
            raise ValueError(f"warmstart.label_smoothing must be in [0, 1), got {self.label_smoothing}")
