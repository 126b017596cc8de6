"""Mixture-of-experts training: the load-balancing aux loss's weight under the STAPO normaliser,
and the expert-load / aux-loss metrics of a step.

Aux-loss weight. Megatron's router attaches its per-layer switch loss ``aux_l`` (coefficient
``moe_aux_loss_coeff`` = c included) to the MoE output with ``MoEAuxLossAutoScaler``, whose
backward feeds ``scale * aux_l`` (``scale``: a class-level tensor the schedule sets after each
micro-batch's ``loss_func``). With ``calculate_per_token_loss`` the router pre-multiplies
``aux_l`` by its token count, ``n_router`` (megatron-core 0.16-0.18 ``router.py``
``attach_and_log_load_balancing_loss``: the micro-batch's routed tokens on this rank; 0.19.0 and
later: that times the TP x CP group size, `mcore.mcore_versions`), because ``finalize_model_grads`` divides every gradient by
the all-reduced token count, which upstream assumes is every token of every micro-batch:

    grad_aux (upstream) = sum_{mb, dp} c * n_router * grad aux_l(mb) / N

The STAPO normaliser N counts kept response tokens only (``mcore/loss.py``), so upstream's
weight would be c * (all tokens / kept tokens): larger than c by the prompt, padding and
silenced share, and moving with the STAPO mask. `MoEStepMonitor.scaled_loss` fixes it: at the start of
a micro-batch's backward (the loss node runs before any MoE layer's) it sets the scale to
``n_mb / n_router`` (n_mb: the micro-batch's share of N, what its ``loss_func`` returned), so

    grad_aux = sum_{mb, dp} (n_mb / N) * c * grad aux_l(mb),   sum_{mb, dp} n_mb / N = 1:

exactly c times the aux loss for one micro-batch, and in general c times the kept-token-weighted
mean of the micro-batches' aux losses; the weights sum to one whatever the mask silences.
Pipeline parallelism: only the last stage runs ``loss_func``; the MoE layers of earlier stages
keep upstream's weight (warned).

Context parallelism. CP rank r routes only its chunks of every sequence (t = T / CP of the
micro-batch's T tokens). megatron-core (0.16.1 and 0.19.2, ``_apply_aux_loss``) all-reduces
the routed counts over the router's ``tp_cp_group`` and takes T_tot = t x |tp_cp| tokens, so
rank r's loss is its share of the micro-batch's switch loss:

    aux_l^r = E c / (k T_tot^2) sum_e f_e P_e^r,   f_e = tokens routed to e in the whole row,
    P_e^r = sum of rank r's router probabilities for e;   sum_r aux_l^r = aux_l(mb)

What "the aux loss" is under CP: aux_l(mb), the switch loss of the whole packed row (whole-row
statistics f and P, not per-chunk ones), the same function of the row's tokens as at CP=1.
The row itself differs: CP pads every sequence to a multiple of 2 x CP, and megatron-core routes
and counts that padding like any token (no padding mask is passed), so the aux loss of the same
sequences packed for CP=1 without that padding is a slightly different number (and with
``packing="budget"`` a CP run packs rows of up to CP x the per-rank budget, other micro-batches
than a CP=1 run of the same config: the aux loss is per micro-batch). The target here
is megatron-core's aux_l(mb) of the row as trained, with total weight exactly c; tested against
CP=1 on rows padded alike. Each rank's backward feeds its own aux_l^r, DDP sums the gradients
over DP x CP, and ``finalize_model_grads`` divides by N. So the fix needs, on every CP rank,
the micro-batch's kept count over the whole row, n_mb = sum_r n_mb^r: `scaled_loss`
all-reduces the loss function's count over CP (one scalar per micro-batch; the count Megatron
sees is unchanged) and sets the scale to n_mb / n_router^r, giving

    grad_aux = sum_{mb, dp} sum_r (n_mb / N) grad aux_l^r = sum_{mb, dp} (n_mb / N) grad aux_l(mb):

CP=2 gives CP=1's gradient on the same rows (``tests/integration/test_moe_context_parallel.py``). With the
per-rank n_mb^r the weights would follow each chunk's kept tokens instead. The metrics count the
same way: `MoEStepMonitor` keeps per micro-batch and layer the routed counts and probability sums
of this rank's tokens and reduces them over CP before forming the switch loss; expert loads are
summed over DP x CP.

Legend: ``T`` routed tokens of a micro-batch on this rank, ``E`` experts, ``M`` micro-batches,
``L`` MoE layers of this stage.
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from stapo_megatron.mcore.mcore_versions import in_backward, router_aux_loss_token_factor


def routers(model) -> list:
    """The MoE routers (megatron-core ``TopKRouter``) of a (DDP-wrapped) model, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


class _AuxScaleAtBackward(torch.autograd.Function):
    """Identity on the micro-batch's loss; its backward (the first of the micro-batch's backward)
    sets ``MoEAuxLossAutoScaler``'s scale to ``schedule scale * n_mb / n_router``."""

    @staticmethod
    def forward(ctx, loss, ratio):
        ctx.save_for_backward(ratio)
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

        (ratio,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        if scale is None:
            scale = torch.ones(1, device=ratio.device)  # the schedule's shape (schedules.py)
        # set_loss_scale copies into the stored tensor in place: keep its shape
        MoEAuxLossAutoScaler.set_loss_scale((scale * ratio.to(scale.device, scale.dtype)).reshape(scale.shape))
        return grad, None


class MoEStepMonitor:
    """Forward hooks on a model's routers: the routed-token count of the current micro-batch
    (for the aux-loss weight) and, per micro-batch and layer, this rank's tokens per expert and
    router-probability sums (the switch loss's f and P before the CP reduction).

    Use as a context manager around a policy update; ``metrics()`` reduces over the groups.

    Args:
        model: the (DDP-wrapped) GPTModel.
        cp_group: the context-parallel group whose ranks hold the other chunks of the same
            micro-batches (None or size 1: no CP).
    """

    def __init__(self, model, cp_group: Optional[dist.ProcessGroup] = None):
        self.routers = routers(model)
        self.is_moe = bool(self.routers)
        self.cp_group = cp_group if cp_group is not None and dist.get_world_size(cp_group) > 1 else None
        # per layer, per micro-batch: [2E + 1] = (tokens per expert, probability sums, tokens)
        self.stats: List[List[torch.Tensor]] = [[] for _ in self.routers]
        self.router_tokens = 0
        self._token_factor = router_aux_loss_token_factor(self.routers[0]) if self.routers else 1
        self._handles = []
        if self.is_moe and self.routers[0].config.pipeline_model_parallel_size > 1:
            warnings.warn("pipeline parallelism with MoE: only the last stage's MoE layers get the aux-loss weight "
                          "of stapo_megatron.mcore.moe; earlier stages keep megatron-core's (c * all tokens / kept)")

    def __enter__(self) -> "MoEStepMonitor":
        for i, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, i: int) -> Callable:
        def hook(router, inputs, output):
            if in_backward():
                # a forward rerun inside backward (activation recomputation): the micro-batch was
                # counted at its forward; counting it again doubles the loads (torch's FSDP tells
                # "in backward" the same way)
                return
            hidden = inputs[0]
            routing_map_TE = output[1]
            with torch.no_grad():
                logits_TE = hidden.reshape(-1, hidden.shape[-1]).float() @ router.weight.float().t()
                T = routing_map_TE.shape[0]
                self.stats[i].append(torch.cat([routing_map_TE.sum(0).float(), torch.softmax(logits_TE, -1).sum(0),
                                                torch.tensor([float(T)], device=logits_TE.device)]))
            self.router_tokens = T * self._token_factor

        return hook

    def scaled_loss(self, loss_fn: Callable) -> Callable:
        """``loss_fn`` (a Megatron loss_func returning (loss_sum, n_mb, metrics)) with the loss
        routed through the aux-loss weight fix (module docstring: n_mb summed over CP); unchanged
        for dense models."""
        if not self.is_moe:
            return loss_fn

        def wrapped(*args, **kwargs):
            loss, n_mb, metrics = loss_fn(*args, **kwargs)
            n_row = n_mb.detach().float().clone()
            if self.cp_group is not None:  # the whole row's kept tokens: every CP rank weights its share alike
                dist.all_reduce(n_row, group=self.cp_group)
            ratio = n_row / float(self.router_tokens)
            return _AuxScaleAtBackward.apply(loss, ratio), n_mb, metrics

        return wrapped

    def metrics(self, dp_group: Optional[dist.ProcessGroup] = None) -> Dict[str, float]:
        """Per MoE layer (global 0-based index; with pipeline parallelism each stage reports its
        own layers, and ``moe/aux_loss`` sums this stage's): ``moe/layer{i}/max_load`` and
        ``mean_load`` (tokens per expert over the step's micro-batches and the ``dp_group``
        ranks, DP x CP under CP; the mean is tokens x top-k / E), ``max_over_mean`` (1 =
        perfectly balanced) and ``aux_loss`` (Megatron's switch loss of each whole micro-batch,
        without its coefficient, averaged over micro-batches and DP ranks); ``moe/aux_loss``
        sums the layers. Collective over the CP group (when set) and ``dp_group``."""
        out: Dict[str, float] = {}
        layers = [i for i, stats in enumerate(self.stats) if stats]
        if not layers:
            return out
        stats_LMX = torch.stack([torch.stack(self.stats[i]) for i in layers])
        if self.cp_group is not None:  # the whole rows: f and P of every chunk of each micro-batch
            dist.all_reduce(stats_LMX, group=self.cp_group)
        E = (stats_LMX.shape[-1] - 1) // 2
        tokens_LME, probs_LME, T_LM = stats_LMX[..., :E], stats_LMX[..., E:2 * E], stats_LMX[..., -1]
        k = torch.tensor([float(self.routers[i].topk) for i in layers], device=stats_LMX.device)[:, None]
        # megatron-core's switch_load_balancing_loss_func without the coefficient, per micro-batch
        aux_LM = E * (probs_LME * tokens_LME).sum(-1) / (T_LM * T_LM * k)
        # loads: this rank's own tokens (after the CP reduction every CP rank holds the row's)
        local_LE = torch.stack([torch.stack(self.stats[i])[:, :E].sum(0) for i in layers])
        summed = torch.cat([local_LE, aux_LM.mean(1, keepdim=True)], dim=1)
        world = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        if world > 1:
            dist.all_reduce(summed, group=dp_group)
        total_aux = 0.0
        for row, i in zip(summed, layers):
            layer = self.routers[i].layer_number - 1  # megatron-core numbers layers from 1
            # the aux of a micro-batch is the same on its CP ranks: the mean over dp_group's ranks is over DP
            tokens_E, aux = row[:-1], float(row[-1]) / world
            mean = float(tokens_E.mean())
            out[f"moe/layer{layer}/max_load"] = float(tokens_E.max())
            out[f"moe/layer{layer}/mean_load"] = mean
            out[f"moe/layer{layer}/max_over_mean"] = float(tokens_E.max()) / mean if mean > 0 else float("nan")
            out[f"moe/layer{layer}/aux_loss"] = aux
            total_aux += aux
        out["moe/aux_loss"] = total_aux
        return out
