"""One sampled sequence as it travels from the rollout to the micro-batches: `SequenceRecord`.

The trainer makes the records once per step, complete, from the step's samples
(`stapo_megatron.batch.step_rollout.StepRollout`) and the group advantages (`make_records`), and
hands them to `stapo_megatron.batch.minibatches.build_minibatches`; every layout (padded rows,
packed THD rows) takes its per-token fields from the one per-sequence routine `token_fields`,
and the data-parallel exchange of the ``budget`` layout moves records as bytes
(`encode` / `decode`), one all-to-all instead of pickled lists.

Label alignment (``batch.microbatch``): position t carries the label token t + 1, so a record of
P prompt and R response tokens has its response labels at positions P - 1 .. P + R - 2.

Legend: P = prompt tokens, R = response tokens, n = P + R, L = MoE layers, K = experts per token.
"""

from __future__ import annotations

import dataclasses
from typing import List, NamedTuple, Optional, Sequence

import torch

from stapo_megatron.batch.step_rollout import StepRollout

NO_ROUTE = -1
"""``MicroBatch.routes`` at a position the rollout engine did not forward (no route)."""


@dataclasses.dataclass(frozen=True)
class SequenceRecord:
    """One (prompt, response) pair with everything the update needs of it (built complete, never changed)."""

    prompt_ids: torch.Tensor
    """[P] int64 prompt token ids (P >= 1)."""
    response_ids: torch.Tensor
    """[R] int64 response token ids (EOS included when generation stopped on it)."""
    rollout_logprobs: torch.Tensor
    """[R] float32: the sampler's log-prob of each response token (the train/rollout mismatch)."""
    advantage: float
    """The group advantage of the response (a float32 value, ``microbatch.group_advantages``)."""
    routes: Optional[torch.Tensor] = None
    """MoE, when this step carries routes: [n - 1, L, K] int, the experts the engine routed
    every forwarded token to (``Sample.routed_experts``); None: not carried."""
    version: int = 0
    """The policy version that sampled the response: the number of optimizer updates the policy
    had taken when it generated it (the trainer's RL updates; asynchronous rollouts compare it
    with the trainer's version to know how stale a record is). A partial rollout's response was
    sampled by several: this is the oldest."""
    loss_mask: Optional[torch.Tensor] = None
    """[R] bool: the response tokens the loss sees (None: all). Partial rollouts with
    a token-level bound (the mode's ``max_token_age``: `RolloutSampling.token_age_bound`) leave out the
    tokens an older policy than the bound sampled."""

    def __post_init__(self):
        if self.prompt_ids.dim() != 1 or len(self.prompt_ids) < 1:
            raise ValueError(f"prompt_ids must be [P >= 1], got {tuple(self.prompt_ids.shape)}")
        if self.rollout_logprobs.shape != self.response_ids.shape or self.response_ids.dim() != 1:
            raise ValueError(f"rollout_logprobs {tuple(self.rollout_logprobs.shape)} must match response_ids "
                             f"{tuple(self.response_ids.shape)} ([R])")
        if self.loss_mask is not None and self.loss_mask.shape != self.response_ids.shape:
            raise ValueError(f"loss_mask {tuple(self.loss_mask.shape)} must match response_ids "
                             f"{tuple(self.response_ids.shape)} ([R])")

    @property
    def length(self) -> int:
        """n = P + R tokens."""
        return len(self.prompt_ids) + len(self.response_ids)


def record(prompt: Sequence[int], response: Sequence[int], advantage: float, rollout_logprobs: Sequence[float],
           routes: Optional[torch.Tensor] = None, version: int = 0,
           loss_mask: Optional[torch.Tensor] = None) -> SequenceRecord:
    """A `SequenceRecord` of plain lists (the advantage and log-probs rounded to float32)."""
    return SequenceRecord(
        prompt_ids=torch.tensor(list(prompt), dtype=torch.long),
        response_ids=torch.tensor(list(response), dtype=torch.long),
        rollout_logprobs=torch.tensor([float(x) for x in rollout_logprobs], dtype=torch.float32),
        advantage=float(torch.tensor(float(advantage), dtype=torch.float32)),
        routes=routes, version=version, loss_mask=loss_mask)


def records_from_lists(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                       advantages: Sequence[float], rollout_logprobs: Sequence[Sequence[float]],
                       routes: Optional[Sequence[Optional[torch.Tensor]]] = None,
                       version: int = 0) -> List[SequenceRecord]:
    """Records of parallel lists (tests, benchmarks, the warm-start's SFT targets)."""
    if not len(prompts) == len(responses) == len(advantages) == len(rollout_logprobs):
        raise ValueError(f"{len(prompts)} prompts, {len(responses)} responses, {len(advantages)} advantages and "
                         f"{len(rollout_logprobs)} log-prob lists must be as many")
    for i, (response, lps) in enumerate(zip(responses, rollout_logprobs)):
        if len(lps) != len(response):
            raise ValueError(f"sequence {i}: {len(lps)} rollout log-probs for {len(response)} response tokens")
    return [record(p, r, a, lp, None if routes is None else routes[i], version)
            for i, (p, r, a, lp) in enumerate(zip(prompts, responses, advantages, rollout_logprobs))]


def make_records(rollout: StepRollout, adv_PG: torch.Tensor, updates_per_step: int,
                 token_age_bound: Optional[int] = None, with_routes: bool = False) -> List[SequenceRecord]:
    """The step's records, complete, flat in the rollout's (p, g) order: sample g of prompt p with
    advantage ``adv_PG[p, g]``.

    Args:
        rollout: the step's samples (`stapo_megatron.batch.step_rollout.StepRollout`).
        adv_PG: the group advantages [P, G].
        updates_per_step: RL optimizer updates per training step: a record's ``version`` counts
            updates, its oldest token's policy version x this.
        token_age_bound: partial rollouts' token-level bound in steps
            (`RolloutSampling.token_age_bound`): tokens sampled by a policy older than step
            ``rollout.step - token_age_bound`` are left out of the loss (``loss_mask``); None: none are.
        with_routes: the step's micro-batches carry the MoE routes (`trainer.routing.RoutingMonitor.step_routes`).
    """
    advantages = adv_PG.reshape(-1).tolist()
    if len(advantages) != len(rollout.samples):
        raise ValueError(f"{len(advantages)} advantages for {len(rollout.samples)} samples")
    out = []
    for s, a in zip(rollout.samples, advantages):
        keep = None if token_age_bound is None else s.keep_mask(rollout.step - token_age_bound)
        out.append(record(s.prompt_ids, s.sample.token_ids, a, s.sample.logprobs, s.routes if with_routes else None,
                          s.oldest(rollout.version) * updates_per_step,
                          None if keep is None else torch.tensor(keep)))
    return out


class TokenFields(NamedTuple):
    """A record's per-token fields over its n positions, aligned with the labels."""

    tokens: torch.Tensor
    """[n] int64 prompt + response."""
    labels: torch.Tensor
    """[n] int64: token t + 1 at position t, 0 at the last."""
    response_mask: torch.Tensor
    """[n] bool: the label is a response token."""
    rollout_logprob: torch.Tensor
    """[n] float32: the sampler's log-prob of the response labels, 0 elsewhere."""
    routes: Optional[torch.Tensor]
    """[n, L, K] int16 (`sequence_routes`) when the micro-batch carries routes, else None."""


def token_fields(rec: SequenceRecord, index: int, with_routes: bool) -> TokenFields:
    """The one per-sequence routine of every layout (``index`` names the record in errors);
    ``with_routes``: the micro-batch carries routes (`carries_routes`), so the record must have them."""
    tokens = torch.cat([rec.prompt_ids, rec.response_ids])
    n, start = len(tokens), len(rec.prompt_ids) - 1
    mask = torch.zeros(n, dtype=torch.bool)
    mask[start:n - 1] = True if rec.loss_mask is None else rec.loss_mask
    logprob = torch.zeros(n, dtype=torch.float32)
    logprob[start:n - 1] = rec.rollout_logprobs
    routes = sequence_routes(rec.routes, index, n) if with_routes else None
    return TokenFields(tokens, torch.cat([tokens[1:], tokens.new_zeros(1)]), mask, logprob, routes)


def carries_routes(records: Sequence[SequenceRecord]) -> bool:
    """Whether a micro-batch of ``records`` carries routes (then every record must have them:
    `sequence_routes` names the first that has none)."""
    return any(r.routes is not None for r in records)


def sequence_routes(routes_TLK: Optional[torch.Tensor], index: int, length: int) -> torch.Tensor:
    """The routes of a sequence of ``length`` tokens laid over its positions: [length, L, K]
    int16, the engine's [length - 1, L, K] then `NO_ROUTE` at the last token.

    Raises:
        ValueError: no routes (the engine returned none for sequence ``index``) or a length
            other than ``length - 1``.
    """
    if routes_TLK is None:
        raise ValueError(f"sequence {index} has no routed experts (Sample.routed_experts is None): the rollout "
                         f"engine did not return routes for it")
    if routes_TLK.dim() != 3 or routes_TLK.shape[0] != length - 1:
        raise ValueError(f"sequence {index}: routed experts {tuple(routes_TLK.shape)} do not cover its "
                         f"{length} - 1 forwarded tokens as [tokens, layers, top_k]")
    # int16 holds any expert index (Qwen3-MoE has 128 experts) at a quarter of int64's bytes
    last = torch.full((1, *routes_TLK.shape[1:]), NO_ROUTE, dtype=torch.int16)
    return torch.cat([routes_TLK.to(torch.int16), last])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def encoded_size(prompt_len: int, response_len: int, route_shape: Optional[Sequence[int]]) -> int:
    """Bytes of `encode` for a record of these sizes (``route_shape`` = (L, K) or None)."""
    n = prompt_len + response_len
    routes = 0 if route_shape is None else (n - 1) * route_shape[0] * route_shape[1] * 2
    return n * 8 + response_len * 4 + 4 + 8 + response_len + routes


def encode(rec: SequenceRecord, with_routes: bool) -> torch.Tensor:
    """The record as uint8 bytes: tokens (int64), log-probs and advantage (float32), version
    (int64), the loss mask (a byte per response token) and, ``with_routes``, the routes (int16);
    the sizes travel apart (`decode`)."""
    keep = rec.loss_mask if rec.loss_mask is not None else torch.ones(len(rec.response_ids), dtype=torch.bool)
    parts = [torch.cat([rec.prompt_ids, rec.response_ids]), rec.rollout_logprobs,
             torch.tensor([rec.advantage], dtype=torch.float32), torch.tensor([rec.version], dtype=torch.long),
             keep.to(torch.uint8)]
    if with_routes:
        parts.append(rec.routes.to(torch.int16))
    return torch.cat([_as_bytes(p) for p in parts])


def decode(data: torch.Tensor, prompt_len: int, response_len: int,
           route_shape: Optional[Sequence[int]]) -> SequenceRecord:
    """The record `encode` wrote into ``data`` (uint8 on the CPU)."""
    n = prompt_len + response_len
    sizes = [n * 8, response_len * 4, 4, 8, response_len]
    if route_shape is not None:
        sizes.append((n - 1) * route_shape[0] * route_shape[1] * 2)
    # clone: a slice of a received buffer need not be aligned for a wider dtype's view
    tokens, logprobs, advantage, version, keep, *routes = (part.clone() for part in data.split(sizes))
    tokens = tokens.view(torch.long)
    return SequenceRecord(
        prompt_ids=tokens[:prompt_len], response_ids=tokens[prompt_len:],
        rollout_logprobs=logprobs.view(torch.float32), advantage=float(advantage.view(torch.float32)),
        routes=routes[0].view(torch.int16).view(n - 1, *route_shape) if routes else None,
        version=int(version.view(torch.long)), loss_mask=None if bool(keep.all()) else keep.bool())
