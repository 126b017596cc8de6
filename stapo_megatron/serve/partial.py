"""Partial rollouts on an engine rank (``rollout.mode="partial"``; APRIL, arXiv 2509.18521; slime's
``--partial-rollout``): `PartialPool`, one per trainer replica an engine serves.

Per step the trainers send a window of the replica's prompts in data order (the step's P and the
next step's first ``(oversample - 1)`` x P); the pool takes the ones it has not seen and admits
them while it holds fewer than ``oversample`` x P groups, then generates in rounds: every group not yet started gets
its G samples of at most ``rollout.partial.round_tokens`` tokens, every unfinished response a
continuation of at most as many (its prompt and its tokens so far as the prompt). After each
round the groups whose G responses have all finished (EOS, or ``max_response_len`` tokens) are
counted in admission order; once P are, the step stops waiting: the first P are returned and the
rest stay, to be continued by the next step's rounds with the weights the engine holds then.
Every token keeps the policy version that sampled it (`stapo_megatron.rollout.base.Sample.versions`).
A continued response's text is the engine's ``detokenize`` of all its tokens, never the rounds'
texts joined: a character whose tokens straddle a round boundary (a byte-level tokenizer's
multi-byte character) decodes only from the whole sequence, and the reward reads this text.

Deterministic: rounds are counted in tokens, not time, and each call is seeded from the step's
seed, the round and the group's place, so the same weights and seeds give the same steps.

The pool lives on an engine rank and is not saved; the trainers keep its account
(`stapo_megatron.trainer.pool_ledger.PoolLedger`:
the stream positions sent and not yet trained), which the checkpoint holds, so that a resumed run
sends the positions that were in flight again (their groups start over with the resumed policy)
and never sends one that trained: every data position trains once across a kill and a resume.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Deque, List, Sequence, Tuple

from stapo_megatron.rollout.base import Sample
from stapo_megatron.rollout.config import SamplingSettings
from stapo_megatron.utils import stream_seed


def round_seed(step_seed: int, round_index: int) -> int:
    """The first seed of round ``round_index`` of a pool whose step seed (the asking replica's
    rollout seed of the step that asked, `stapo_megatron.trainer.seeds.Seeds.rollout`) is
    ``step_seed``."""
    return stream_seed("round", step_seed, round_index)


@dataclasses.dataclass
class Group:
    """One prompt's G responses in progress."""

    index: int
    """The prompt's index in the training set (its answer, at the trainer)."""
    prompt: List[int]
    samples: List[Sample] = dataclasses.field(default_factory=list)
    """Empty until the group's first round; then G responses growing round by round."""

    def finished(self, max_tokens: int) -> bool:
        return bool(self.samples) and all(_done(s, max_tokens) for s in self.samples)


def _done(sample: Sample, max_tokens: int) -> bool:
    return sample.finish_reason == "stop" or len(sample.token_ids) >= max_tokens


class PartialPool:
    """The groups in flight for one trainer replica (module docstring)."""

    def __init__(self):
        self.groups: List[Group] = []
        self.waiting: Deque[Tuple[int, List[int]]] = collections.deque()
        self.next_position = 0
        """The replica's prompt stream position after the last one taken (windows overlap)."""
        self.continued = 0
        """Responses that were continued in a later step than their first tokens (counted once)."""

    def step(self, engine, fresh: Sequence[Tuple[int, int, List[int]]], settings: SamplingSettings, want: int,
             capacity: int, round_tokens: int, version: int) -> List[Group]:
        """Take the prompts of ``fresh`` (stream position, training-set index, prompt ids: a
        window of the replica's data order that may overlap the last one) not taken before, admit
        them while the pool holds fewer than ``capacity`` groups, generate rounds of at most
        ``round_tokens`` new tokens a response until ``want`` groups are complete and return them
        (admission order). ``settings``: the step's (G samples per prompt of at most
        ``settings.max_tokens`` tokens; round r seeded from ``settings.seed`` and r);
        ``version``: the policy version the engine holds.

        Raises:
            RuntimeError: the pool ran dry before ``want`` groups finished (more wanted than sent).
        """
        for position, index, prompt in fresh:
            if position >= self.next_position:
                self.waiting.append((index, list(prompt)))
                self.next_position = position + 1
        while len(self.groups) < capacity and self.waiting:
            self.groups.append(Group(*self.waiting.popleft()))
        max_tokens = settings.max_tokens
        for group in self.groups:  # responses started in an earlier step continue now
            self.continued += sum(1 for s in group.samples if not _done(s, max_tokens))
        for round_index in range(max_tokens // max(1, round_tokens) + 2):
            done = [g for g in self.groups if g.finished(max_tokens)]
            if len(done) >= want:
                taken = done[:want]
                self.groups = [g for g in self.groups if not any(g is t for t in taken)]
                return taken
            self._round(engine, dataclasses.replace(settings, seed=round_seed(settings.seed, round_index)),
                        round_tokens, version)
        raise RuntimeError(f"partial rollouts: {len(done)} of the {want} groups a step needs finished, and the pool "
                           f"({len(self.groups)} groups, {len(self.waiting)} waiting) has nothing left to generate")

    def _round(self, engine, settings: SamplingSettings, round_tokens: int, version: int) -> None:
        """One round of at most ``round_tokens`` new tokens a response, ``settings.max_tokens`` in
        all: new groups start, unfinished responses continue (seeded calls from ``settings.seed``)."""
        max_tokens = settings.max_tokens
        new = [g for g in self.groups if not g.samples]
        going = [(g, s) for g in self.groups if g.samples for s in g.samples if not _done(s, max_tokens)]
        if new:
            out = dataclasses.replace(settings, max_tokens=min(round_tokens, max_tokens)).generate(
                engine, [g.prompt for g in new])
            for group, samples in zip(new, out):
                group.samples = [dataclasses.replace(s, versions=[version] * len(s.token_ids)) for s in samples]
        one = dataclasses.replace(settings.skip(len(new)), n=1)  # distinct seeds for every response of the round
        limits = [min(round_tokens, max_tokens - len(s.token_ids)) for _, s in going]
        for limit in sorted(set(limits)):  # one call per budget (near max_tokens they differ)
            part = [pair for pair, lim in zip(going, limits) if lim == limit]
            out = dataclasses.replace(one, max_tokens=limit).generate(engine, [g.prompt + s.token_ids for g, s in part])
            one = one.skip(len(part))
            for (_, sample), (more,) in zip(part, out):
                _extend(sample, more, version, engine.detokenize)


def _extend(sample: Sample, more: Sample, version: int, detokenize) -> None:
    """Append a continuation to a response in place (its text decoded from all its tokens)."""
    sample.token_ids = sample.token_ids + more.token_ids
    sample.logprobs = sample.logprobs + more.logprobs
    sample.versions = (sample.versions or []) + [version] * len(more.token_ids)
    sample.text = detokenize(sample.token_ids)
    sample.finish_reason = more.finish_reason
