"""The paper's gradient claim measured every step: each token's logit-gradient norm, and how much
of the step's gradient the S2T candidates and the silenced tokens carry.

arXiv 2602.15620 argues that a token's policy-gradient norm grows as its probability p and its
local entropy H fall, so a few positive-advantage, low-p, low-H tokens carry abnormally large
updates. The quantity, per response token t, is the squared norm of the gradient of that token's
loss term l_t with respect to its logits x_t (all V entries, every TP shard):

    d l_t / d x_t = c_t (onehot(y_t) - p_t) / T,     c_t = d l_t / d log p(y_t)
    g_t := || d l_t / d x_t ||^2 = c_t^2 (1 - 2 p(y_t) + sum_v p_v^2) / T^2

with p_t = softmax(x_t / T) at the loss temperature T and sum_v p_v^2 the collision probability
from the fused op (``logprob_entropy.vocab_parallel_logprob_entropy(with_collision=True)``). For the clipped
surrogate l_t = w_t max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A) (+ beta k3(ref, log p)),
r = exp(log p - log p_old), w_t the rollout correction's constant IS weight:

    c_t = -w_t r A   where the unclipped branch is active (r inside the clip range, or the clip
                     would raise the loss), 0 where the clip is active (the clipped value does not
                     depend on log p) and, with dual clip, 0 where A < 0 and the loss is capped
                     at -c A;   plus  -beta expm1(log pi_ref - log p) for the k3 KL term.

The norm is defined per loss term, BEFORE the step's normaliser (the mini-batch's kept-token count,
the same factor for every token, so shares do not depend on it) and before silencing: a silenced
token's g_t is the gradient it would have had. For GRPO's sequence mean the per-sequence weight
1/|o_i| is not in g_t (the term is the token's surrogate). Because each token's term depends only
on its own logit row, the loss's gradient w.r.t. all logits is the concatenation of these rows,
so sum_t g_t over the trained tokens is exactly the squared logit-gradient norm of the step's loss
without silencing, and a share is a ratio of such sums.

Per micro-batch the loss function reports `grad_norm_sums` (one fp32 vector): the sums of g_t over
trained tokens, candidates and silenced tokens; histograms of log10 sqrt(g_t) of the silenced and
of the kept tokens; and a (log10 p) x H grid of sum g_t and counts (the paper's figure, drawn by
``stapo-plot --grad-norm``). They ride in the metrics all-reduce over DP x CP that
``loss_metrics.reduce_metrics`` makes anyway, so measuring costs no collective. The medians are
read from the histograms: a documented approximation, exact to within one bin (0.05 decade, i.e.
a factor 1.122, in the norm; interpolated geometrically inside the bin), so no per-token gather
over DP is needed.

Legend: [B, S] = micro-batch x sequence, aligned with the labels.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

HIST_LOG10_MIN, HIST_LOG10_MAX, HIST_BINS = -10.0, 2.0, 240
"""Histogram of log10 ||grad||: 0.05-decade bins; a norm below 1e-10 (clip-zeroed: exactly 0)
goes to the first bin and reads as 0, one above 100 to the last."""

GRID_LOG10_P = (-5.0, 0.0, 10)
"""The figure's probability axis: 10 bins of 0.5 decade over log10 p in [-5, 0]; lower p in the first."""
GRID_ENTROPY = (0.0, 5.0, 10)
"""The figure's entropy axis: 10 bins of 0.5 nat over H in [0, 5]; higher H in the last."""

SCALARS = ("grad_sq_trained", "grad_sq_candidates", "grad_sq_silenced")
GRID_CELLS = GRID_LOG10_P[2] * GRID_ENTROPY[2]
SUMS_SIZE = len(SCALARS) + 2 * HIST_BINS + 2 * GRID_CELLS
"""Length of the `grad_norm_sums` vector: scalars, silenced and kept histograms, grid sums, grid counts."""


def logprob_coefficient(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: Optional[float] = None,
    is_weight: Optional[torch.Tensor] = None,
    ref_logprob: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """c_t = d l_t / d log p(y_t) of ``method.objective.token_objective``'s term (module docstring)."""
    logprob, old_logprob, advantages = logprob.double(), old_logprob.double(), advantages.double()
    ratio = torch.exp(logprob - old_logprob)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high) * advantages
    coef = torch.where(clipped > unclipped, 0.0, unclipped)  # the clip holds l_t constant in log p
    if clip_ratio_c is not None:  # dual clip: min(l, -c A) for A < 0 is constant where it caps
        capped = (advantages < 0) & (torch.maximum(unclipped, clipped) > -clip_ratio_c * advantages)
        coef = torch.where(capped, 0.0, coef)
    if is_weight is not None:
        coef = coef * is_weight.double()
    if kl_coef:
        coef = coef - kl_coef * torch.expm1(ref_logprob.double() - logprob)
    return coef


def logit_grad_sq_norm(coef: torch.Tensor, logprob: torch.Tensor, collision: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
    """g_t = c_t^2 (1 - 2 p(y_t) + sum_v p_v^2) / T^2 (fp32). The bracket is (1 - p)^2 plus the
    other entries' squares, >= 0; clamped there against fp32 rounding when p -> 1."""
    p = logprob.double().exp()
    spread = (1.0 - 2.0 * p + collision.double()).clamp(min=0.0)
    return (coef.double().square() * spread / (temperature * temperature)).float()


def _bins(values: torch.Tensor, axis) -> torch.Tensor:
    """Bin index of each value on ``axis`` = (low, high, num); out-of-range values go to the end
    bins (NaN, e.g. a padding position's statistics, to the first: they are weighted 0 anyway)."""
    low, high, num = axis
    scaled = ((values.double() - low) / ((high - low) / num)).nan_to_num(nan=0.0)
    return scaled.floor().clamp(0, num - 1).long().reshape(-1)


def _weighted_hist(index: torch.Tensor, weight: torch.Tensor, size: int) -> torch.Tensor:
    """sum of ``weight`` per ``index`` (masks as 0/1 weights: no boolean indexing, no host sync)."""
    return torch.zeros(size, dtype=torch.float32, device=weight.device).index_add_(0, index, weight.reshape(-1))


@torch.no_grad()
def grad_norm_sums(grad_sq: torch.Tensor, logprob: torch.Tensor, entropy: torch.Tensor, trained: torch.Tensor,
                   candidates: torch.Tensor, silenced: torch.Tensor) -> torch.Tensor:
    """One micro-batch's [SUMS_SIZE] vector (module docstring): ``grad_sq`` g_t, ``trained`` the
    tokens in the loss before silencing (response, not rejected by the rollout correction)."""
    g = torch.where(trained, grad_sq.float(), 0.0)
    silenced_t, kept_t = trained & silenced, trained & ~silenced
    log_norm = 0.5 * torch.log10(grad_sq.double().clamp(min=1e-300))  # 0 -> the first bin
    norm_bin = _bins(log_norm, (HIST_LOG10_MIN, HIST_LOG10_MAX, HIST_BINS))
    cell = _bins(logprob.detach() / math.log(10.0), GRID_LOG10_P) * GRID_ENTROPY[2] + _bins(entropy, GRID_ENTROPY)
    return torch.cat([
        torch.stack([g.sum(), torch.where(candidates, g, 0.0).sum(), torch.where(silenced_t, g, 0.0).sum()]),
        _weighted_hist(norm_bin, silenced_t.float(), HIST_BINS), _weighted_hist(norm_bin, kept_t.float(), HIST_BINS),
        _weighted_hist(cell, g, GRID_CELLS), _weighted_hist(cell, trained.float(), GRID_CELLS),
    ])


def hist_median(hist: List[float]) -> float:
    """The median norm of a `HIST_BINS` histogram (geometric interpolation inside its bin); NaN
    when empty, 0 when it falls in the first bin (norms < 1e-10: clip-zeroed gradients)."""
    total = sum(hist)
    if total <= 0:
        return math.nan
    width, half, below = (HIST_LOG10_MAX - HIST_LOG10_MIN) / HIST_BINS, total / 2.0, 0.0
    for i, count in enumerate(hist):
        if count and below + count >= half:
            if i == 0:
                return 0.0
            return 10.0 ** (HIST_LOG10_MIN + width * (i + (half - below) / count))
        below += count
    return math.nan  # unreachable: the counts reach the total


def unpack(sums: List[float]) -> Dict[str, object]:
    """A reduced `grad_norm_sums` vector as named parts (scalars, histograms and grid lists)."""
    out: Dict[str, object] = dict(zip(SCALARS, sums[: len(SCALARS)]))
    at = len(SCALARS)
    for name, size in (("hist_silenced", HIST_BINS), ("hist_kept", HIST_BINS),
                       ("grid_grad_sq_sum", GRID_CELLS), ("grid_count", GRID_CELLS)):
        out[name] = list(sums[at: at + size])
        at += size
    return out


def step_metrics(updates: List[Dict]) -> Dict[str, object]:
    """The step row's gradient-norm metrics from its mini-batch updates' reduced metrics (each
    with a ``grad_norm_sums`` list, `loss_metrics.reduce_metrics`): shares of the step's squared
    logit-gradient norm (before silencing) carried by the S2T candidates and by the silenced
    tokens, the silenced and kept tokens' median norms and their ratio, and the figure's grid."""
    total = [sum(vals) for vals in zip(*(u["grad_norm_sums"] for u in updates))] if updates else []
    if not total:
        return {}
    parts = unpack(total)
    trained = parts["grad_sq_trained"]
    share = lambda key: parts[key] / trained if trained > 0 else math.nan  # noqa: E731
    silenced_median, kept_median = hist_median(parts["hist_silenced"]), hist_median(parts["hist_kept"])
    return dict(
        grad_share_candidates=share("grad_sq_candidates"),
        grad_share_silenced=share("grad_sq_silenced"),
        grad_norm_median_silenced=silenced_median,
        grad_norm_median_kept=kept_median,
        grad_norm_median_ratio=silenced_median / kept_median if kept_median > 0 else math.nan,
        grad_norm_grid_sq_sum=parts["grid_grad_sq_sum"],
        grad_norm_grid_count=parts["grid_count"],
    )
