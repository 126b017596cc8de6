"""Mixture-of-experts training: the load-balancing aux loss's weight under the STAPO normaliser,
and the expert-load / aux-loss metrics of a step.

Aux-loss weight. Megatron's router attaches its per-layer switch loss ``aux_l`` (coefficient
``moe_aux_loss_coeff`` = c included) to the MoE output with ``MoEAuxLossAutoScaler``, whose
backward feeds ``scale * aux_l`` (``scale``: a class-level tensor the schedule sets after each
micro-batch's ``loss_func``). With ``calculate_per_token_loss`` the router pre-multiplies
``aux_l`` by its token count, ``n_router`` (megatron-core 0.16.1 ``router.py``
``attach_and_log_load_balancing_loss``: the micro-batch's routed tokens on this rank; 0.19.2:
that times the TP x CP group size), because ``finalize_model_grads`` divides every gradient by
the all-reduced token count, which upstream assumes is every token of every micro-batch:

    grad_aux (upstream) = sum_{mb, dp} c * n_router * grad aux_l(mb) / N

The STAPO normaliser N counts kept response tokens only (``train/loss.py``), so upstream's
weight would be c * (all tokens / kept tokens): larger than c by the prompt, padding and
silenced share, and moving with the STAPO mask. `scaled_for_moe_aux` fixes it: at the start of
a micro-batch's backward (the loss node runs before any MoE layer's) it sets the scale to
``n_mb / n_router`` (n_mb: the micro-batch's share of N, what its ``loss_func`` returned), so

    grad_aux = sum_{mb, dp} (n_mb / N) * c * grad aux_l(mb),   sum_{mb, dp} n_mb / N = 1:

exactly c times the aux loss for one micro-batch, and in general c times the kept-token-weighted
mean of the micro-batches' aux losses; the weights sum to one whatever the mask silences.
Pipeline parallelism: only the last stage runs ``loss_func``; the MoE layers of earlier stages
keep upstream's weight (warned).

Legend: ``T`` routed tokens of a micro-batch on this rank, ``E`` experts.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist


def routers(model) -> list:
    """The MoE routers (megatron-core ``TopKRouter``) of a (DDP-wrapped) model, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def router_token_factor(router) -> int:
    """What megatron-core multiplies the aux loss by per routed token under
    ``calculate_per_token_loss``: 1 (0.16.1) or the TP x CP group size (0.19.2, where
    ``attach_and_log_load_balancing_loss`` multiplies by ``num_local_tokens *
    tp_cp_group.size()``). Read from the installed source, since the two versions differ."""
    source = inspect.getsource(type(router).attach_and_log_load_balancing_loss)
    return router.tp_cp_group.size() if "tp_cp_group.size()" in source else 1


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
    (for the aux-loss weight) and, per layer, tokens per expert and the aux loss (Megatron's
    switch loss without its coefficient), summed over the micro-batches of a step.

    Use as a context manager around a policy update; ``metrics()`` reduces over ``dp_group``.
    """

    def __init__(self, model):
        self.routers = routers(model)
        self.is_moe = bool(self.routers)
        self.tokens_per_expert: List[Optional[torch.Tensor]] = [None] * len(self.routers)
        self.aux_loss: List[float] = [0.0] * len(self.routers)
        self.num_microbatches = [0] * len(self.routers)
        self.router_tokens = 0
        self._token_factor = router_token_factor(self.routers[0]) if self.routers else 1
        self._handles = []
        if self.is_moe and self.routers[0].config.pipeline_model_parallel_size > 1:
            warnings.warn("pipeline parallelism with MoE: only the last stage's MoE layers get the aux-loss weight "
                          "of stapo_megatron.train.moe; earlier stages keep megatron-core's (c * all tokens / kept)")

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
            if torch._C._current_graph_task_id() != -1:
                # a forward rerun inside backward (activation recomputation): the micro-batch was
                # counted at its forward; counting it again doubles the loads (torch's FSDP tells
                # "in backward" the same way)
                return
            hidden = inputs[0]
            routing_map_TE = output[1]
            with torch.no_grad():
                tokens_E = routing_map_TE.sum(0).float()
                logits_TE = hidden.reshape(-1, hidden.shape[-1]).float() @ router.weight.float().t()
                probs_TE = torch.softmax(logits_TE, -1)
                T, E, k = routing_map_TE.shape[0], routing_map_TE.shape[1], router.topk
                # megatron-core switch_load_balancing_loss_func without the coefficient
                aux = E * (probs_TE.sum(0) * tokens_E).sum() / (T * T * k)
            prev = self.tokens_per_expert[i]
            self.tokens_per_expert[i] = tokens_E if prev is None else prev + tokens_E
            self.aux_loss[i] += float(aux)
            self.num_microbatches[i] += 1
            self.router_tokens = T * self._token_factor

        return hook

    def scaled_loss(self, loss_fn: Callable) -> Callable:
        """``loss_fn`` (a Megatron loss_func returning (loss_sum, n_mb, metrics)) with the loss
        routed through the aux-loss weight fix (module docstring); unchanged for dense models."""
        if not self.is_moe:
            return loss_fn

        def wrapped(*args, **kwargs):
            loss, n_mb, metrics = loss_fn(*args, **kwargs)
            ratio = n_mb.detach().float() / float(self.router_tokens)
            return _AuxScaleAtBackward.apply(loss, ratio), n_mb, metrics

        return wrapped

    def metrics(self, dp_group: Optional[dist.ProcessGroup] = None) -> Dict[str, float]:
        """Per MoE layer (global 0-based index; with pipeline parallelism each stage reports its
        own layers, and ``moe/aux_loss`` sums this stage's): ``moe/layer{i}/max_load`` and
        ``mean_load`` (tokens per expert over the step's micro-batches and DP ranks; the mean is
        tokens x top-k / E), ``max_over_mean`` (1 = perfectly balanced) and ``aux_loss`` (mean
        over micro-batches and DP ranks); ``moe/aux_loss`` sums the layers."""
        out: Dict[str, float] = {}
        world = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        total_aux = 0.0
        for i, tokens_E in enumerate(self.tokens_per_expert):
            if tokens_E is None:
                continue
            layer = self.routers[i].layer_number - 1  # megatron-core numbers layers from 1
            aux = torch.tensor([self.aux_loss[i] / self.num_microbatches[i]], device=tokens_E.device)
            stats = torch.cat([tokens_E, aux])
            if world > 1:
                dist.all_reduce(stats, group=dp_group)
            tokens_E, aux = stats[:-1], float(stats[-1]) / world
            mean = float(tokens_E.mean())
            out[f"moe/layer{layer}/max_load"] = float(tokens_E.max())
            out[f"moe/layer{layer}/mean_load"] = mean
            out[f"moe/layer{layer}/max_over_mean"] = float(tokens_E.max()) / mean if mean > 0 else float("nan")
            out[f"moe/layer{layer}/aux_loss"] = aux
            total_aux += aux
        if out:
            out["moe/aux_loss"] = total_aux
        return out
