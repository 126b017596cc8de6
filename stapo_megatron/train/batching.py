"""From rollouts to Megatron micro-batches: group advantages, packing, label alignment.

Group advantage (docs/design.md): A_i = (R_i - mean_j R_j) / (std_j R_j + eps) over the G responses of
one prompt; a group with all-equal rewards has A = 0 for every response (it contributes no
gradient; the trainer logs how many there are).

A sequence is prompt + response, right-padded to a common length S (causal attention makes the
padding invisible to the real tokens). Everything a loss needs is aligned with the labels: the
label at position t is token t + 1, so position t carries log p(token_{t+1}); it is a response
token when prompt_len - 1 <= t < prompt_len + response_len - 1.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch


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


def pack_sequences(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    advantages: Sequence[float],
    rollout_logprobs: Sequence[Sequence[float]],
    pad_id: int,
    seq_length: int,
    device: Optional[torch.device] = None,
) -> Dict[str, torch.Tensor]:
    """Right-padded [N, S] tensors for N (prompt, response) pairs.

    Returns tokens, position_ids, labels, response_mask, advantages (per token) and
    rollout_logprob (the sampler's log-probs, for the train/rollout mismatch metric), on
    ``device`` (the model's; default CPU). They are assembled on the CPU, row by row, and moved
    in one copy per field.
    """
    n = len(prompts)
    tokens = torch.full((n, seq_length), pad_id, dtype=torch.long)
    labels = torch.zeros((n, seq_length), dtype=torch.long)
    response_mask = torch.zeros((n, seq_length), dtype=torch.bool)
    rollout_lp = torch.zeros((n, seq_length), dtype=torch.float32)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        length = len(prompt) + len(response)
        if length > seq_length:
            raise ValueError(f"sequence {i} has {length} tokens > seq_length {seq_length}")
        if len(rollout_logprobs[i]) != len(response):
            raise ValueError(
                f"sequence {i}: {len(rollout_logprobs[i])} rollout log-probs for {len(response)} response tokens"
            )
        seq = torch.tensor(list(prompt) + list(response), dtype=torch.long)
        tokens[i, :length] = seq
        labels[i, : length - 1] = seq[1:]
        start = len(prompt) - 1
        response_mask[i, start : length - 1] = True
        rollout_lp[i, start : length - 1] = torch.tensor(rollout_logprobs[i], dtype=torch.float32)
    adv = torch.tensor(advantages, dtype=torch.float32)[:, None].expand(n, seq_length).contiguous()
    batch = dict(
        tokens=tokens,
        position_ids=torch.arange(seq_length).expand(n, seq_length).contiguous(),
        labels=labels,
        response_mask=response_mask,
        advantages=adv,
        rollout_logprob=rollout_lp,
    )
    return batch if device is None else {k: v.to(device) for k, v in batch.items()}


def split_microbatches(batch: Dict[str, torch.Tensor], micro_batch_size: int, seed: int) -> List[Dict[str, torch.Tensor]]:
    """Cut [N, S] tensors into micro-batches of ``micro_batch_size`` rows (N must divide).

    Each micro-batch also gets ``seed`` (a CPU int tensor: host-side metadata read with int(),
    never part of the computation)."""
    n = batch["tokens"].shape[0]
    if n % micro_batch_size:
        raise ValueError(f"{n} sequences do not split into micro-batches of {micro_batch_size}")
    return [
        dict({k: v[s : s + micro_batch_size] for k, v in batch.items()}, seed=torch.tensor(seed + s))
        for s in range(0, n, micro_batch_size)
    ]
