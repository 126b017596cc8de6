"""The STAPO policy loss in Megatron-Core's schedule: the mini-batch threshold, ``loss_func`` and
``make_forward_step`` (configured by `LossConfig`, ``stapo_megatron.method.config``).

The loss is split by job: the objective on plain tensors (``method/objective.py``:
`policy_loss`, `token_objective`; the other objectives' token losses, ``loss.objective``, in
``method/objectives.py``), which tokens each method silences (``method/registry.py``),
the micro-batch runner shared with the SFT warm-start (``mcore/schedule.py``), the metrics
(``mcore/loss_metrics.py``), and here the Megatron ``loss_func`` that joins them: `loss_terms`
(log-probs, masks, the rollout correction), the policy loss, and `loss_diagnostics` (its metrics).

STAPO objective (arXiv 2602.15620, Eq. for J_STAPO; the DAPO/JustRL token-level objective with
clip-higher, no KL, no entropy bonus, plus the S2T mask of ``stapo_megatron.method.masks``):

    J = 1 / sum keep * sum_{i,t} keep_{i,t} * min( r A_i , clip(r, 1 - eps_low, 1 + eps_high) A_i )
    r = pi_theta(y_t | .) / pi_old(y_t | .),   keep = response_mask & ~silenced

The denominator counts the kept tokens of the WHOLE mini-batch (all micro-batches, all DP ranks);
for GRPO (``Method.loss_agg == "seq_mean_token_mean"``) it counts the mini-batch's sequences, and
each sequence contributes its own mean token loss (``stapo_megatron.method.objective``). GRPO's KL term
needs ``ref_logprob`` in the batch: the frozen reference's log-probs (``stapo_megatron.mcore.reference``).
The loss function returns (sum of token losses, number of kept tokens, metrics); with
``calculate_per_token_loss=True`` Megatron's own ``finalize_model_grads`` all-reduces the token
count over DP x CP (after broadcasting it from the last pipeline stage) and scales the gradients by
its inverse, which is exactly that renormalisation.

Context parallelism (``batch.cp_size > 1``): every token statistic above is per token or reduced
over DP x CP, except what needs whole sequences, which `loss_func` sums per sequence over its
``cp_group`` (``context_parallel.cp_sum``, counts and constants only, no gradient): GRPO's |o_i|
(each CP rank adds sum over its kept tokens of l_t / |o_i|, the sequence count is counted on CP
rank 0 only, as Megatron sums the integer normaliser over DP x CP) and the ``seq_mask``
correction's per-sequence sum and count of log-ratios.

Where tau_H (the mini-batch quantile of candidate entropies) comes from, ``tau_h_source``:

- "old" (default): the entropies and log-probs of the pi_old pass that computes old log-probs
  anyway. For the first PPO mini-batch of a step pi_old == pi_theta, so this equals the paper's
  definition exactly; for later mini-batches the candidate set and quantile lag by the updates of
  the earlier mini-batches of the same step. Costs nothing extra.
- "exact": a no-grad pre-pass over the mini-batch with the current weights right before its
  forward/backward (``schedule.compute_logprob_entropy``). Exact for every mini-batch; costs one extra
  forward pass (about a third of a training step), so it is not the default.

Legend: [B, S] = micro-batch x sequence; ``_BS`` tensors are aligned with the labels (the token
predicted at each position).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from stapo_megatron.method import masks
from stapo_megatron.method.config import LossConfig
from stapo_megatron.method.objective import PolicyLossConfig, PolicyTokens, policy_loss
from stapo_megatron.method.objectives import check_parallelism, clipped_tokens, get_objective
from stapo_megatron.method.registry import get_method
from stapo_megatron.method import rollout_correction as rc
from stapo_megatron.batch.microbatch import MicroBatch
from stapo_megatron.batch.context_parallel import cp_sum
from stapo_megatron.ops import logit_grad
from stapo_megatron.mcore.loss_metrics import metric_sums
from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy
from stapo_megatron.batch.packing import sequence_ids
from stapo_megatron.mcore.schedule import forward_step_func


def minibatch_threshold(
    config: LossConfig,
    logprob: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    dp_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """The method's mini-batch threshold from this rank's whole mini-batch statistics.

    stapo and random: tau_H (q-quantile of S2T candidate entropies over ``dp_group``);
    entropy20: the (1 - rho)-quantile of response-token entropies; justrl, grpo: NaN (unused); in
    general ``Method.threshold`` (`stapo_megatron.method.registry`). Tensors may be flattened and
    concatenated over micro-batches. Collective over ``dp_group`` (every DP rank must call it).
    """
    method = get_method(config.method)
    if method.threshold is None:
        return torch.tensor(float("nan"))
    return method.threshold(config, logprob, entropy, advantages, response_mask, dp_group)


def _check_cp_group(batch: MicroBatch, cp_group: Optional[dist.ProcessGroup]) -> None:
    """A batch split over CP ranks needs their group, of that size (ValueError otherwise)."""
    if batch.cp_size == 1:
        return
    size = 1 if cp_group is None else dist.get_world_size(cp_group)
    if size != batch.cp_size:
        raise ValueError(f"the micro-batch is split over {batch.cp_size} context-parallel ranks but loss_func's "
                         f"cp_group has {size} (pass the CP group: Groups.cp)")


@dataclasses.dataclass
class LossTerms:
    """One micro-batch's per-token inputs of the policy loss, each [B, S] (module legend), as
    `loss_terms` computes them for the loss and `loss_diagnostics` reads them."""

    logprob: torch.Tensor
    """log pi_theta of the labels (differentiable)."""
    entropy: torch.Tensor
    collision: torch.Tensor
    """sum_v p_v^2 per token (`vocab_parallel_logprob_entropy`'s ``with_collision``)."""
    old_logprob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    candidates: torch.Tensor
    """S2T candidates (``masks.s2t_candidates``)."""
    silenced: torch.Tensor
    """The method's mask."""
    trained_mask: torch.Tensor
    """The response mask less the tokens the rollout correction rejects."""
    rejected: torch.Tensor
    is_weight: Optional[torch.Tensor]
    """The rollout correction's truncated IS weight (None: 1)."""
    seq_ids: Optional[torch.Tensor]
    """A packed row's sequence index per token (None: one sequence per row)."""
    seq_sum: Optional[Callable]
    """Sums a per-sequence tensor over the CP group (None: whole sequences)."""


def loss_terms(config: LossConfig, batch: MicroBatch, threshold: torch.Tensor, tp_group: Optional[dist.ProcessGroup],
               vocab_size: Optional[int], logits: torch.Tensor,
               cp_group: Optional[dist.ProcessGroup] = None) -> LossTerms:
    """The log-probs and entropies of ``logits``, the method's silenced tokens and the rollout
    correction of one micro-batch (`loss_func`'s arguments)."""
    logprob, entropy, collision = vocab_parallel_logprob_entropy(
        logits, batch.labels, tp_group=tp_group, temperature=config.temperature, vocab_size=vocab_size,
        with_collision=True,
    )
    response_mask = batch.response_mask.bool()
    advantages = batch.advantages.float()
    old_logprob = batch.old_logprob.float()
    # S2T's candidate test reads the trainer's p (the paper) or the sampler's (s2t_probability)
    select_logprob = rc.selection_logprob(config.s2t_probability, logprob.detach(), batch.rollout_logprob)
    candidates = masks.s2t_candidates(select_logprob, advantages, response_mask, config.tau_p)
    method = get_method(config.method)
    silenced = method.mask(
        config, select_logprob, entropy, advantages, response_mask, threshold, batch.seed
    )
    # Rollout correction (verl's decoupled mode): rejected tokens leave the response mask, so the
    # loss and its normaliser; the truncated IS weight multiplies the clipped surrogate only.
    # a packed row's sequences (with CP: this rank's two chunks of each, their statistics summed
    # over the CP group so that |o_i| and the geometric-mean ratio are the whole sequence's)
    seq_ids = sequence_ids(batch.cu_seqlens, batch.cp_size)[None] if batch.is_packed else None
    seq_sum = cp_sum(cp_group) if batch.cp_size > 1 else None
    is_weight, rejected = rc.correction(config.rollout_correction, old_logprob, batch.rollout_logprob, response_mask,
                                        seq_ids, seq_sum)
    return LossTerms(logprob, entropy, collision, old_logprob, advantages, response_mask, candidates, silenced,
                     response_mask & ~rejected, rejected, is_weight, seq_ids, seq_sum)


def loss_func(
    config: LossConfig,
    batch: MicroBatch,
    threshold: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup],
    vocab_size: Optional[int],
    logits: torch.Tensor,
    cp_group: Optional[dist.ProcessGroup] = None,
):
    """Megatron ``loss_func`` (last pipeline stage): returns (loss_sum, num_kept, metrics), the
    metrics `loss_diagnostics`'.

    ``batch`` needs ``old_logprob`` (``schedule.old_policy_pass``) and ``advantages``;
    ``ref_logprob`` when ``kl_coef > 0``; ``seed`` for the random masks. ``cp_group``: the
    context-parallel group a split batch (``batch.cp_size > 1``) is spread over (required then);
    GRPO's sequence mean and the ``seq_mask`` correction add their per-sequence statistics over it.
    """
    _check_cp_group(batch, cp_group)
    t = loss_terms(config, batch, threshold, tp_group, vocab_size, logits, cp_group)
    # normaliser: kept tokens ("token_mean") or sequences with a kept token (GRPO's and GSPO's
    # sequence mean), the latter counted on CP rank 0 only: Megatron sums it over DP x CP (an
    # integer, so a 1/CP share per rank would not do), and every CP rank holds part of every sequence
    check_parallelism(config.effective_objective, batch.cp_size)
    objective = get_objective(config.effective_objective)
    policy = PolicyLossConfig(config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c, config.kl_coef,
                              objective.loss_agg, objective.build(config, t.seq_ids, t.seq_sum, batch.seed))
    tokens = PolicyTokens(t.logprob, t.old_logprob, t.advantages, t.trained_mask, t.silenced, batch.ref_logprob,
                          t.is_weight, t.seq_ids)
    loss_sum, normaliser = policy_loss(tokens, policy, t.seq_sum,
                                       count_sequences=t.seq_sum is None or dist.get_rank(cp_group) == 0)
    return loss_sum, normaliser.to(torch.int), loss_diagnostics(config, batch, t, loss_sum, normaliser)


def loss_diagnostics(config: LossConfig, batch: MicroBatch, t: LossTerms, loss_sum: torch.Tensor,
                     normaliser: torch.Tensor) -> Dict[str, torch.Tensor]:
    """What `loss_func` reports besides the loss: the metric sums (``loss_metrics.metric_sums``),
    the logit-gradient norm sums (the paper's gradient claim, ``ops/logit_grad.py``) and the
    silenced tokens' rows (label id, log p, H, A, log p_rollout, flagged, ||d l_t / d logits||)."""
    logprob, old_logprob, advantages, silenced = t.logprob, t.old_logprob, t.advantages, t.silenced
    is_clipped = clipped_tokens(config, logprob, old_logprob, advantages, t.trained_mask & ~silenced, t.seq_ids,
                                t.seq_sum)
    num_kept = (t.trained_mask & ~silenced).sum()
    flagged = (torch.zeros_like(t.response_mask) if batch.rollout_logprob is None else
               rc.token_flags(config.rollout_correction, rc.log_ratio(old_logprob, batch.rollout_logprob),
                              t.response_mask))
    sums = metric_sums(loss_sum, num_kept, logprob, old_logprob, t.entropy, t.response_mask, silenced, t.candidates,
                       is_clipped, normaliser, flagged=flagged, rejected=t.rejected, is_weight=t.is_weight,
                       tis_cap=config.rollout_correction.tis_cap)
    # the paper's gradient claim: each token's logit-gradient norm before silencing (ops/logit_grad.py)
    coef = logit_grad.logprob_coefficient(
        logprob.detach(), old_logprob, advantages, config.clip_ratio_low, config.clip_ratio_high,
        config.clip_ratio_c, t.is_weight, batch.ref_logprob, config.kl_coef)
    grad_sq = logit_grad.logit_grad_sq_norm(coef, logprob.detach(), t.collision, config.temperature)
    grad_sums = logit_grad.grad_norm_sums(grad_sq, logprob, t.entropy, t.trained_mask, t.candidates, silenced)
    # The spurious-token inspector's raw material (log p_rollout is NaN without sampler log-probs).
    rollout_lp = (torch.full_like(logprob, float("nan")) if batch.rollout_logprob is None
                  else batch.rollout_logprob.float())
    silenced_tokens = torch.stack(
        [batch.labels[silenced].float(), logprob.detach()[silenced], t.entropy[silenced], advantages[silenced],
         rollout_lp[silenced], flagged[silenced].float(), grad_sq[silenced].sqrt()],
        dim=-1,
    )
    return {"stapo_sums": sums, "grad_norm_sums": grad_sums, "silenced_tokens": silenced_tokens}


def make_forward_step(
    config: LossConfig,
    threshold: Optional[torch.Tensor] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
    cp_group: Optional[dist.ProcessGroup] = None,
) -> Callable:
    """A ``forward_step_func`` for ``get_forward_backward_func()`` with the STAPO loss.

    Each item of the data iterator is a `MicroBatch` with ``old_logprob`` and ``advantages``
    (and ``ref_logprob`` for a KL term). The model is a Megatron GPTModel (any PP stage);
    only the last stage's output reaches ``loss_func``. The TransformerConfig must have
    ``calculate_per_token_loss=True`` and the caller must set
    ``config.finalize_model_grads_func`` (Megatron's ``finalize_model_grads``) so the gradients
    are divided by the mini-batch's kept-token count.

    Args:
        threshold: the mini-batch threshold from ``minibatch_threshold`` (tau_H for stapo and
            random, the entropy cut for entropy20; ignored by methods without one).
        tp_group: the tensor-parallel group the output vocabulary is sharded over.
        vocab_size: the real vocabulary size if the output layer is padded (see ops).
        cp_group: the context-parallel group of CP-split micro-batches (see `loss_func`).
    """
    if threshold is None:
        if get_method(config.method).needs_entropy:
            raise ValueError(f"method {config.method!r} needs the mini-batch threshold")
        threshold = torch.tensor(float("nan"))

    return forward_step_func(lambda batch: partial(loss_func, config, batch, threshold, tp_group, vocab_size,
                                                   cp_group=cp_group))
