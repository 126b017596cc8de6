"""Routing disagreement between rollout and training, for mixture-of-experts policies.

The sampler drew a token from the engine's forward, in which each MoE layer sent every token to
its router's top-k experts; training recomputes the same tokens' log-probs in Megatron, whose
router (same weights after the sync, other kernels and dtype) may pick a different top-k set
for a token whose k-th and (k+1)-th router logits nearly tie. Each such flip changes the
expert mixture, hence pi_old versus the sampler's log-prob: the train/rollout mismatch that
router replay (Megatron-LM #4168, vLLM's "R3" routed-experts output) removes by forcing
training to reuse the rollout's routes. This module measures how often it happens.

Per MoE layer l, over every token t both sides forwarded (the prompt and the response but its
last token, `stapo_megatron.rollout.base.Sample.routed_experts`):

    disagreement_l = #{t : topk_rollout(t, l) != topk_train(t, l) as sets} / #{t}
    expert_mismatch = sum_{t,l} |topk_rollout(t, l) \\ topk_train(t, l)| / (K * #{(t, l)})

The step logs the mean and the max of disagreement_l over layers and expert_mismatch, summed over
every rank's samples, and the rollout's expert load (``rollout_expert_load_max``: max over layers of
the busiest expert's token count over the mean count; 1 is balanced). The training side is a no-grad forward of this rank's samples through the
policy (`RoutingMonitor.measure`, padded micro-batches, any TP/PP/EP layout; context
parallelism is refused) with forward hooks on the Megatron routers, which return
``(probs, routing_map)``, ``routing_map`` [S_local * B, E] boolean over the sequence-major tokens
of the micro-batch (S_local = S / TP with sequence parallelism).

Legend: T = positions, L = MoE layers, K = experts per token, E = experts, S = padded sequence,
B = micro-batch rows.
"""

from __future__ import annotations

import time
import warnings
from functools import partial
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from stapo_megatron.bridge.config import spec_from_hf_config
from stapo_megatron.train.batching import pack_sequences, split_microbatches
from stapo_megatron.train.parallel import collective_device
from stapo_megatron.train.schedule import run_microbatches


def route_disagreement(rollout_TLK: torch.Tensor, train: torch.Tensor,
                       num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per (token, layer): whether the two top-k sets differ, and how many rollout experts
    training did not pick.

    Args:
        rollout_TLK: expert indices [T, L, K] (any order within K).
        train: the same layout of indices, or a boolean expert map [T, L, E].
        num_experts: E.
    Returns:
        ``(differ_TL, missed_TL)``: bool, and the count of ``rollout`` experts outside ``train``.
    """
    rollout_map = _expert_map(rollout_TLK, num_experts)
    train_map = _expert_map(train, num_experts)
    if rollout_map.shape != train_map.shape:
        raise ValueError(f"rollout routes {tuple(rollout_TLK.shape)} and training routes {tuple(train.shape)} "
                         f"do not cover the same tokens and layers")
    return (rollout_map != train_map).any(-1), (rollout_map & ~train_map).sum(-1)


def _expert_map(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    if routes.dtype == torch.bool:
        return routes
    out = torch.zeros(*routes.shape[:-1], num_experts, dtype=torch.bool, device=routes.device)
    return out.scatter_(-1, routes.long(), True)


class RouterCapture:
    """Forward hooks on the routers of a Megatron GPTModel (any wrapper): ``maps[layer]`` is the
    list of ``routing_map`` outputs [tokens, E] of that global layer, one per forward."""

    def __init__(self, model):
        from stapo_megatron.rollout.weight_sync import _unwrap  # the same unwrapping as the sync

        self.maps: Dict[int, List[torch.Tensor]] = {}
        self.handles = []
        for layer in _unwrap(model).decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                index = int(layer.layer_number) - 1  # 1-based global
                self.maps[index] = []
                self.handles.append(router.register_forward_hook(self._hook(index)))

    def _hook(self, index: int):
        def record(module, args, output):
            self.maps[index].append(output[1].detach())  # (probs, routing_map)
        return record

    def __enter__(self) -> "RouterCapture":
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


def _zero_loss(batch, output):
    zero = torch.zeros((), dtype=torch.float32, device=output.device)
    return zero, torch.zeros((), dtype=torch.int, device=output.device), {}


def routing_counts(model, prompts: List[List[int]], samples: List, num_experts: int, micro_batch_size: int,
                   pad_id: int, seq_multiple: int = 8) -> torch.Tensor:
    """This rank's share of the disagreement sums: a no-grad forward of ``prompts[i] +
    samples[i].token_ids`` (padded micro-batches) through ``model`` with `RouterCapture`.

    Every rank of the job calls it with its own samples (those of a model-parallel group equal);
    the caller sums the result over the world.

    Returns:
        [3, L] float64 on the CPU: per layer the (token, layer) sets that differ, the rollout
        experts training did not pick, and the tokens compared. With TP and no sequence
        parallelism only TP rank 0 counts (every TP rank routes every token).
    """
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() > 1:
        raise ValueError("routing disagreement does not support context parallelism yet; "
                         "set rollout.routing_every=0")
    routes = [s.routed_experts for s in samples]
    seq = max(len(p) + len(s.token_ids) for p, s in zip(prompts, samples))
    seq += -seq % seq_multiple
    device = next(model.parameters()).device
    batch = pack_sequences(prompts, [s.token_ids for s in samples], [0.0] * len(samples),
                           [s.logprobs for s in samples], pad_id, seq, device=device)
    mbs = micro_batch_size if len(samples) % micro_batch_size == 0 else 1
    with RouterCapture(model) as capture, torch.no_grad():
        run_microbatches(model, split_microbatches(batch, mbs, seed=0), seq, lambda b: partial(_zero_loss, b),
                         forward_only=True)
    num_layers = routes[0].shape[1]
    if capture.maps and max(capture.maps) >= num_layers:
        raise ValueError(f"rollout routes cover {num_layers} MoE layers, the policy has layer {max(capture.maps)}")
    counts_3L = torch.zeros(3, num_layers, dtype=torch.float64)
    sequence_split = ps.get_tensor_model_parallel_world_size() > 1 and bool(model.config.sequence_parallel)
    tp_rank = ps.get_tensor_model_parallel_rank()
    if not sequence_split and tp_rank != 0:
        return counts_3L
    for layer, maps in capture.maps.items():
        for j, map_NE in enumerate(maps):
            local = map_NE.shape[0] // mbs  # this rank's positions (S, or S / TP when split)
            first = tp_rank * local if sequence_split else 0
            map_SBE = map_NE.view(local, mbs, -1).cpu()
            for b in range(mbs):
                r_TLK = routes[j * mbs + b]
                end = min(first + local, r_TLK.shape[0])
                if end > first:
                    differ, missed = route_disagreement(r_TLK[first:end, layer], map_SBE[: end - first, b], num_experts)
                    counts_3L[:, layer] += torch.tensor([differ.sum(), missed.sum(), end - first], dtype=torch.float64)
    return counts_3L


def rollout_expert_load(samples: List, num_experts: int) -> torch.Tensor:
    """[L, E] float64: how many of this rank's forwarded tokens the engine sent to each expert
    of each layer (from ``Sample.routed_experts``)."""
    load_LE = torch.zeros(samples[0].routed_experts.shape[1], num_experts, dtype=torch.float64)
    for s in samples:
        routes_TLK = s.routed_experts.long()
        load_LE.scatter_add_(1, routes_TLK.transpose(0, 1).reshape(load_LE.shape[0], -1),
                             torch.ones(routes_TLK.shape[1], routes_TLK.shape[0] * routes_TLK.shape[2], dtype=torch.float64))
    return load_LE


def routing_metrics(counts_3L: torch.Tensor, top_k: int) -> Dict[str, float]:
    """The logged metrics of world-summed `routing_counts` (module docstring)."""
    differ_L, missed_L, tokens_L = counts_3L
    frac_L = differ_L / tokens_L.clamp(min=1)
    return dict(routing_disagreement_mean=float(frac_L.mean()), routing_disagreement_max=float(frac_L.max()),
                routing_expert_mismatch=float(missed_L.sum() / (top_k * tokens_L.sum()).clamp(min=1)),
                routing_tokens=int(tokens_L.max()))


class RoutingMonitor:
    """Asked by the trainer each step (``measure``); see the module docstring.

    Args:
        trainer: the `stapo_megatron.trainer.loop.Trainer` (cfg, hf_config, model, tokenizer,
            seq_multiple).
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.num_experts = spec_from_hf_config(trainer.hf_config).num_moe_experts or 0  # 0: dense
        self.every = trainer.cfg.rollout.routing_every
        self.warned = False

    @property
    def enabled(self) -> bool:
        """Whether the engine should record routes (`RolloutConfig.return_routed_experts`)."""
        return self.num_experts > 0 and self.every > 0

    def measure(self, step: int, prompts: List[List[int]], samples: List[List]) -> Dict[str, float]:
        """The step's routing metrics and their time (every rank calls it; {} on steps without
        a measurement or when the engine returned no routes)."""
        if not self.enabled or step % self.every:
            return {}
        t = self.trainer
        flat = [s for group in samples for s in group]
        flat_prompts = [prompts[i] for i, group in enumerate(samples) for _ in group]
        device = collective_device(None)
        have = torch.tensor([float(all(s.routed_experts is not None for s in flat))], device=device)
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if not have.item():
            if not self.warned and dist.get_rank() == 0:
                warnings.warn("routing disagreement is not measured: the rollout engine returned no routed "
                              "experts (RolloutConfig.return_routed_experts says which engines can)")
            self.warned = True
            return {}
        start = time.perf_counter()
        counts_3L = routing_counts(t.model, flat_prompts, flat, self.num_experts, t.cfg.micro_batch_size,
                                   t.tokenizer.pad_token_id, t.seq_multiple).to(device)
        load_LE = rollout_expert_load(flat, self.num_experts).to(device)
        for summed in (counts_3L, load_LE):
            dist.all_reduce(summed)
        row = routing_metrics(counts_3L.cpu(), flat[0].routed_experts.shape[-1])
        # the rollout's expert load: the busiest expert's tokens over the mean, worst layer (1 = balanced)
        row["rollout_expert_load_max"] = float((load_LE.max(-1).values / load_LE.mean(-1).clamp(min=1)).max())
        row["time_routing"] = time.perf_counter() - start
        return row
