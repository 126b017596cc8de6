"""The policy objectives, the second axis of a method: one `Objective` per name in `OBJECTIVES`,
registered as methods are (`register_objective`, `get_objective` of a name or a dotted path).

A method is a mask (``method.registry``: stapo, entropy20, the random controls, none) applied to
an objective: the per-token loss l_t that ``method.objective.policy_loss`` sums over the kept
tokens (keep = response_mask & ~silenced & ~rejected) and how it averages them. Every existing
method name keeps its objective (`Method.objective`: "dapo" for all but "grpo"); ``loss.objective``
picks another, so "S2T on CISPO" is ``loss.method=stapo loss.objective=cispo``.

Tensors are [B, S] (micro-batch x sequence, aligned with the labels); ``_T`` flattened tokens,
``_N`` kept tokens, ``_K`` sequences. Legend: r_t = pi_theta / pi_old of token t, A the advantage, sg = stop-gradient, keep as above;
"token mean" = 1 / sum keep * sum keep * l_t over the mini-batch, "sequence mean" = 1 / G sum_i
1 / |o_i| sum_t l_t. Formulas follow verl 0.9.1 ``verl/trainer/ppo/core_algos.py`` (the
``compute_policy_loss_*`` functions named below) and the papers:

- dapo (DAPO arXiv 2503.14476 / JustRL; verl "vanilla"): l_t = max(-r A, -clip(r, 1-eps_low, 1+eps_high) A),
  token mean; with ``clip_ratio_c``, the dual clip below for A < 0.
- grpo (DeepSeekMath, arXiv 2402.03300): the same l_t, sequence mean (+ beta k3 KL, `LossConfig.kl_coef`).
- dual_clip (Ye et al. arXiv 1912.09729; verl "vanilla" with clip_ratio_c): for A < 0,
  l_t = min(max(-r A, -clip(r) A), -c A); needs ``clip_ratio_c`` (verl's default 3).
- gspo (arXiv 2507.18071; verl "gspo"): s_i = exp(1/|o_i| sum_t log r_t) per sequence, per token
  s_it = exp(log pi_t - sg(log pi_t) + sg(log s_i)) (value s_i, gradient s_i grad log pi_t),
  log s_it clamped at 10, l_t = max(-s_it A, -clip(s_it, 1-eps_low, 1+eps_high) A), sequence mean.
- cispo (MiniMax-M1, arXiv 2506.13585; verl "cispo"): l_t = -sg(clip(r, 1-eps_low, 1+eps_high)) A log pi_t
  (log r clamped to [-20, 20]), token mean: every token keeps a gradient, clipping only bounds its weight.
- clip_cov (arXiv 2505.22617; verl "clip_cov"): cov_t = (A - mean A)(log pi - mean log pi) over the
  micro-batch's kept tokens; of the tokens the PPO clip leaves unclipped with lb < cov_t < ub,
  max(1, int(ratio * N)) drawn at random (seeded) lose their gradient (l_t = 0); the rest the dapo l_t.
- kl_cov (arXiv 2505.22617; verl "kl_cov"): l_t = -r A, plus kl_coef |log r| on the top
  max(1, int(ratio * N)) tokens by cov_t; no ratio clip.

The covariance objectives' statistics are the micro-batch's (verl computes them per micro-batch
too), so they are refused under context parallelism, where a rank holds half of each sequence
(`check_parallelism`). GSPO's sequence ratio sums over the CP group (``SequenceSum``), as GRPO's
sequence mean does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional

import torch

from stapo_megatron.method.objective import SequenceSum, TokenLoss, token_objective
from stapo_megatron.method.rollout_correction import segments, sequence_log_ratio
from stapo_megatron.utils import lookup_registered, qualname


@dataclasses.dataclass(frozen=True)
class Objective:
    """One policy objective: its per-token loss, its aggregation, its options."""

    name: str
    """The value of ``LossConfig.objective``."""
    summary: str
    """One line (with its source) for documentation and error messages."""
    build: Callable[..., TokenLoss]
    """``(config, sequence_ids, sequence_sum, seed) -> TokenLoss`` for one micro-batch."""
    loss_agg: str = "token_mean"
    """"token_mean" or "seq_mean_token_mean" (``method.objective.LOSS_AGGREGATIONS``)."""
    loss_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """`LossConfig` values of the objective's source recipe (``method_loss_config`` applies them)."""
    context_parallel: bool = True
    """False: needs whole micro-batch statistics a CP rank does not hold (refused under CP)."""


# -- the objectives on plain tensors --------------------------------------------------------------


def gspo_ratio(logprob, old_logprob, keep, sequence_ids: Optional[torch.Tensor] = None,
               sequence_sum: Optional[SequenceSum] = None) -> torch.Tensor:
    """GSPO's s_it: the value of the sequence ratio s_i, the gradient s_i grad log pi_t. s_i is the
    geometric mean over each sequence's kept tokens (a row, or ``sequence_ids``' sequences of a
    packed row; ``sequence_sum``: the sequence is split over CP ranks)."""
    log_s_K, _ = sequence_log_ratio((logprob - old_logprob).detach(), keep, sequence_ids, sequence_sum)
    log_s_BS = log_s_K[segments(keep, sequence_ids)]
    return torch.exp(torch.clamp(logprob - logprob.detach() + log_s_BS, max=10.0))


def gspo_token_loss(logprob, old_logprob, advantages, keep, clip_ratio_low=3e-4, clip_ratio_high=4e-4,
                    sequence_ids: Optional[torch.Tensor] = None, sequence_sum: Optional[SequenceSum] = None):
    """GSPO's per-token loss (formula in the module docstring; the ratio: `gspo_ratio`)."""
    ratio = gspo_ratio(logprob, old_logprob, keep, sequence_ids, sequence_sum)
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high))


def cispo_token_loss(logprob, old_logprob, advantages, clip_ratio_low=0.2, clip_ratio_high=0.28):
    """CISPO's per-token loss -sg(clip(r)) A log pi (formula in the module docstring)."""
    ratio = torch.exp(torch.clamp(logprob - old_logprob, -20.0, 20.0))
    weight = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    return -weight * advantages * logprob


def _centered_product(advantages, logprob, keep):
    """(A - mean A)(log pi - mean log pi), means over the kept tokens (no gradient)."""
    n = keep.sum().clamp(min=1)
    mean_a = torch.where(keep, advantages, 0.0).sum() / n
    logprob = logprob.detach()
    mean_lp = torch.where(keep, logprob, 0.0).sum() / n
    return (advantages - mean_a) * (logprob - mean_lp)


def clip_cov_token_loss(logprob, old_logprob, advantages, keep, clip_ratio_low=0.2, clip_ratio_high=0.28,
                        ratio=2e-4, lower=1.0, upper=5.0, generator: Optional[torch.Generator] = None):
    """Clip-Cov's per-token loss (formula in the module docstring); ``generator`` draws which
    of the eligible tokens lose their gradient."""
    loss, is_clipped = token_objective(logprob, old_logprob, advantages, clip_ratio_low, clip_ratio_high)
    cov = _centered_product(advantages, logprob, keep)
    eligible_T = (keep & ~is_clipped & (cov > lower) & (cov < upper)).reshape(-1).nonzero().squeeze(-1)
    num = min(max(int(ratio * int(keep.sum())), 1), eligible_T.numel())
    order = torch.randperm(eligible_T.numel(), generator=generator).to(eligible_T.device)
    dropped_T = torch.zeros(keep.numel(), dtype=torch.bool, device=keep.device)
    dropped_T[eligible_T[order[:num]]] = True
    return loss.masked_fill(dropped_T.view(keep.shape), 0.0)


def kl_cov_token_loss(logprob, old_logprob, advantages, keep, ratio=2e-4, kl_coef=1.0):
    """KL-Cov's per-token loss (formula in the module docstring)."""
    log_ratio = logprob - old_logprob
    loss = -advantages * torch.exp(log_ratio)
    n = int(keep.sum())
    if n == 0:
        return loss
    cov_N = _centered_product(advantages, logprob, keep)[keep]
    top_N = torch.topk(cov_N, max(1, int(n * ratio))).indices
    penalised_T = torch.zeros(n, dtype=torch.bool, device=keep.device)
    penalised_T[top_N] = True
    penalised = torch.zeros_like(keep)
    penalised[keep] = penalised_T
    return torch.where(penalised, loss + kl_coef * log_ratio.abs(), loss)


# -- the registry ---------------------------------------------------------------------------------

OBJECTIVES: Dict[str, Objective] = {}
"""Every objective, by name (``LossConfig.objective``): the built-in ones below, in the order
tables and comparisons list them, and those `register_objective` adds."""

OBJECTIVE_ATTRIBUTE = "stapo_objective"
"""The attribute `register_objective` sets on the function it decorates: its `Objective`."""


def register_objective(name: str, summary: str = "", loss_agg: str = "token_mean",
                       loss_options: Optional[Mapping[str, Any]] = None, context_parallel: bool = True):
    """Decorator: register the builder it decorates, ``(config, sequence_ids, sequence_sum, seed)
    -> TokenLoss`` for one micro-batch, as the `Objective` ``name`` in `OBJECTIVES`.

    The function is returned unchanged with its `Objective` as the attribute `OBJECTIVE_ATTRIBUTE`,
    so a dotted path to it (``loss.objective=pkg.module:fn``) finds the objective. ``summary``
    defaults to the first line of the function's docstring. A name already taken by another
    function is a ValueError (re-importing the same module registers it again, harmlessly).

    Example::

        @register_objective("reinforce", loss_options=dict(clip_ratio_c=None))
        def reinforce(config, sequence_ids, sequence_sum, seed):
            \"\"\"REINFORCE: -r A, no clip.\"\"\"
            return lambda logprob, old_logprob, advantages, keep: -torch.exp(logprob - old_logprob) * advantages
    """
    def register(build: Callable[..., TokenLoss]) -> Callable[..., TokenLoss]:
        line = summary or (build.__doc__ or name).strip().splitlines()[0]
        objective = Objective(name, line, build, loss_agg, dict(loss_options or {}), context_parallel)
        taken = OBJECTIVES.get(name)
        if taken is not None and qualname(taken.build) != qualname(build):
            raise ValueError(f"objective {name!r} is already registered (by {qualname(taken.build)}); "
                             f"choose another name for {qualname(build)}")
        OBJECTIVES[name] = objective
        setattr(build, OBJECTIVE_ATTRIBUTE, objective)
        return build
    return register


@register_objective("dapo", "the JustRL/DAPO token loss: clipped surrogate, clip-higher, token mean (arXiv 2503.14476)")
def _dapo(config, sequence_ids, sequence_sum, seed) -> TokenLoss:
    return lambda lp, old, adv, keep: token_objective(lp, old, adv, config.clip_ratio_low, config.clip_ratio_high,
                                                      config.clip_ratio_c)[0]


@register_objective("grpo", "DeepSeekMath GRPO: clipped surrogate, sequence mean (+ k3 KL; arXiv 2402.03300)",
                    loss_agg="seq_mean_token_mean",
                    loss_options=dict(clip_ratio_high=0.2, clip_ratio_c=None, kl_coef=0.04))
def _grpo(config, sequence_ids, sequence_sum, seed) -> TokenLoss:
    return _dapo(config, sequence_ids, sequence_sum, seed)


@register_objective("dual_clip", "dual-clip PPO: the dapo loss bounded by -c A for A < 0 (arXiv 1912.09729)",
                    loss_options=dict(clip_ratio_c=3.0))
def _dual_clip(config, sequence_ids, sequence_sum, seed) -> TokenLoss:
    return _dapo(config, sequence_ids, sequence_sum, seed)


@register_objective("gspo", "GSPO: sequence-level geometric-mean ratio, clipped, sequence mean (arXiv 2507.18071)",
                    loss_agg="seq_mean_token_mean", loss_options=dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4))
def _gspo(config, sequence_ids, sequence_sum, seed) -> TokenLoss:
    return lambda lp, old, adv, keep: gspo_token_loss(lp, old, adv, keep, config.clip_ratio_low,
                                                      config.clip_ratio_high, sequence_ids, sequence_sum)


@register_objective("cispo", "CISPO: clipped, detached IS weight times log-prob, token mean (MiniMax-M1, "
                    "arXiv 2506.13585)")
def _cispo(config, sequence_ids, sequence_sum, seed) -> TokenLoss:
    return lambda lp, old, adv, keep: cispo_token_loss(lp, old, adv, config.clip_ratio_low, config.clip_ratio_high)


def clip_cov_generator(config, seed: Optional[int]) -> torch.Generator:
    """The generator of Clip-Cov's draw in one micro-batch: seeded like the random masks, from
    ``config.seed`` and the micro-batch's ``seed``, offset by 7 to be a stream of its own."""
    return torch.Generator().manual_seed(config.seed * 1_000_003 + int(seed if seed is not None else 0) + 7)


@register_objective("clip_cov", "Clip-Cov: no gradient for random high-covariance tokens (arXiv 2505.22617)",
                    context_parallel=False)
def _clip_cov(config, sequence_ids, sequence_sum, seed) -> TokenLoss:
    gen = clip_cov_generator(config, seed)
    return lambda lp, old, adv, keep: clip_cov_token_loss(
        lp, old, adv, keep, config.clip_ratio_low, config.clip_ratio_high, config.clip_cov_ratio,
        config.clip_cov_lower, config.clip_cov_upper, gen)


@register_objective("kl_cov", "KL-Cov: |log r| penalty on the top-covariance tokens (arXiv 2505.22617)",
                    context_parallel=False)
def _kl_cov(config, sequence_ids, sequence_sum, seed) -> TokenLoss:
    return lambda lp, old, adv, keep: kl_cov_token_loss(lp, old, adv, keep, config.kl_cov_ratio, config.kl_cov_coef)


def objective_from_object(obj: Any, path: str) -> Objective:
    """The `Objective` a dotted path names: an `Objective`, a builder decorated with
    `register_objective`, or a plain builder (an objective called ``path``: token mean, no
    options, allowed under context parallelism)."""
    if isinstance(obj, Objective):
        return obj
    if callable(obj):
        return getattr(obj, OBJECTIVE_ATTRIBUTE, None) or Objective(
            path, (obj.__doc__ or path).strip().splitlines()[0], obj)
    raise ValueError(f"loss.objective = {path!r} names a {type(obj).__name__}, not an Objective or a builder "
                     f"(config, sequence_ids, sequence_sum, seed) -> token loss (logprob, old_logprob, advantages, "
                     f"keep) -> [B, S]")


def get_objective(name: str) -> Objective:
    """The `Objective` called ``name`` (a name of `OBJECTIVES`), or named by a dotted path
    ``pkg.module:fn`` / ``pkg.module.fn`` (`objective_from_object`); a ValueError naming the valid
    names (and the closest) for an unknown name, or naming the path for one that does not import."""
    return lookup_registered(name, OBJECTIVES, "loss.objective", objective_from_object)


@torch.no_grad()
def clipped_tokens(config, logprob, old_logprob, advantages, keep, sequence_ids: Optional[torch.Tensor] = None,
                   sequence_sum: Optional[SequenceSum] = None) -> torch.Tensor:
    """[B, S] bool: the tokens whose term the objective's clip changes (verl's ``pg_clipfrac``
    numerator, the ``clip_fraction`` metric): the PPO clip active for dapo, grpo, dual_clip and
    clip_cov; the same with GSPO's sequence ratio; for CISPO the weight clipped (r outside
    [1 - eps_low, 1 + eps_high]); none for KL-Cov, which has no clip. Collective over the CP
    group for GSPO (``sequence_sum``)."""
    name, low, high = config.effective_objective, config.clip_ratio_low, config.clip_ratio_high
    if name == "kl_cov":
        return torch.zeros_like(keep)
    ratio = (gspo_ratio(logprob, old_logprob, keep, sequence_ids, sequence_sum) if name == "gspo"
             else torch.exp(logprob - old_logprob))
    if name == "cispo":
        return (ratio < 1 - low) | (ratio > 1 + high)
    return -advantages * ratio.clamp(1 - low, 1 + high) > -advantages * ratio


def check_parallelism(objective: str, context_parallel_size: int) -> None:
    """ValueError when ``objective`` cannot run at this context-parallel size (naming both)."""
    if context_parallel_size > 1 and not get_objective(objective).context_parallel:
        raise ValueError(f"loss.objective={objective!r} with model.context_parallel_size={context_parallel_size}: "
                         f"its covariance statistics are the whole micro-batch's and a CP rank holds part of each "
                         f"sequence; use context_parallel_size=1 or another objective")
