"""A training step's samples as one flat record, from the rollout schedule to the loss: `StepRollout`.

The schedule (`stapo_megatron.trainer.rollout_schedule.RolloutSchedule.samples`) builds it once,
complete, from the engines' groups (`StepRollout.of_groups`); every later phase reads it and none
changes it: the scorer (texts against answers), the group advantages ([P, G] in its order), the
routing monitor (routes), the metrics (lengths, token ages) and `stapo_megatron.batch.records.
make_records`, which turns it into the update's records (`SequenceRecord`). One `RolloutSample` per
sampled response, flat in (prompt, sample) order: sample g of the step's p-th prompt is entry
p x G + g. A prompt's G samples are its group (`StepRollout.groups`); dynamic sampling
(`stapo_megatron.trainer.dynamic_sampling`) swaps a group for another prompt's
(`StepRollout.replace_group`), which gives a new record.

Token versions: the policy version (steps trained) that sampled each response token. One policy
sampled a whole request (colocated, or separate placement without partial rollouts): every token
has the request's version. A partial rollout's response continues over several steps
(`stapo_megatron.serve.partial`), so its tokens carry the versions the engine reported
(``Sample.versions``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

Sample = Any
"""`stapo_megatron.rollout.base.Sample` (the rollout wing sits above this one and is not imported):
the fields read here are ``token_ids``, ``logprobs``, ``text``, ``routed_experts`` and ``versions``."""


@dataclasses.dataclass(frozen=True)
class RolloutSample:
    """One sampled response with its prompt, its answer and the versions of its tokens."""

    prompt_index: int
    """The prompt's index in the training set."""
    prompt_ids: Tuple[int, ...]
    """The prompt's token ids."""
    answer: str
    """The prompt's reference answer (what the reward scores the response against)."""
    sample: Sample
    """The engine's response: token ids, the sampler's log-probs, text, finish reason, MoE routes."""
    versions: Tuple[int, ...]
    """Per response token: the policy version (steps trained) that sampled it."""

    def __post_init__(self):
        if len(self.versions) != len(self.sample.token_ids):
            raise ValueError(f"RolloutSample.versions: {len(self.versions)} versions for "
                             f"{len(self.sample.token_ids)} response tokens (prompt {self.prompt_index})")

    @property
    def routes(self) -> Optional[torch.Tensor]:
        """MoE: the experts the engine routed every forwarded token to (``Sample.routed_experts``)."""
        return self.sample.routed_experts

    def oldest(self, default: int) -> int:
        """The version of the response's oldest token (``default`` for an empty response)."""
        return min(self.versions, default=default)

    def keep_mask(self, oldest_allowed: int) -> Optional[List[bool]]:
        """Per token: sampled by a policy of version >= ``oldest_allowed`` (None when all are)."""
        if self.oldest(oldest_allowed) >= oldest_allowed:
            return None
        return [v >= oldest_allowed for v in self.versions]


@dataclasses.dataclass(frozen=True)
class StepRollout:
    """This DP rank's samples of one training step (module docstring)."""

    step: int
    """The training step (0-based) the samples train."""
    version: int
    """The oldest policy version (steps trained) among the step's tokens: the request's policy,
    or with partial rollouts the oldest token's."""
    group_size: int
    """G samples per prompt."""
    samples: Tuple[RolloutSample, ...]
    """Flat in (prompt, sample) order: entry p x G + g is sample g of the step's p-th prompt."""

    def __post_init__(self):
        if self.group_size < 1 or len(self.samples) % self.group_size:
            raise ValueError(f"StepRollout: {len(self.samples)} samples do not form groups of "
                             f"group_size={self.group_size}")
        for p, group in enumerate(self.groups()):
            if len({s.prompt_index for s in group}) != 1:
                raise ValueError(f"StepRollout: group {p} mixes prompts {sorted({s.prompt_index for s in group})}")

    @classmethod
    def of_groups(cls, step: int, prompts: Sequence[Tuple[int, Sequence[int]]], answer: Callable[[int], str],
                  groups: Sequence[Sequence[Sample]], group_size: int, version: Optional[int] = None) -> "StepRollout":
        """The step's record of the engines' groups: ``groups[p]`` are the G samples of
        ``prompts[p]`` (training-set index, token ids), ``answer(index)`` its reference answer.

        ``version``: the policy that sampled every token of the request; None: the samples carry
        their tokens' versions (``Sample.versions``, partial rollouts) and the step's is the oldest.
        """
        if len(prompts) != len(groups):
            raise ValueError(f"StepRollout.of_groups: {len(groups)} sample groups for {len(prompts)} prompts")
        flat = []
        for (index, ids), group in zip(prompts, groups):
            if len(group) != group_size:
                raise ValueError(f"StepRollout.of_groups: prompt {index} has {len(group)} samples, not "
                                 f"group_size={group_size}")
            for s in group:
                versions = [version] * len(s.token_ids) if version is not None else s.versions
                if versions is None:
                    raise ValueError(f"StepRollout.of_groups: a sample of prompt {index} carries no token versions "
                                     f"(Sample.versions) and no request version was given")
                flat.append(RolloutSample(index, tuple(ids), answer(index), s, tuple(versions)))
        if version is None:
            version = min(min(s.versions) for s in flat if s.versions)
        return cls(step, version, group_size, tuple(flat))

    def groups(self) -> Iterator[Tuple[RolloutSample, ...]]:
        """The step's groups in order: the G samples of each prompt."""
        G = self.group_size
        for p in range(len(self.samples) // G):
            yield self.samples[p * G:(p + 1) * G]

    def replace_group(self, p: int, new: Sequence[RolloutSample]) -> "StepRollout":
        """This record with group ``p`` (the step's p-th prompt) replaced by ``new``, another
        prompt's G samples; its version is the oldest among the tokens it then holds (the
        record's own when no response has a token). ValueError for a ``p`` outside the groups
        or a ``new`` that is not one prompt's G samples."""
        if not 0 <= p < self.num_prompts:
            raise ValueError(f"StepRollout.replace_group: group {p} of a step of {self.num_prompts} groups")
        if len(new) != self.group_size:
            raise ValueError(f"StepRollout.replace_group: {len(new)} samples replace group {p}, not "
                             f"group_size={self.group_size}")
        G = self.group_size
        samples = self.samples[:p * G] + tuple(new) + self.samples[(p + 1) * G:]
        version = min((min(s.versions) for s in samples if s.versions), default=self.version)
        return dataclasses.replace(self, samples=samples, version=version)

    @property
    def num_prompts(self) -> int:
        """P prompts (groups) of the step."""
        return len(self.samples) // self.group_size

    @property
    def prompt_indices(self) -> List[int]:
        """The training-set index of each of the step's P prompts, in order."""
        return [group[0].prompt_index for group in self.groups()]

    @property
    def texts(self) -> List[str]:
        """Every response's text, flat (what the reward reads)."""
        return [s.sample.text for s in self.samples]

    @property
    def answers(self) -> List[str]:
        """Every response's reference answer, flat (its prompt's, repeated G times)."""
        return [s.answer for s in self.samples]

    @property
    def response_tokens(self) -> int:
        """The step's response tokens, summed."""
        return sum(len(s.sample.token_ids) for s in self.samples)

    @property
    def token_versions(self) -> List[int]:
        """Every response token's policy version, flat."""
        return [v for s in self.samples for v in s.versions]
