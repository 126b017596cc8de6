"""From rollouts to Megatron micro-batches: group advantages, packing, label alignment.

Group advantage (docs/design.md): A_i = (R_i - mean_j R_j) / (std_j R_j + eps) over the G responses of
one prompt; a group with all-equal rewards has A = 0 for every response (it contributes no
gradient; the trainer logs how many there are).

A sequence is prompt + response, right-padded to a common length S (causal attention makes the
padding invisible to the real tokens). Everything a loss needs is aligned with the labels: the
label at position t is token t + 1, so position t carries log p(token_{t+1}); it is a response
token when prompt_len - 1 <= t < prompt_len + response_len - 1.

`MicroBatch` is what passes between the phases of a step: packed here, its pi_old log-probs
filled by ``schedule.old_policy_pass``, its reference log-probs by ``reference``, read by the
loss (``loss.loss_func``) and the SFT step. A micro-batch is either padded (B rows of S tokens,
``cu_seqlens`` None) or packed (THD: one row of T tokens holding several whole sequences one
after another, ``cu_seqlens`` their boundaries; built by ``stapo_megatron.batch.packing``).
Every per-token field has the same layout in both, so the loss, masks and metrics, which are
elementwise or sums, read either.

Mixture-of-experts policies: ``MicroBatch.routes`` [B, S, L, K] holds at position t the experts
the rollout engine routed input token t to in each of the L MoE layers
(``Sample.routed_experts``, which covers every position but the last of a sequence), and
`NO_ROUTE` where the engine forwarded nothing: the last token of each sequence and padding
(router replay fills those with valid experts: `stapo_megatron.mcore.router_replay`).

Legend: [B, S] = micro-batch rows x sequence, aligned with the labels ([1, T] when packed);
L = MoE layers, K = experts per token.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch

from stapo_megatron.batch.records import NO_ROUTE, SequenceRecord, carries_routes, token_fields

__all__ = ["NO_ROUTE", "MicroBatch", "group_advantages", "pack_sequences", "split_microbatches"]


@dataclasses.dataclass
class MicroBatch:
    """Rows of packed sequences, every tensor [B, S] and aligned with the labels."""

    tokens: torch.Tensor
    """Input token ids (prompt + response, right-padded)."""
    position_ids: torch.Tensor
    """Positions 0 .. S-1 of every row."""
    labels: torch.Tensor
    """The next token at every position (0 past the end)."""
    response_mask: torch.Tensor
    """True where the label is a response token (the loss's tokens)."""
    advantages: Optional[torch.Tensor] = None
    """The row's group advantage at every position (float32); None for SFT."""
    rollout_logprob: Optional[torch.Tensor] = None
    """The sampler's log-probs of the response labels (0 elsewhere; the train/rollout mismatch)."""
    old_logprob: Optional[torch.Tensor] = None
    """log pi_old of the labels (the ratio's denominator): filled by ``schedule.old_policy_pass``."""
    old_entropy: Optional[torch.Tensor] = None
    """pi_old's entropy at every position (the "old" tau_H source), filled with ``old_logprob``."""
    ref_logprob: Optional[torch.Tensor] = None
    """The frozen reference's log-probs (GRPO's KL), filled by ``reference.add_reference_logprobs``."""
    seed: Optional[int] = None
    """Host-side seed of the random-control masks (never part of the computation)."""
    cu_seqlens: Optional[torch.Tensor] = None
    """Packed (THD) micro-batches only: [n + 1] int32 offsets of the n sequences in the one
    row (0, end of the first, ..., T; an alignment tail is a sequence of its own); None: padded."""
    max_seqlen: Optional[int] = None
    """Packed only: the longest sequence of ``cu_seqlens`` (Megatron's ``max_seqlen_q``)."""
    routes: Optional[torch.Tensor] = None
    """MoE only: the rollout's experts [B, S, L, K] (int16) of the input token at each
    position, `NO_ROUTE` where it has none (module docstring); None: not carried."""
    cp_size: int = 1
    """Packed only: the context-parallel ranks the row is split over. With ``cp_size`` > 1 the
    tensors hold this rank's 1 / cp_size of every sequence (``batch.context_parallel``) while
    ``cu_seqlens`` and ``max_seqlen`` stay those of the whole row (Megatron's convention)."""

    def __post_init__(self):
        if self.cu_seqlens is None:
            return
        if self.tokens.dim() != 2 or self.tokens.shape[0] != 1:
            raise ValueError(f"a packed micro-batch is one row [1, T], got tokens {list(self.tokens.shape)}")
        cu = self.cu_seqlens.tolist()
        total = self.tokens.shape[1] * self.cp_size
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or any(b <= a for a, b in zip(cu, cu[1:])):
            split = f" (tokens x cp_size {self.cp_size})" if self.cp_size > 1 else ""
            raise ValueError(f"cu_seqlens must rise strictly from 0 to the packed length {total}{split}, got {cu}")
        longest = max(b - a for a, b in zip(cu, cu[1:]))
        if self.max_seqlen != longest:
            raise ValueError(f"max_seqlen {self.max_seqlen} != the longest sequence of cu_seqlens {longest}")

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def _tensor_fields(self) -> List[str]:
        return [f.name for f in dataclasses.fields(self) if torch.is_tensor(getattr(self, f.name))]

    def rows(self, start: int, stop: int) -> "MicroBatch":
        """Rows ``start:stop`` of every tensor (views), the same seed."""
        if self.is_packed:
            raise ValueError("a packed micro-batch has one row; split sequences with batch.packing instead")
        return dataclasses.replace(self, **{k: getattr(self, k)[start:stop] for k in self._tensor_fields()})

    def to(self, device, non_blocking: bool = False) -> "MicroBatch":
        """Every tensor on ``device`` (the same object when they already are there)."""
        if all(getattr(self, k).device == torch.device(device) for k in self._tensor_fields()):
            return self
        return dataclasses.replace(self, **{k: getattr(self, k).to(device, non_blocking=non_blocking)
                                            for k in self._tensor_fields()})


def group_advantages(rewards_PG: torch.Tensor, eps: float = 1e-6) -> Tuple[torch.Tensor, int]:
    """Group-normalised advantages [P, G] and the number of all-equal-reward groups.

    std is the unbiased sample std (GRPO's ``torch.std``); all-equal groups are exactly 0.
    """
    if rewards_PG.dim() != 2 or rewards_PG.shape[1] < 2:
        raise ValueError(f"rewards must be [num_prompts, group_size >= 2], got {tuple(rewards_PG.shape)}")
    mean_P1 = rewards_PG.mean(dim=-1, keepdim=True)
    std_P1 = rewards_PG.std(dim=-1, keepdim=True)
    flat_P = (rewards_PG == rewards_PG[:, :1]).all(dim=-1)
    adv_PG = (rewards_PG - mean_P1) / (std_P1 + eps)
    adv_PG[flat_P] = 0.0
    return adv_PG, int(flat_P.sum())


def pack_sequences(records: Sequence[SequenceRecord], pad_id: int, seq_length: int,
                   device: Optional[torch.device] = None) -> MicroBatch:
    """Right-padded [N, S] tensors of N records, as one `MicroBatch` of N rows.

    Each row is the record's `records.token_fields` (tokens, labels, response_mask,
    rollout_logprob, and routes when the records carry them: `NO_ROUTE` on the padding), the
    advantage at every position, positions 0 .. S-1; on ``device`` (the model's; default CPU).
    They are assembled on the CPU, row by row, and moved in one copy per field.
    """
    n = len(records)
    tokens = torch.full((n, seq_length), pad_id, dtype=torch.long)
    labels = torch.zeros((n, seq_length), dtype=torch.long)
    response_mask = torch.zeros((n, seq_length), dtype=torch.bool)
    rollout_lp = torch.zeros((n, seq_length), dtype=torch.float32)
    with_routes = carries_routes(records)
    route_rows: List[torch.Tensor] = []
    for i, rec in enumerate(records):
        if rec.length > seq_length:
            raise ValueError(f"sequence {i} has {rec.length} tokens > seq_length {seq_length}")
        fields = token_fields(rec, i, with_routes)
        tokens[i, :rec.length] = fields.tokens
        labels[i, :rec.length] = fields.labels
        response_mask[i, :rec.length] = fields.response_mask
        rollout_lp[i, :rec.length] = fields.rollout_logprob
        if with_routes:
            route_rows.append(fields.routes)
    adv = torch.tensor([r.advantage for r in records], dtype=torch.float32)[:, None].expand(n, seq_length).contiguous()
    batch = MicroBatch(
        tokens=tokens,
        position_ids=torch.arange(seq_length).expand(n, seq_length).contiguous(),
        labels=labels,
        response_mask=response_mask,
        advantages=adv,
        rollout_logprob=rollout_lp,
        routes=torch.stack([torch.nn.functional.pad(r, (0, 0, 0, 0, 0, seq_length - r.shape[0]), value=NO_ROUTE)
                            for r in route_rows]) if with_routes else None,
    )
    return batch if device is None else batch.to(device)


def split_microbatches(batch: MicroBatch, micro_batch_size: int, seed: int) -> List[MicroBatch]:
    """Cut a batch of N rows into micro-batches of ``micro_batch_size`` rows (N must divide);
    the micro-batch starting at row s gets seed ``seed + s``."""
    n = batch.num_rows
    if n % micro_batch_size:
        raise ValueError(f"{n} sequences do not split into micro-batches of {micro_batch_size}")
    return [dataclasses.replace(batch.rows(s, s + micro_batch_size), seed=seed + s)
            for s in range(0, n, micro_batch_size)]
