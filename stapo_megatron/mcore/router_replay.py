"""Router replay ("R3", arXiv 2510.11370; Megatron-LM #4168) for mixture-of-experts policies:
training's forwards send every token to the experts the rollout engine chose for it.

What is replayed. A micro-batch carries the rollout's routes per position
(``MicroBatch.routes`` [B, S, L, K], `stapo_megatron.batch.microbatch`). Before the model runs,
each MoE router of *this* model (megatron-core's ``TopKRouter.router_replay``, a
``RouterReplay`` built when ``TransformerConfig.moe_enable_routing_replay`` is set) gets its
layer's indices as the replay target; megatron-core's ``topk_routing_with_score_function`` then
takes those indices instead of its own top-k and gathers the router's scores at them (with
``moe_router_pre_softmax=False``, Qwen3-MoE's renormalised gates: a softmax over the K gathered
logits), so the gate weights, and the router weights' gradients, are still the router's own.
megatron-core's class-level ``RouterReplay.global_router_replay_instances`` is not used: it holds
the routers of every model built in the process (tests build many; a GRPO run builds a frozen
reference whose routers must not replay).

Which positions. Megatron's router flattens its input [S_local, B, H] sequence-major: token
``s * B + b``. Under context parallelism the micro-batch is already CP rank r's part of the
packed row (`stapo_megatron.batch.context_parallel.split_for_context_parallel` takes ``routes``
at the same positions as the tokens), so the routes need no further CP slicing. With sequence parallelism a TP rank's routers see its 1/TP slice of the
sequence (S_local = S / TP, rank r the r-th slice), without it all of S (every TP rank routes
every token). Expert parallelism dispatches after routing, so each rank routes its own tokens
as without EP. A pipeline stage holds only its layers: a router takes layer
``router.layer_number - 1`` (megatron-core's global 1-based number) of the routes.

The filler. Where the rollout forwarded nothing (`microbatch.NO_ROUTE`: the last token of each
sequence, whose output predicts past the end, and padding) a position gets the K distinct experts
``(t K + j) mod E``, j < K, t its index in the whole micro-batch, sequence-major s B + b, or
its position in the packed row for a context-parallel part (`routed_positions`): spread over
experts and EP ranks instead of piled onto expert 0, and the same whatever the TP/CP split.
Harmless for the policy loss: no loss term reads those positions (label masked,
``response_mask`` False), and causal attention within a sequence (THD keeps sequences apart)
means no real token attends to them. Not invisible to the load-balancing aux loss: megatron-core
computes it from every routed token's own (unreplayed) top-k and probabilities, and a filler
position's expert output enters its later layers' inputs, hence its router probabilities there.
That is why the filler must not depend on the layout (with each CP rank's local index the
weights after a replayed update at CP=2 differed from CP=1's, `tests/integration/test_moe_context_parallel.py`);
the expert-load metrics count it too.

Recomputation. Full activation recomputation reruns each layer's router in the backward pass,
after later micro-batches' forwards under pipelining. `set_replay_targets` appends each
micro-batch's targets to megatron-core's FIFO (``RouterReplay.replay_backward_list``, filled by
``set_target_indices``); `replay_backward` switches the routers to ``REPLAY_BACKWARD`` once the
micro-batch's forward is done, so the recomputed forward pops that micro-batch's own indices
(micro-batches' backwards run in their forward order). Without recomputation (or without
gradients) it drops the micro-batch's targets right after its forward instead. `clear_replay`
empties the targets, the FIFO and the action after every pass (also after an error), so
nothing grows across micro-batches or steps. With ``recompute_method="block"`` the routers of
layers past ``recompute_num_layers`` are never rerun and keep their entries until the pass ends.

Legend: B, S as in batching; N = tokens one router sees; L = MoE layers, K = top-k, E = experts.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from stapo_megatron.batch.microbatch import NO_ROUTE, MicroBatch
from stapo_megatron.batch.context_parallel import local_positions


def replay_routers(model) -> List[Tuple[int, object]]:
    """(0-based global layer index, megatron-core ``RouterReplay``) of every MoE router of
    ``model`` (any wrapper; this pipeline stage's layers).

    Raises:
        ValueError: a router without ``router_replay`` (the model was not built with
            ``moe_enable_routing_replay``), or no MoE router at all.
    """
    from stapo_megatron.mcore.moe import routers

    found = routers(model)
    if not found:
        raise ValueError("router replay needs a mixture-of-experts model; this one has no MoE router")
    if any(r.router_replay is None for r in found):
        raise ValueError("router replay needs a model built with moe_enable_routing_replay=True "
                         "(rollout.routing_replay; bridge.build_gpt_model)")
    return [(int(r.layer_number) - 1, r.router_replay) for r in found]


def local_routes(routes_BSLK: torch.Tensor, tp_rank: int = 0, tp_size: int = 1,
                 sequence_parallel: bool = False) -> torch.Tensor:
    """The routes in the order a router of this TP rank sees its tokens: [N, L, K], N = S_local
    x B sequence-major (module docstring); S / TP positions per rank with sequence parallelism."""
    routes_SBLK = routes_BSLK.transpose(0, 1)
    if sequence_parallel and tp_size > 1:
        S = routes_SBLK.shape[0]
        if S % tp_size:
            raise ValueError(f"sequence parallelism: {S} positions do not split over {tp_size} TP ranks")
        local = S // tp_size
        routes_SBLK = routes_SBLK[tp_rank * local:(tp_rank + 1) * local]
    return routes_SBLK.reshape(-1, *routes_SBLK.shape[2:])


def fill_missing(routes_NLK: torch.Tensor, num_experts: int, index_N: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 routes with every `NO_ROUTE` position given the filler experts (t K + j) mod E, t
    from ``index_N`` (default: the index in ``routes_NLK``; module docstring)."""
    N, _, K = routes_NLK.shape
    if K > num_experts:
        raise ValueError(f"top-k {K} > {num_experts} experts")
    t_N = torch.arange(N, device=routes_NLK.device) if index_N is None else index_N.to(routes_NLK.device)
    filler_NK = (t_N[:, None] * K + torch.arange(K, device=routes_NLK.device)) % num_experts
    routes = routes_NLK.long()
    return torch.where(routes == NO_ROUTE, filler_NK[:, None, :], routes)


def routed_positions(batch: MicroBatch, cp_rank: int = 0) -> torch.Tensor:
    """[B, S] int64: each position's index in the whole micro-batch, sequence-major s B + b; for
    CP rank ``cp_rank``'s part of a packed row (B = 1), its positions in the row."""
    B, S = batch.tokens.shape
    if batch.cp_size > 1:
        return local_positions(batch.cu_seqlens.cpu(), batch.cp_size, cp_rank)[None]
    return torch.arange(S)[None] * B + torch.arange(B)[:, None]


def replay_indices(batch: MicroBatch, num_experts: int, tp_rank: int = 0, tp_size: int = 1,
                   sequence_parallel: bool = False, cp_rank: int = 0) -> torch.Tensor:
    """[N, L, K] int64: the experts a router of this TP / CP rank replays for ``batch``
    (`local_routes`, `NO_ROUTE` given the filler of `routed_positions`)."""
    routes_NLK = local_routes(batch.routes, tp_rank, tp_size, sequence_parallel)
    index_N = local_routes(routed_positions(batch, cp_rank)[..., None, None], tp_rank, tp_size,
                           sequence_parallel).reshape(-1)
    return fill_missing(routes_NLK, num_experts, index_N)


def set_replay_targets(model, batch: MicroBatch) -> None:
    """Give every MoE router of ``model`` this micro-batch's routes as its replay target (and
    FIFO entry for a recomputation), action ``REPLAY_FORWARD``.

    Raises:
        ValueError: the micro-batch carries no routes, or routes not [B, S] like its tokens, for
            fewer layers than the model has or another top-k (megatron-core would gather with
            them: a short index silently leaves tokens unrouted).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    if batch.routes is None:
        raise ValueError("router replay is on but the micro-batch carries no routes (MicroBatch.routes)")
    if batch.routes.dim() != 4 or batch.routes.shape[:2] != batch.tokens.shape:
        raise ValueError(f"routes {tuple(batch.routes.shape)} are not [B, S, layers, top_k] over the tokens "
                         f"{tuple(batch.tokens.shape)}")
    replays = replay_routers(model)
    config = _unwrap_config(model)
    routes_NLK = replay_indices(batch, config.num_moe_experts, ps.get_tensor_model_parallel_rank(),
                                ps.get_tensor_model_parallel_world_size(), bool(config.sequence_parallel),
                                ps.get_context_parallel_rank())
    num_layers = routes_NLK.shape[1]
    if max(layer for layer, _ in replays) >= num_layers:
        raise ValueError(f"routes cover {num_layers} MoE layers, the model has layer "
                         f"{max(layer for layer, _ in replays)} (0-based)")
    if routes_NLK.shape[2] != config.moe_router_topk:
        raise ValueError(f"routes hold top-{routes_NLK.shape[2]} experts, the model routes top-{config.moe_router_topk}")
    routes_NLK = routes_NLK.to(batch.tokens.device)
    for layer, replay in replays:
        replay.set_target_indices(routes_NLK[:, layer].contiguous())
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def replay_backward(model) -> None:
    """After a micro-batch's forward: if its backward reruns the routers (activation
    recomputation with gradients on), a recomputation pops its targets in order; otherwise its
    targets are dropped at once (they would sit in the FIFO, N x L x K int64 on the device, until
    the pass ends)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    config = _unwrap_config(model)
    # full: TransformerBlock checkpoints only in training mode; selective "moe": MoELayer
    # checkpoints whatever the mode in 0.16.1 (0.19.2 in training mode; keeping the FIFO there
    # costs memory, not correctness)
    recomputes = torch.is_grad_enabled() and (
        (config.recompute_granularity == "full" and model.training)
        or (config.recompute_granularity == "selective" and "moe" in (config.recompute_modules or ())))
    for _, replay in replay_routers(model):
        if recomputes:
            replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        else:
            replay.clear_indices()
            replay.clear_router_replay_action()


def clear_replay(model) -> None:
    """After a pass: no targets, no FIFO entries, no action (the routers route on their own)."""
    for _, replay in replay_routers(model):
        replay.clear_indices()
        replay.clear_router_replay_action()


def _unwrap_config(model):
    """The TransformerConfig of a (DDP / Float16Module-wrapped) GPTModel."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model.config
