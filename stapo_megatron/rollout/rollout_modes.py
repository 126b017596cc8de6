"""The rollout modes (``rollout.mode``) and the section each mode reads (docs/async.md).

- "colocated" (the paper's protocol): every training rank hosts an engine; all ranks generate,
  then all train.
- "separate": the job's last ranks run only engines (``rollout.separate``); with
  ``max_staleness`` k >= 1 they generate the next k steps while the trainers train.
- "partial": separate engines that keep a pool of prompts in flight and continue unfinished
  responses across steps with newer weights (``rollout.partial``).
- "streaming": separate engines that never drain: groups are admitted one at a time while the KV
  cache has room and the eta bound allows, and weights load between decode iterations
  (``rollout.streaming``).

The three separate modes share ``rollout.separate``; ``max_staleness`` is the one name of the
bound on how far the engines run ahead of training (eta in AReaL's terms, k in the docs'
formulas). A mode's section left at its defaults when the mode is not chosen is the only
accepted state: a setting for another mode is refused by name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional

from stapo_megatron.utils import check_at_least

MODES = ("colocated", "separate", "partial", "streaming")
"""``rollout.mode``: where the engines run and how they schedule (module docstring)."""
SEPARATE_MODES = MODES[1:]
"""The modes whose engines run on their own ranks (``rollout.separate``)."""
STREAM_ORDERS = ("completion", "admission")
"""Streaming rollouts: the order a replica's complete groups train in (`StreamingRollouts.order`)."""
WEIGHT_LOADS = ("in_flight", "recompute", "drain")
"""Streaming rollouts: how an engine takes new weights (`StreamingRollouts.weight_load`)."""

RENAMED_ROLLOUT_FIELDS: Dict[str, str] = {
    "placement": "mode='separate'",
    "engine_ranks": "separate.engine_ranks",
    "max_staleness": "separate.max_staleness",
    "weight_bucket_mb": "separate.weight_bucket_mb",
    "oversample": "partial.oversample",
    "partial_tokens": "partial.round_tokens",
    "mask_stale_tokens": "partial.max_token_age=<separate.max_staleness>",
    "max_token_age": "partial.max_token_age or streaming.max_token_age",
    "stream_order": "streaming.order",
    "stream_reserve_tokens": "streaming.reserve_tokens",
    "weight_load": "streaming.weight_load",
    "filter_groups": "streaming.filter_groups",
    "filter_rounds": "streaming.filter_rounds",
    "partial": "mode='partial'",
    "streaming": "mode='streaming'",
}
"""The flat keys of the earlier rollout section -> their spelling now (`RolloutSampling.RENAMED_FIELDS`;
``partial`` and ``streaming`` are sections now, so a value that is not one names the mode)."""


@dataclasses.dataclass
class SeparatePlacement:
    """``rollout.separate``: the engine ranks of the separate, partial and streaming modes."""

    engine_ranks: int = 0
    """How many ranks (GPUs) of the job run engines, the job's last ones; they form
    ``engine_ranks / rollout.tensor_parallel_size`` engines. 0 only with ``mode="colocated"``."""
    max_staleness: int = 0
    """How many updates the engines may run ahead of training (k; eta for streaming). "separate":
    step s's samples are requested from the policy after step ``max(0, s - max_staleness)``,
    decided by the engines' command queue (weight updates and requests in order; timing never
    changes it): 0 is synchronous, the same samples as colocated. "partial": a response continues
    over several steps, so its first tokens can be older (up to about ceil(max_response_len /
    round_tokens) + k steps; ``partial.max_token_age`` bounds the tokens). "streaming": the group
    that will train at step s starts only under the policy after step s - eta or newer, counting
    groups in admission order (AReaL's ``max_head_offpolicyness``). Partial and streaming need >= 1."""
    weight_bucket_mb: int = 512
    """The weight transfer sends the HF tensors in buckets of about this many MiB, cut between
    vLLM's reload layers (a layer larger than it travels alone): the trainers' extra memory, and on
    each engine GPU beside vLLM's share the buckets vLLM's reload keeps and the layer it
    materialises (`stapo_megatron.rollout.weight_buckets`)."""

    def __post_init__(self):
        check_at_least(self, 0, "engine_ranks", "max_staleness")
        check_at_least(self, 1, "weight_bucket_mb")


@dataclasses.dataclass
class PartialRollouts:
    """``rollout.partial`` (``mode="partial"``; APRIL, slime's ``--partial-rollout``): each engine
    keeps a pool of its replica's prompts in flight and, per step, generates in rounds of
    ``round_tokens`` tokens until the step's prompts have all G samples finished; it returns the
    first complete groups in admission order and keeps the rest, continued next step with the
    weights it then holds (`stapo_megatron.serve.partial`). Each token keeps the policy version
    that sampled it (``Sample.versions``)."""

    oversample: float = 1.0
    """The pool holds up to ``oversample`` x the replica's prompts per step, so that the long
    responses of one step need not hold the next up (the prompts enter the pool in data order; a
    step trains the first groups to finish)."""
    round_tokens: int = 0
    """New tokens per unfinished response and round (0: ``max_response_len // 4``)."""
    max_token_age: Optional[int] = None
    """The token-level bound, in steps: a token sampled by the policy after step v trains at step
    s only if ``s - v <= max_token_age``; older ones are left out of the loss
    (``SequenceRecord.loss_mask``; the response's other tokens still train) and counted
    (``token_age_masked``). At least ``separate.max_staleness`` (a smaller bound would drop whole
    responses the request-level bound admits); equal to it is slime's
    ``--mask-offpolicy-in-partial-rollout``. None: unbounded (``token_age_max`` reports the age)."""

    def __post_init__(self):
        if not (self.oversample >= 1 and math.isfinite(self.oversample)):
            raise ValueError(f"rollout.partial.oversample must be >= 1, got {self.oversample}")
        check_at_least(self, 0, "round_tokens")

    def tokens_per_round(self, max_response_len: int) -> int:
        """New tokens per response and round: ``round_tokens``, or a quarter of the longest response."""
        return self.round_tokens or max(1, max_response_len // 4)


@dataclasses.dataclass
class StreamingRollouts:
    """``rollout.streaming`` (``mode="streaming"``; vLLM engines of ``tensor_parallel_size`` 1;
    `stapo_megatron.serve.stream_pools`): the engines never drain. Each replica's prompts are
    admitted one group of G samples at a time while an engine's KV cache holds their reservation
    (``reserve_tokens``) and the eta bound (``separate.max_staleness``) allows; the engine advances
    one decode iteration at a time, takes new weights between two iterations (``weight_load``), and
    a step trains as soon as its replica's P groups are complete (``order``). Every token keeps
    the policy version that sampled it (``Sample.versions``)."""

    order: str = "completion"
    """"completion" trains a replica's complete groups in the order they complete (no group waits
    for another; which data positions a step trains depends on timing, so each step's are written
    to ``rollout_order.jsonl`` in the run folder and a resume trains every position once);
    "admission" trains them in the replica's data order (timing never changes which prompts a step
    trains, at the cost of a finished group waiting for every group admitted before it)."""
    reserve_tokens: Optional[int] = None
    """The response tokens of KV cache an engine reserves per admitted sample (its prompt's plus
    these, released when it finishes). None: ``max_response_len``, the worst case, so vLLM never
    preempts, but at long caps an engine runs a few times fewer samples than its cache holds.
    Below it (near the mean response) more samples run and, when their KV outgrows the cache,
    vLLM preempts the newest and later prefills its context again."""
    weight_load: str = "in_flight"
    """"in_flight" loads new weights between two decode iterations and the running sequences keep
    their KV cache (computed by the older weights; PipelineRL's in-flight update); "recompute" also
    drops the running sequences' KV cache, so their context is prefilled again under the new
    weights; "drain" admits nothing more and finishes the running sequences under the old weights
    first (the engine idles at the tail)."""
    max_token_age: Optional[int] = None
    """The token-level bound, in steps, as `PartialRollouts.max_token_age` (at least
    ``separate.max_staleness``). In completion order the only bound on a trained token's age: a
    group overtaken by shorter ones trains later than its place in the queue (docs/async.md)."""
    filter_groups: bool = False
    """DAPO's dynamic sampling ("filter groups"). A step's groups whose G rewards are all equal (no
    advantage, so no gradient) are dropped and replaced by groups of further prompts, asked of the
    engines ahead of the queued steps, until the step has P informative groups or
    ``filter_rounds`` replacement rounds have run (then the last uniform groups train as without
    the filter). The paper trains without it. Each step logs the groups dropped, their share of
    those generated and the replacement rounds."""
    filter_rounds: int = 4
    """Dynamic sampling: most replacement rounds a step (each waits for its groups to complete)."""

    def __post_init__(self):
        for name, values in (("order", STREAM_ORDERS), ("weight_load", WEIGHT_LOADS)):
            if getattr(self, name) not in values:
                raise ValueError(f"rollout.streaming.{name} must be one of {values}, got {getattr(self, name)!r}")
        check_at_least(self, 1, "filter_rounds")
        if self.reserve_tokens is not None and not (isinstance(self.reserve_tokens, int) and self.reserve_tokens >= 1):
            raise ValueError(f"rollout.streaming.reserve_tokens must be None or an int >= 1, got "
                             f"{self.reserve_tokens!r}")


MODE_SECTIONS = {"separate": SeparatePlacement, "partial": PartialRollouts, "streaming": StreamingRollouts}
"""The rollout section's mode sections, by field name."""


def changed_fields(section) -> Dict[str, object]:
    """The fields of a mode section that differ from its defaults (name -> value)."""
    default = type(section)()
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
            if getattr(section, f.name) != getattr(default, f.name)}


def check_mode_sections(mode: str, sections: Dict[str, object]) -> None:
    """``rollout.mode`` and its sections together: a known mode, each section of the right type,
    and the sections the mode does not read at their defaults (named otherwise)."""
    if mode not in MODES:
        raise ValueError(f"rollout.mode must be one of {MODES}, got {mode!r}")
    for name, section in sections.items():
        if not isinstance(section, MODE_SECTIONS[name]):
            spelling = RENAMED_ROLLOUT_FIELDS[name] if name in ("partial", "streaming") else f"{name}.FIELD=VALUE"
            raise ValueError(f"rollout.{name} is a section ({MODE_SECTIONS[name].__name__}), got {section!r}: "
                             f"write rollout.{spelling}")
        reads = name == mode or (name == "separate" and mode in SEPARATE_MODES)
        if not reads:
            for field, value in changed_fields(section).items():
                needed = f"one of {SEPARATE_MODES}" if name == "separate" else repr(name)
                raise ValueError(f"rollout.{name}.{field}={value!r} needs rollout.mode={needed} "
                                 f"(rollout.mode={mode!r} does not read rollout.{name})")
