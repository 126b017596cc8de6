"""Token masks: S2T (STAPO), the 20-Entropy and random-control baselines, and none.

S2T, "Silencing Spurious Tokens" (STAPO, arXiv 2602.15620, Sec. 4): a response token is silenced
when its sequence is rewarded above the group mean, the policy found it unlikely, and the policy
was confident about the whole next-token distribution:

    silenced = (A > 0) & (p < tau_p) & (H < tau_H) & response_mask            (strict <)
    tau_H    = q-quantile of { H : A > 0, p < tau_p, response_mask } over the mini-batch

tau_p = 0.002 and q = 0.75 in the paper. The quantile uses linear interpolation (the semantics of
``torch.quantile``) over the candidates of ALL ranks of ``dp_group``: the paper's mini-batch is
split over data-parallel ranks. Baselines, same calling style:

- 20-Entropy ("Beyond the 80/20 rule"): keep only the top ``rho`` = 20% highest-entropy response
  tokens of the mini-batch (silence response tokens with H below the (1 - rho)-quantile);
- random controls: silence a random set of ``num_silenced`` tokens (seeded) drawn from a pool,
  S2T's candidates (A > 0, p < tau_p) or all response tokens, so that the count can match what
  S2T silences;
- none (GRPO, JustRL): nothing silenced.

Micro-batches and mini-batches: Megatron runs micro-batches one by one, but tau_H belongs to the
whole mini-batch. Thresholds are therefore computed by ``*_threshold`` functions over the whole
mini-batch's statistics and passed to the ``*_mask`` functions per micro-batch (see
``stapo_megatron.mcore.loss`` for the two ways to get those statistics).

Legend: tensors are [B, T] (or any common shape); ``_T`` = flattened tokens.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist

def quantile_linear(values: torch.Tensor, q: float) -> torch.Tensor:
    """q-quantile with linear interpolation, as ``torch.quantile`` (no 16M-element limit).

    Returns a 0-dim fp32 tensor; NaN for an empty input.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q must be in [0, 1], got {q}")
    n = values.numel()
    if n == 0:
        return torch.tensor(float("nan"), device=values.device)
    sorted_T = values.reshape(-1).double().sort().values
    pos = q * (n - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return (sorted_T[lo] + (sorted_T[hi] - sorted_T[lo]) * frac).float()


def gather_values(values: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Concatenate a variable-length 1-D tensor from all ranks of ``group`` (rank order)."""
    values = values.reshape(-1).float()
    if group is None or dist.get_world_size(group) == 1:
        return values
    world = dist.get_world_size(group)
    count = torch.tensor([values.numel()], dtype=torch.long, device=values.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c) for c in counts]
    padded = torch.zeros(max(sizes), device=values.device)
    padded[: values.numel()] = values
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])


def s2t_candidates(
    logprob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, tau_p: float = 0.002
) -> torch.Tensor:
    """(A > 0) & (p < tau_p) & response_mask: the tokens whose entropies define tau_H."""
    return (advantages > 0) & (logprob.exp() < tau_p) & response_mask.bool()


def s2t_threshold(
    entropy: torch.Tensor,
    candidates: torch.Tensor,
    q: float = 0.75,
    dp_group: Optional[dist.ProcessGroup] = None,
) -> Tuple[torch.Tensor, int]:
    """tau_H = q-quantile of candidate entropies over all DP ranks; NaN if there are none.

    Returns (tau_h as a 0-dim fp32 tensor, global number of candidates).
    """
    pooled = gather_values(entropy.detach()[candidates], dp_group)
    return quantile_linear(pooled, q), pooled.numel()


def s2t_mask(
    logprob: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    tau_p: float = 0.002,
    q: float = 0.75,
    dp_group: Optional[dist.ProcessGroup] = None,
    tau_h: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The S2T mask (True = silenced), same shape as ``logprob``.

    Args:
        logprob, entropy: current-policy log p of the sampled token and H of the next-token
            distribution (see ``stapo_megatron.ops.logprob_entropy``).
        advantages: per-token advantage (the sequence advantage broadcast over its tokens).
        response_mask: True on response tokens that count in the loss.
        tau_p: probability threshold (paper: 0.002).
        q: entropy quantile (paper: 0.75).
        dp_group: ranks whose candidates pool into the quantile (the mini-batch).
        tau_h: a precomputed mini-batch threshold; if given, ``q``/``dp_group`` are unused and
            no collective runs (the per-micro-batch use inside Megatron's schedule).

    Raises:
        ValueError: if ``entropy``, ``advantages`` or ``response_mask`` differ in shape from
            ``logprob`` (a per-sequence [B] advantage would broadcast along the token axis when
            B == S and silently select other tokens).
    """
    for name, t in (("entropy", entropy), ("advantages", advantages), ("response_mask", response_mask)):
        if t.shape != logprob.shape:
            hint = (" (advantages are per token: expand a per-sequence [B] advantage with "
                    "adv[:, None].expand_as(logprob))") if name == "advantages" else ""
            raise ValueError(f"s2t_mask: {name} has shape {list(t.shape)} but logprob has "
                             f"{list(logprob.shape)}{hint}")
    candidates = s2t_candidates(logprob, advantages, response_mask, tau_p)
    if tau_h is None:
        tau_h, _ = s2t_threshold(entropy, candidates, q, dp_group)
    # No candidates -> tau_h is NaN and every comparison is False: nothing silenced.
    return candidates & (entropy.detach() < tau_h)


def entropy20_threshold(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    rho: float = 0.2,
    dp_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """The (1 - rho)-quantile of response-token entropies over all DP ranks (NaN if none)."""
    pooled = gather_values(entropy.detach()[response_mask.bool()], dp_group)
    return quantile_linear(pooled, 1.0 - rho)


def entropy20_mask(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    rho: float = 0.2,
    dp_group: Optional[dist.ProcessGroup] = None,
    threshold: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Silence response tokens outside the top ``rho`` entropy fraction (True = silenced)."""
    if threshold is None:
        threshold = entropy20_threshold(entropy, response_mask, rho, dp_group)
    return response_mask.bool() & (entropy.detach() < threshold)


def random_mask(pool: torch.Tensor, num_silenced: int, seed: int) -> torch.Tensor:
    """Silence ``num_silenced`` tokens of ``pool`` (bool, True = may be drawn) chosen uniformly
    at random without replacement (True = silenced); only pool tokens are ever drawn."""
    positions_T = pool.reshape(-1).bool().nonzero().squeeze(-1)
    if not 0 <= num_silenced <= positions_T.numel():
        raise ValueError(
            f"num_silenced must be in [0, {positions_T.numel()}] (tokens in the pool), got {num_silenced}"
        )
    gen = torch.Generator().manual_seed(seed)
    chosen_T = positions_T[torch.randperm(positions_T.numel(), generator=gen)[:num_silenced].to(positions_T.device)]
    silenced_T = torch.zeros(pool.numel(), dtype=torch.bool, device=pool.device)
    silenced_T[chosen_T] = True
    return silenced_T.view(pool.shape)


def no_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """GRPO, JustRL: nothing silenced."""
    return torch.zeros_like(response_mask, dtype=torch.bool)
