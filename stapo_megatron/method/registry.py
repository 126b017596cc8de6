"""The policy-optimisation methods: one small object per method, in one registry (`METHODS`).

A method is what differs between STAPO and its baselines inside the shared objective of
``stapo_megatron.method.objective`` (docs/design.md, "The method"):

- ``mask``: which response tokens it silences in one micro-batch (True = silenced);
- ``threshold``: the mini-batch statistic the mask needs (tau_H for S2T, the entropy cut for
  20-Entropy), computed once per mini-batch from the pi_old (or "exact" pre-pass) log-probs and
  entropies, over all DP ranks, before Megatron runs the micro-batches; None if it needs none;
- ``loss_options``: the `LossConfig` values the method needs on top of the shared constants
  (`method_loss_config`; the paper recipes' `stapo_megatron.recipes.paper.method_loss`);
- ``loss_agg``: how token losses are averaged (``stapo_megatron.method.objective.LOSS_AGGREGATIONS``).

The paper (arXiv 2602.15620) compares STAPO with GRPO, 20-Entropy and JustRL: ``grpo`` is
DeepSeekMath's GRPO (per-sequence mean, symmetric clip 0.2, k3 KL to a frozen reference with
beta 0.04), ``justrl`` the JustRL/DAPO objective STAPO builds on (token mean, clip-higher
0.2/0.28, no KL), i.e. STAPO without its mask.

Everything that names methods (`LossConfig.method`, the recipes, the launch entry, the method
comparison) asks `get_method`. Adding a method needs no edit here: decorate its mask with
`register_method` in any module, and name it in ``loss.method`` by dotted path
(``loss.method=my_pkg.methods:my_mask``; importing the module registers it on every rank), or by
its name once that module is imported (docs/extending.md has a worked example).

Legend: tensors are [B, S] (micro-batch x sequence, aligned with the labels) or flattened over
a whole mini-batch (thresholds).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional

import torch
import torch.distributed as dist

from stapo_megatron.method import masks
from stapo_megatron.utils import SEED_STRIDE, lookup_registered, qualname

LossConfigT = Any
"""The `stapo_megatron.method.config.LossConfig` a mask or threshold reads (that module imports
this one, so the name is not imported here)."""
ThresholdFn = Callable[..., torch.Tensor]
"""``(config, logprob, entropy, advantages, response_mask, dp_group) -> 0-dim tensor``;
collective over ``dp_group`` (every DP rank calls it)."""
MaskFn = Callable[..., torch.Tensor]
"""``(config, logprob, entropy, advantages, response_mask, threshold, seed) -> bool [B, S]``;
``logprob`` is detached, ``seed`` the micro-batch's seed tensor (or None)."""


@dataclasses.dataclass(frozen=True)
class Method:
    """One policy-optimisation method: its token mask, its mini-batch statistic, its options."""

    name: str
    """The value of ``LossConfig.method`` (and of the recipes' ``method=``)."""
    summary: str
    """One line for documentation and error messages."""
    mask: MaskFn
    """Per micro-batch silenced tokens (see `MaskFn`)."""
    threshold: Optional[ThresholdFn] = None
    """The mini-batch statistic ``mask`` reads (see `ThresholdFn`); None: the method has none."""
    loss_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """`LossConfig` fields this method sets (beyond the shared constants; `method_loss_config`)."""
    loss_agg: str = "token_mean"
    """"token_mean" (every kept token of the mini-batch weighs the same) or
    "seq_mean_token_mean" (GRPO: mean per sequence, then over sequences); see
    ``stapo_megatron.method.objective.policy_loss``. Must equal the default objective's
    (``objectives.OBJECTIVES[objective].loss_agg``), which is what the loss reads."""
    objective: str = "dapo"
    """The objective the mask applies to unless ``LossConfig.objective`` names another
    (``stapo_megatron.method.objectives.OBJECTIVES``)."""

    @property
    def needs_entropy(self) -> bool:
        """Whether the step must compute the mini-batch statistic from pi_old (or pre-pass)
        entropies; False: no threshold, the mask reads no entropy."""
        return self.threshold is not None


# -- thresholds ---------------------------------------------------------------------------------


def _s2t_threshold(config: LossConfigT, logprob, entropy, advantages, response_mask,
                   dp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """tau_H: the q-quantile of S2T candidate entropies over the mini-batch (all DP ranks)."""
    candidates = masks.s2t_candidates(logprob, advantages, response_mask, config.tau_p)
    tau_h, _ = masks.s2t_threshold(entropy, candidates, config.entropy_quantile, dp_group)
    return tau_h


def _entropy20_threshold(config: LossConfigT, logprob, entropy, advantages, response_mask,
                         dp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The (1 - rho)-quantile of response-token entropies over the mini-batch."""
    return masks.entropy20_threshold(entropy, response_mask, config.entropy_top_fraction, dp_group)


# -- masks --------------------------------------------------------------------------------------


def _stapo_mask(config: LossConfigT, logprob, entropy, advantages, response_mask, threshold, seed):
    """S2T: candidates (A > 0, p < tau_p) with H < tau_H."""
    return masks.s2t_mask(logprob, entropy, advantages, response_mask, config.tau_p, tau_h=threshold)


def _no_mask(config: LossConfigT, logprob, entropy, advantages, response_mask, threshold, seed):
    """Nothing silenced."""
    return masks.no_mask(response_mask)


def _entropy20_mask(config: LossConfigT, logprob, entropy, advantages, response_mask, threshold, seed):
    """Keep the top-rho entropy response tokens of the mini-batch."""
    return masks.entropy20_mask(entropy, response_mask, threshold=threshold)


def _micro_seed(config: LossConfigT, seed) -> int:
    """The random controls' seed of one micro-batch: ``config.seed`` and the micro-batch's seed."""
    return config.seed * SEED_STRIDE + int(seed if seed is not None else 0)


def _random_candidates_mask(config: LossConfigT, logprob, entropy, advantages, response_mask, threshold, seed):
    """As many tokens as S2T silences in this micro-batch, drawn at random from S2T's candidate
    pool (A > 0, p < tau_p): the control that asks whether the entropy criterion matters."""
    num_silenced = int(_stapo_mask(config, logprob, entropy, advantages, response_mask, threshold, seed).sum())
    candidates = masks.s2t_candidates(logprob, advantages, response_mask, config.tau_p)
    return masks.random_mask(candidates, num_silenced, _micro_seed(config, seed))


def _random_uniform_mask(config: LossConfigT, logprob, entropy, advantages, response_mask, threshold, seed):
    """As many uniformly random response tokens as S2T silences in this micro-batch: the
    control that asks whether silencing any handful of tokens does the same."""
    num_silenced = int(_stapo_mask(config, logprob, entropy, advantages, response_mask, threshold, seed).sum())
    return masks.random_mask(response_mask, num_silenced, _micro_seed(config, seed))


# -- the registry -------------------------------------------------------------------------------

METHODS: Dict[str, Method] = {m.name: m for m in (
    Method("stapo", "S2T mask: silence A > 0, p < tau_p, H < tau_H (the paper's method)",
           _stapo_mask, _s2t_threshold),
    Method("justrl", "the JustRL/DAPO objective STAPO builds on (token mean, clip-higher), nothing silenced",
           _no_mask),
    Method("grpo", "DeepSeekMath GRPO: per-sequence mean, symmetric clip 0.2, k3 KL (beta 0.04) to a frozen reference",
           _no_mask, loss_options=dict(clip_ratio_high=0.2, clip_ratio_c=None, kl_coef=0.04),
           loss_agg="seq_mean_token_mean", objective="grpo"),
    Method("entropy20", "keep only the top-20% entropy response tokens (Beyond the 80/20 rule)",
           _entropy20_mask, _entropy20_threshold),
    Method("random", "silence as many S2T candidates (A > 0, p < tau_p), drawn at random, as S2T would (control)",
           _random_candidates_mask, _s2t_threshold),
    Method("random_uniform", "silence as many random response tokens as S2T would (control)",
           _random_uniform_mask, _s2t_threshold),
)}
"""Every method, by name, in the order tables and comparisons list them (stapo first)."""


METHOD_ATTRIBUTE = "stapo_method"
"""The attribute `register_method` sets on the function it decorates: its `Method`."""


def register_method(name: str, summary: str = "", threshold: Optional[ThresholdFn] = None,
                    loss_options: Optional[Mapping[str, Any]] = None, loss_agg: str = "token_mean"):
    """Decorator: register the mask function it decorates as the `Method` ``name`` in `METHODS`.

    The function is returned unchanged (still callable) with its `Method` as the attribute
    `METHOD_ATTRIBUTE`, so a dotted path to it (``loss.method=pkg.module:fn``) finds the method.
    ``summary`` defaults to the first line of the function's docstring. A name already taken by
    another function is a ValueError (re-importing the same module registers it again, harmlessly).

    Example::

        @register_method("positive_only", loss_options=dict(clip_ratio_high=0.2))
        def positive_only(config, logprob, entropy, advantages, response_mask, threshold, seed):
            \"\"\"Silence every token of a below-mean response.\"\"\"
            return response_mask & (advantages < 0)
    """
    def register(mask: MaskFn) -> MaskFn:
        line = summary or (mask.__doc__ or name).strip().splitlines()[0]
        method = Method(name, line, mask, threshold, dict(loss_options or {}), loss_agg)
        taken = METHODS.get(name)
        if taken is not None and qualname(taken.mask) != qualname(mask):
            raise ValueError(f"method {name!r} is already registered (by {qualname(taken.mask)}); "
                             f"choose another name for {qualname(mask)}")
        METHODS[name] = method
        setattr(mask, METHOD_ATTRIBUTE, method)
        return mask
    return register


def method_from_object(obj: Any, path: str) -> Method:
    """The `Method` a dotted path names: a `Method`, a function decorated with `register_method`,
    or a plain mask function (a method called ``path`` with no threshold and no options)."""
    if isinstance(obj, Method):
        return obj
    if callable(obj):
        return getattr(obj, METHOD_ATTRIBUTE, None) or Method(
            path, (obj.__doc__ or path).strip().splitlines()[0], obj)
    raise ValueError(f"loss.method = {path!r} names a {type(obj).__name__}, not a Method or a mask function "
                     f"(config, logprob, entropy, advantages, response_mask, threshold, seed) -> bool [B, S]")


def get_method(name: str) -> Method:
    """The `Method` called ``name`` (a name of `METHODS`), or named by a dotted path
    ``pkg.module:fn`` / ``pkg.module.fn`` (`method_from_object`); a ValueError naming the valid
    names (and the closest) for an unknown name, or naming the path for one that does not import."""
    return lookup_registered(name, METHODS, "loss.method", method_from_object)
