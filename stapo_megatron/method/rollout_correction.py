"""Rollout/training mismatch on plain tensors: per-token ratios, the corrections, their sums.

The sampler (vLLM, the transformers engine) returns log pi_rollout of every sampled token
(``MicroBatch.rollout_logprob``); the trainer's no-grad pass gives log pi_old of the same tokens
(``MicroBatch.old_logprob``). They differ by kernels and precision, and by a whole optimizer
step when a weight sync is missed. Per response token (docs/design.md, "Rollout/training
mismatch"; verl's ``rollout_corr_helper``, decoupled mode):

    delta_t = log pi_old(y_t) - log pi_rollout(y_t),      rho_t = exp(delta_t) = pi_old / pi_rollout
    k3_t    = rho_t - 1 - delta_t                            (k3 estimate of KL(pi_rollout || pi_old),
                                                             the tokens being samples of pi_rollout)
    g_i     = exp( mean_{t in response_i} delta_t )          (sequence i's geometric-mean ratio)

Corrections (`RolloutCorrectionConfig.mode`), entering the loss of ``method.objective.policy_loss``:

    tis       w_t = min(rho_t, C)           multiplies the clipped surrogate of token t (not KL);
                                            the normaliser still counts tokens, not weights
    icepop    token t leaves the loss AND its normaliser when rho_t is outside [lower, upper]
    seq_mask  every token of sequence i leaves loss and normaliser when g_i is outside
              [seq_lower, seq_upper]

Mismatch-flagged tokens (metrics and the S2T overlap, whatever the mode): response tokens with
rho_t outside [token_lower, token_upper]. One row of a [B, S] tensor is one sequence, unless
``sequence_ids`` split a packed row (as for GRPO's sequence mean in ``method.objective``); under
context parallelism a ``sequence_sum`` adds each sequence's partial sums over the CP ranks.

Legend: [B, S] = micro-batch x sequence, aligned with the labels; ``_B`` per row.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import torch

from stapo_megatron.method.objective import SequenceSum

CORRECTION_MODES = ("none", "tis", "icepop", "seq_mask")
"""`RolloutCorrectionConfig.mode` values."""

S2T_PROBABILITY_SOURCES = ("trainer", "rollout")
"""Which probability S2T's candidate test p < tau_p reads (`LossConfig.s2t_probability`)."""

SAFETY_LOG_BOUND = 20.0
"""|delta| is clamped to 20 before exp (verl's SAFETY_BOUND): a token the trainer finds e^30
times likelier than the sampler did gives a finite weight (then capped at C)."""

RATIO_QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
"""Quantiles of rho over the step's response tokens logged as ``mismatch_ratio_q<100 q>``."""


@dataclasses.dataclass
class RolloutCorrectionConfig:
    """Rollout/training mismatch: the bounds that flag tokens and the correction (default: none)."""

    mode: str = "none"
    """"none" (metrics only: the paper's setting), "tis" (token-level truncated importance
    sampling: the surrogate of token t is weighted by min(pi_old/pi_rollout, tis_cap)),
    "icepop" (tokens whose ratio rho = pi_old/pi_rollout is outside [token_lower, token_upper]
    leave the loss and its normaliser: rho itself is bounded, as verl's docs define IcePop; verl's
    code bounds 1/rho = pi_rollout/pi_old, the same mask only for reciprocal bounds such as
    0.5 / 2.0), "seq_mask" (sequences whose geometric-mean ratio is outside
    [seq_lower, seq_upper] leave the loss and its normaliser)."""
    tis_cap: float = 2.0
    """C of "tis": the importance weight's upper bound (verl's rollout_is_threshold)."""
    token_lower: float = 0.5
    """Lower bound on the token ratio pi_old/pi_rollout: "icepop"'s mask and the flag every
    mode logs (mismatch_token_flagged_fraction, the overlap with S2T)."""
    token_upper: float = 2.0
    """Upper bound on the token ratio (see token_lower)."""
    seq_lower: float = 0.999
    """Lower bound on a sequence's geometric-mean ratio: "seq_mask"'s mask and the sequence
    flag every mode logs (verl's geometric rejection default, 0.999_1.001)."""
    seq_upper: float = 1.001
    """Upper bound on a sequence's geometric-mean ratio (see seq_lower)."""

    def __post_init__(self):
        if self.mode not in CORRECTION_MODES:
            raise ValueError(f"rollout_correction.mode must be one of {CORRECTION_MODES}, got {self.mode!r}")
        if not (self.tis_cap > 0 and math.isfinite(self.tis_cap)):
            raise ValueError(f"rollout_correction.tis_cap must be finite and > 0, got {self.tis_cap}")
        for low, high in (("token_lower", "token_upper"), ("seq_lower", "seq_upper")):
            lo, hi = getattr(self, low), getattr(self, high)
            if not (0 < lo <= 1 <= hi and math.isfinite(hi)):
                raise ValueError(f"rollout_correction needs 0 < {low} <= 1 <= {high} < inf, got {low}={lo}, {high}={hi}")


def log_ratio(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor) -> torch.Tensor:
    """delta = log pi_old - log pi_rollout, in fp32 (or the inputs' wider dtype)."""
    dtype = torch.promote_types(torch.promote_types(old_logprob.dtype, rollout_logprob.dtype), torch.float32)
    return old_logprob.to(dtype) - rollout_logprob.to(dtype)


def segments(response_mask: torch.Tensor, sequence_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, S] int64: the sequence of every token, numbered over the micro-batch. A row is one
    sequence, unless ``sequence_ids`` ([B, S] or [1, S]: a packed row's sequence index per
    token, ``batch.packing.sequence_ids``) splits it."""
    B, S = response_mask.shape
    rows = torch.arange(B, device=response_mask.device)[:, None]
    if sequence_ids is None:
        return rows.expand(B, S)
    ids = sequence_ids.to(response_mask.device).long().expand(B, S)
    return ids + rows * (int(ids.max()) + 1 if ids.numel() else 1)


def sequence_log_ratio(delta_BS: torch.Tensor, response_mask: torch.Tensor,
                       sequence_ids: Optional[torch.Tensor] = None,
                       sequence_sum: Optional[SequenceSum] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(log of each sequence's geometric-mean ratio: the mean of delta over its response tokens,
    0 for a sequence without any; whether it has a response token), both [K] over the
    `segments` of the micro-batch. ``sequence_sum``: the rows hold only this rank's part of each
    sequence (context parallelism); the per-sequence sums of delta and counts are added over the
    ranks holding the rest (``method.objective.SequenceSum``), so the mean is the whole
    sequence's."""
    mask = response_mask.bool()
    seg = segments(mask, sequence_ids).reshape(-1)
    num = int(seg.max()) + 1 if seg.numel() else 0
    total = torch.zeros(num, dtype=delta_BS.dtype, device=delta_BS.device)
    total.index_add_(0, seg, torch.where(mask, delta_BS, 0.0).reshape(-1))
    count = torch.zeros(num, dtype=torch.long, device=delta_BS.device).index_add_(0, seg, mask.reshape(-1).long())
    if sequence_sum is not None:
        total, count = sequence_sum(total), sequence_sum(count)
    return total / count.clamp(min=1), count > 0


def _outside(log_value: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """log_value outside [log lower, log upper] (bounds compared in log space: no overflow)."""
    return (log_value < math.log(lower)) | (log_value > math.log(upper))


def token_flags(config: RolloutCorrectionConfig, delta_BS, response_mask) -> torch.Tensor:
    """[B, S] bool: response tokens whose ratio is outside [token_lower, token_upper]."""
    return response_mask.bool() & _outside(delta_BS, config.token_lower, config.token_upper)


def sequence_flags(config: RolloutCorrectionConfig, delta_BS, response_mask,
                   sequence_ids: Optional[torch.Tensor] = None,
                   sequence_sum: Optional[SequenceSum] = None) -> torch.Tensor:
    """[K] bool over the `segments`: sequences with a response token whose geometric-mean ratio
    is outside [seq_lower, seq_upper] (``sequence_sum``: see `sequence_log_ratio`)."""
    log_ratio_K, has_response = sequence_log_ratio(delta_BS, response_mask, sequence_ids, sequence_sum)
    return has_response & _outside(log_ratio_K, config.seq_lower, config.seq_upper)


def correction(
    config: RolloutCorrectionConfig,
    old_logprob: torch.Tensor,
    rollout_logprob: Optional[torch.Tensor],
    response_mask: torch.Tensor,
    sequence_ids: Optional[torch.Tensor] = None,
    sequence_sum: Optional[SequenceSum] = None,
) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """The configured correction of one micro-batch: (importance weight [B, S] or None, rejected
    [B, S] bool). Both are constants (no gradient: pi_old and pi_rollout are data).
    ``sequence_ids``: a packed row's sequences (see `segments`), for "seq_mask";
    ``sequence_sum``: its sequences are split over context-parallel ranks (see
    `sequence_log_ratio`). Every rank of that group must call it (a collective for "seq_mask").

    The weight is min(rho, tis_cap) on response tokens (1 elsewhere); rejected tokens leave the
    loss and its normaliser. Raises ValueError when a correction is asked for without the
    sampler's log-probs.
    """
    mask = response_mask.bool()
    if config.mode == "none":
        return None, torch.zeros_like(mask)
    if rollout_logprob is None:
        raise ValueError(f"rollout_correction.mode={config.mode!r} needs the micro-batch's rollout_logprob "
                         f"(the sampler's log-probs, pack_sequences' rollout_logprobs)")
    delta = log_ratio(old_logprob, rollout_logprob).clamp(-SAFETY_LOG_BOUND, SAFETY_LOG_BOUND)
    if config.mode == "tis":
        weight = torch.where(mask, delta.exp().clamp(max=config.tis_cap), 1.0)
        return weight.detach(), torch.zeros_like(mask)
    if config.mode == "icepop":
        return None, token_flags(config, delta, mask)
    flagged_K = sequence_flags(config, delta, mask, sequence_ids, sequence_sum)
    return None, mask & flagged_K[segments(mask, sequence_ids)]


MISMATCH_SUMS = (
    "num_response", "num_sequences", "abs_delta_sum", "k3_sum", "num_token_flagged", "num_seq_flagged",
)
"""Per-micro-batch sums of `mismatch_sums` (added over micro-batches and DP ranks)."""


@torch.no_grad()
def mismatch_sums(config: RolloutCorrectionConfig, old_logprob, rollout_logprob, response_mask,
                  sequence_ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One micro-batch's mismatch statistics: (sums in `MISMATCH_SUMS` order as fp64, max
    |delta| as a 0-dim fp64 tensor (0 without response tokens), rho of every response token [N]
    for the quantiles). ``sequence_ids``: a packed row's sequences (see `segments`)."""
    mask = response_mask.bool()
    delta = log_ratio(old_logprob, rollout_logprob).double()
    delta_N = delta[mask]
    k3_N = torch.expm1(delta_N) - delta_N  # expm1: exact for the tiny ratios of a synced engine
    _, has_response = sequence_log_ratio(delta, mask, sequence_ids)
    sums = torch.stack([
        mask.sum().double(), has_response.sum().double(), delta_N.abs().sum(), k3_N.sum(),
        token_flags(config, delta, mask).sum().double(),
        sequence_flags(config, delta, mask, sequence_ids).sum().double(),
    ])
    max_abs = delta_N.abs().max() if delta_N.numel() else torch.zeros((), dtype=torch.float64, device=delta.device)
    return sums, max_abs, delta_N.exp()


def selection_logprob(source: str, logprob: torch.Tensor, rollout_logprob: Optional[torch.Tensor]) -> torch.Tensor:
    """The log-probs S2T's candidate test reads: ``logprob`` (the trainer's, "trainer") or the
    sampler's ("rollout"; 0 off the response, so never a candidate there)."""
    if source == "trainer":
        return logprob
    if rollout_logprob is None:
        raise ValueError("s2t_probability='rollout' needs the micro-batch's rollout_logprob")
    return rollout_logprob.to(device=logprob.device, dtype=logprob.dtype)
