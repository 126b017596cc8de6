"""The STAPO policy loss and its Megatron-Core ``forward_step_func`` / ``loss_func``.

STAPO objective (arXiv 2602.15620, Eq. for J_STAPO; the DAPO/JustRL token-level objective with
clip-higher, no KL, no entropy bonus, plus the S2T mask of ``stapo_megatron.s2t``):

    J = 1 / sum keep * sum_{i,t} keep_{i,t} * min( r A_i , clip(r, 1 - eps_low, 1 + eps_high) A_i )
    r = pi_theta(y_t | .) / pi_old(y_t | .),   keep = response_mask & ~silenced

The denominator counts the kept tokens of the WHOLE mini-batch (all micro-batches, all DP ranks).
The loss function returns (sum of token losses, number of kept tokens, metrics); with
``calculate_per_token_loss=True`` Megatron's own ``finalize_model_grads`` all-reduces the token
count over DP (after broadcasting it from the last pipeline stage) and scales the gradients by
its inverse, which is exactly that renormalisation.

Where tau_H (the mini-batch quantile of candidate entropies) comes from, ``tau_h_source``:

- "old" (default): the entropies and log-probs of the pi_old pass that computes old log-probs
  anyway. For the first PPO mini-batch of a step pi_old == pi_theta, so this equals the paper's
  definition exactly; for later mini-batches the candidate set and quantile lag by the updates of
  the earlier mini-batches of the same step. Costs nothing extra.
- "exact": a no-grad pre-pass over the mini-batch with the current weights right before its
  forward/backward (``compute_logprob_entropy``). Exact for every mini-batch; costs one extra
  forward pass (about a third of a training step), so it is not the default.

Legend: [B, S] = micro-batch x sequence; ``_BS`` tensors are aligned with the labels (the token
predicted at each position).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from stapo_megatron import s2t
from stapo_megatron.methods import get_method
from stapo_megatron.ops import vocab_parallel_logprob_entropy
from stapo_megatron.parallel import collective_device


@dataclasses.dataclass
class LossConfig:
    """Policy-loss method and constants (defaults: the paper's STAPO recipe)."""

    method: str = "stapo"
    """A name of `stapo_megatron.methods.METHODS`: "stapo" (S2T mask), "grpo" (DAPO/JustRL
    objective, no mask), "entropy20" (keep only the top-20% entropy tokens), "random" (silence as
    many random response tokens as S2T would)."""
    clip_ratio_low: float = 0.2
    """eps_low of the clipped ratio (PPO/DAPO)."""
    clip_ratio_high: float = 0.28
    """eps_high of the clipped ratio (DAPO clip-higher)."""
    clip_ratio_c: Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages (off by default, as in the paper)."""
    kl_coef: float = 0.0
    """Coefficient of a k3 KL(pi_theta || pi_ref) penalty per kept token (off in the paper);
    needs ``ref_logprob`` in the batch."""
    tau_p: float = 0.002
    """S2T probability threshold: candidates have p < tau_p."""
    entropy_quantile: float = 0.75
    """S2T q: tau_H is this quantile of candidate entropies over the mini-batch."""
    entropy_top_fraction: float = 0.2
    """20-Entropy rho: fraction of highest-entropy response tokens kept."""
    tau_h_source: str = "old"
    """Where the mini-batch threshold comes from: "old" (pi_old pass) or "exact" (pre-pass)."""
    temperature: float = 1.0
    """Rollout sampling temperature; logits are divided by it exactly as the sampler does."""
    seed: int = 0
    """Base seed of the random-control mask (combined with a per-micro-batch seed)."""

    def __post_init__(self):
        get_method(self.method)  # ValueError naming the methods
        if self.tau_h_source not in ("old", "exact"):
            raise ValueError(f"tau_h_source must be 'old' or 'exact', got {self.tau_h_source!r}")
        if not (0 <= self.clip_ratio_low < 1 and self.clip_ratio_high >= 0):
            raise ValueError(
                f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got "
                f"{self.clip_ratio_low}, {self.clip_ratio_high}"
            )
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c must be > 1, got {self.clip_ratio_c}")
        # `not (a < x <= b)` also refuses NaN, which every comparison fails.
        if not 0 < self.tau_p <= 1:
            raise ValueError(f"tau_p must be in (0, 1] (a probability threshold), got {self.tau_p}")
        if not 0 < self.entropy_quantile < 1:
            raise ValueError(f"entropy_quantile must be in (0, 1), got {self.entropy_quantile}")
        if not 0 < self.entropy_top_fraction <= 1:
            raise ValueError(f"entropy_top_fraction must be in (0, 1], got {self.entropy_top_fraction}")
        if not (0 < self.temperature and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and > 0, got {self.temperature}")
        if not (0 <= self.kl_coef and math.isfinite(self.kl_coef)):
            raise ValueError(f"kl_coef must be finite and >= 0, got {self.kl_coef}")


def token_objective(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss -min(r A, clip(r) A) and whether clipping was active."""
    ratio = torch.exp(logprob - old_logprob)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if clip_ratio_c is not None:
        # Dual clip (Ye et al. 2020): for A < 0 bound the loss by -c A.
        dual = torch.minimum(loss, -clip_ratio_c * advantages)
        loss = torch.where(advantages < 0, dual, loss)
    return loss, is_clipped


def stapo_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    silenced: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: Optional[float] = None,
    ref_logprob: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sum of STAPO token losses over kept tokens, and the number of kept tokens.

    keep = response_mask & ~silenced; loss_sum = -sum keep * min(r A, clip(r, 1-eps_low,
    1+eps_high) A) (+ kl_coef * k3 KL to ``ref_logprob`` per kept token if kl_coef > 0).
    Dividing by the kept count of the whole mini-batch (not by this call's) gives -J.

    Args:
        logprob, old_logprob, ref_logprob: [B, S] log-probs of the labels (any float dtype;
            the loss is computed in fp32, so fp16 inputs do not overflow the sum).
        advantages: [B, S] per-token advantages (a sequence's advantage broadcast over its
            tokens, ``adv_B[:, None].expand(B, S)``).
        response_mask, silenced: [B, S] bool.

    Returns:
        (loss_sum: 0-dim fp32, differentiable; num_kept: 0-dim int64).

    Raises:
        ValueError: if a tensor's shape differs from ``logprob``'s (a [B] advantage would
            broadcast along the token axis when B == S; a [B, S, 1] mask would multiply the
            kept count), or a mask is not bool.
    """
    tensors = {"old_logprob": old_logprob, "advantages": advantages, "response_mask": response_mask,
               "silenced": silenced}
    if ref_logprob is not None:
        tensors["ref_logprob"] = ref_logprob
    for name, t in tensors.items():
        if t.shape != logprob.shape:
            hint = ""
            if name == "advantages":
                hint = (" (advantages are per token: expand a per-sequence [B] advantage with "
                        "adv[:, None].expand_as(logprob))")
            raise ValueError(f"{name} has shape {list(t.shape)} but logprob has {list(logprob.shape)}{hint}")
    for name in ("response_mask", "silenced"):
        if tensors[name].dtype != torch.bool:
            raise ValueError(f"{name} must be a bool tensor, got {tensors[name].dtype}")
    logprob, old_logprob, advantages = logprob.float(), old_logprob.float(), advantages.float()
    ref_logprob = None if ref_logprob is None else ref_logprob.float()
    keep = response_mask & ~silenced
    loss, _ = token_objective(
        logprob, old_logprob, advantages, clip_ratio_low, clip_ratio_high, clip_ratio_c
    )
    if kl_coef:
        if ref_logprob is None:
            raise ValueError("kl_coef > 0 needs ref_logprob")
        log_ratio_ref = ref_logprob - logprob
        loss = loss + kl_coef * (torch.expm1(log_ratio_ref) - log_ratio_ref)
    # where() rather than a multiply: a silenced token's inf/NaN ratio must not leak into the sum.
    loss_sum = torch.where(keep, loss, 0.0).sum()
    return loss_sum, keep.sum()


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
    entropy20: the (1 - rho)-quantile of response-token entropies; grpo: NaN (unused); in
    general ``Method.threshold`` (`stapo_megatron.methods`). Tensors may be flattened and
    concatenated over micro-batches. Collective over ``dp_group`` (every DP rank must call it).
    """
    method = get_method(config.method)
    if method.threshold is None:
        return torch.tensor(float("nan"))
    return method.threshold(config, logprob, entropy, advantages, response_mask, dp_group)


# Per-micro-batch sums reported by the loss function, reduced over micro-batches and DP ranks.
METRIC_SUMS = (
    "loss_sum", "num_kept", "num_response", "num_silenced", "num_candidates",
    "entropy_sum", "num_clipped", "kl_sum", "abs_logprob_diff_sum",
)


def loss_func(
    config: LossConfig,
    batch: Dict[str, torch.Tensor],
    threshold: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup],
    vocab_size: Optional[int],
    logits: torch.Tensor,
):
    """Megatron ``loss_func`` (last pipeline stage): returns (loss_sum, num_kept, metrics).

    ``batch`` holds [B, S] tensors aligned with ``labels``: response_mask, old_logprob,
    advantages (per token), optionally ref_logprob; and ``seed`` (int tensor) for the random mask.
    """
    logprob, entropy = vocab_parallel_logprob_entropy(
        logits, batch["labels"], tp_group=tp_group, temperature=config.temperature, vocab_size=vocab_size
    )
    response_mask = batch["response_mask"].bool()
    advantages = batch["advantages"].float()
    old_logprob = batch["old_logprob"].float()
    candidates = s2t.s2t_candidates(logprob.detach(), advantages, response_mask, config.tau_p)
    silenced = get_method(config.method).mask(
        config, logprob.detach(), entropy, advantages, response_mask, threshold, batch.get("seed")
    )
    loss_sum, num_kept = stapo_loss(
        logprob, old_logprob, advantages, response_mask, silenced,
        config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c,
        batch.get("ref_logprob"), config.kl_coef,
    )
    with torch.no_grad():
        _, is_clipped = token_objective(
            logprob, old_logprob, advantages, config.clip_ratio_low, config.clip_ratio_high
        )
        keep = response_mask & ~silenced
        log_ratio = logprob - old_logprob
        sums = torch.stack([
            loss_sum.detach(),
            num_kept.float(),
            response_mask.sum().float(),
            silenced.sum().float(),
            candidates.sum().float(),
            torch.where(response_mask, entropy, 0.0).sum(),
            (is_clipped & keep).sum().float(),
            # k3 estimator of KL(pi_old || pi_theta) on response tokens
            torch.where(response_mask, torch.expm1(log_ratio) - log_ratio, 0.0).sum(),  # expm1: exact for small ratios
            torch.where(response_mask, log_ratio.abs(), 0.0).sum(),
        ])
    # The spurious-token inspector's raw material: (label id, log p, H, A) of silenced tokens.
    silenced_tokens = torch.stack(
        [batch["labels"][silenced].float(), logprob.detach()[silenced], entropy[silenced], advantages[silenced]],
        dim=-1,
    )
    return loss_sum, num_kept.to(torch.int), {"stapo_sums": sums, "silenced_tokens": silenced_tokens}


def make_forward_step(
    config: LossConfig,
    threshold: Optional[torch.Tensor] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
) -> Callable:
    """A ``forward_step_func`` for ``get_forward_backward_func()`` with the STAPO loss.

    Each item of the data iterator is a dict of [B, S] tensors: ``tokens``, ``position_ids``,
    ``labels`` (next tokens), ``response_mask``, ``old_logprob``, ``advantages`` (per token),
    optionally ``ref_logprob`` and ``seed``. The model is a Megatron GPTModel (any PP stage);
    only the last stage's output reaches ``loss_func``. The TransformerConfig must have
    ``calculate_per_token_loss=True`` and the caller must set
    ``config.finalize_model_grads_func`` (Megatron's ``finalize_model_grads``) so the gradients
    are divided by the mini-batch's kept-token count.

    Args:
        threshold: the mini-batch threshold from ``minibatch_threshold`` (tau_H for stapo and
            random, the entropy cut for entropy20; ignored by methods without one).
        tp_group: the tensor-parallel group the output vocabulary is sharded over.
        vocab_size: the real vocabulary size if the output layer is padded (see ops).
    """
    if threshold is None:
        if get_method(config.method).needs_entropy:
            raise ValueError(f"method {config.method!r} needs the mini-batch threshold")
        threshold = torch.tensor(float("nan"))

    return _forward_step(lambda batch: partial(loss_func, config, batch, threshold, tp_group, vocab_size))


def _forward_step(make_loss: Callable) -> Callable:
    """A forward_step_func running the GPTModel on a micro-batch dict; ``make_loss(batch)`` gives
    the loss function Megatron applies to the last stage's output."""

    def forward_step(data_iterator, model):
        # Micro-batches may be built on the CPU (tests, library users); the model's device is
        # where they are used. A no-op for tensors already there (the trainer's).
        device = next(model.parameters()).device
        batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v
                 for k, v in next(data_iterator).items()}
        output = model(batch["tokens"], batch["position_ids"], attention_mask=None)
        return output, make_loss(batch)

    return forward_step


def run_microbatches(model, microbatches: List[Dict[str, torch.Tensor]], seq_length: int,
                     make_loss: Callable, forward_only: bool = False) -> list:
    """Megatron's ``forward_backward_func`` over micro-batch dicts (any PP schedule).

    Returns the loss functions' metric dicts, one per micro-batch, on the last pipeline stage.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=_forward_step(make_loss),
        data_iterator=iter(microbatches),
        model=model,
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=microbatches[0]["tokens"].shape[0],
        forward_only=forward_only,
    )


def _stats_loss_func(temperature, tp_group, vocab_size, batch, logits):
    logprob, entropy = vocab_parallel_logprob_entropy(
        logits, batch["labels"], tp_group=tp_group, temperature=temperature, vocab_size=vocab_size
    )
    zero = torch.zeros((), dtype=torch.float32, device=logits.device)
    return zero, torch.zeros((), dtype=torch.int, device=logits.device), {"logprob": logprob, "entropy": entropy}


def compute_logprob_entropy(
    model,
    microbatches: List[Dict[str, torch.Tensor]],
    seq_length: int,
    temperature: float = 1.0,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """No-grad forward over micro-batches: per micro-batch (logprob, entropy), each [B, S].

    The pi_old pass of a step and the "exact" tau_H pre-pass. Results exist on the last
    pipeline stage; other stages get an empty list.
    """
    with torch.no_grad():
        outputs = run_microbatches(
            model, microbatches, seq_length,
            lambda batch: partial(_stats_loss_func, temperature, tp_group, vocab_size, batch),
            forward_only=True,
        )
    return [(out["logprob"], out["entropy"]) for out in outputs]


def reduce_metrics(
    losses_reduced: Iterable[Dict[str, torch.Tensor]],
    threshold: torch.Tensor,
    dp_group: Optional[dist.ProcessGroup] = None,
    pp_group: Optional[dist.ProcessGroup] = None,
    pp_last_rank: Optional[int] = None,
) -> Dict[str, float]:
    """Step metrics from the per-micro-batch sums: summed over micro-batches and DP ranks,
    then broadcast from the last pipeline stage (global rank ``pp_last_rank``) over
    ``pp_group`` so every rank can log them. Collective over both groups.
    """
    # Collectives run on the backend's device (CUDA for NCCL, CPU for gloo); the per-micro-batch
    # sums live on the model's device and are moved there.
    sums = torch.zeros(len(METRIC_SUMS) + 1, device=collective_device(dp_group if dp_group is not None else pp_group))
    for item in losses_reduced:
        sums[:-1] += item["stapo_sums"].to(sums.device)
    sums[-1] = float(threshold)
    if dp_group is not None:
        tau = sums[-1].clone()
        dist.all_reduce(sums, group=dp_group)
        sums[-1] = tau  # identical on all DP ranks
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.broadcast(sums, src=pp_last_rank, group=pp_group)
    total = dict(zip(METRIC_SUMS, sums[:-1].tolist()))
    num_resp = max(total["num_response"], 1.0)
    return {
        "loss": total["loss_sum"] / max(total["num_kept"], 1.0),
        "num_kept": int(total["num_kept"]),
        "num_response_tokens": int(total["num_response"]),
        "silenced_count": int(total["num_silenced"]),
        "silenced_fraction": total["num_silenced"] / num_resp,
        "candidate_count": int(total["num_candidates"]),
        "tau_h": float(sums[-1]),
        "entropy_mean": total["entropy_sum"] / num_resp,
        "clip_fraction": total["num_clipped"] / max(total["num_kept"], 1.0),
        "approx_kl": total["kl_sum"] / num_resp,
        "logprob_diff_mean": total["abs_logprob_diff_sum"] / num_resp,
    }
