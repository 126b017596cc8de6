"""The parallel layout, validated once: every check of a layout and the cluster it goes on.

Owns the cluster a run goes on (`Cluster`) and `layout_problems`: why a `TrainerConfig` cannot run
on a cluster (as torchtitan's ``ParallelDims._validate``, in one place). The alignments it checks
against are the batch layout's (`stapo_megatron.batch.alignment`). It is asked by the
config tree (`TrainerConfig.__post_init__`: `config_problems`, the checks that need no world
size), by the trainer once its process group has formed (`trainer.replicas.init_groups`:
`world_problems` on the job's world size) and by the paper recipes (`recipes.paper.
layout_problems`: all of them on the recipe's cluster, with the model's architecture and, there,
the memory estimate).

Each function returns a list of problems, each a sentence naming the fields and their values; the
callers raise them as one ValueError.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

from stapo_megatron.batch.alignment import PACKING_MODES, rank_tokens, sequence_multiple


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The GPUs a run goes on."""

    num_nodes: int
    """Slurm nodes."""
    gpus_per_node: int = 8
    """GPUs per node."""

    @property
    def world_size(self) -> int:
        """GPUs of the run."""
        return self.num_nodes * self.gpus_per_node


def config_problems(cfg: Any) -> List[str]:
    """What no world size can fix in ``cfg`` (a `TrainerConfig`): the packing mode and what it
    supports (PP, CP), the budget against one CP rank's share of the longest sequence, partial
    or streaming rollouts against CP, and the vLLM engine's TP against Megatron's. In the order
    `TrainerConfig` raises the first one."""
    m = cfg.model
    if cfg.packing not in PACKING_MODES:
        return [f"packing must be one of {PACKING_MODES}, got {cfg.packing!r}"]
    problems = []
    if cfg.packing != "padded" and m.pipeline_model_parallel_size > 1:
        problems.append(f"packing={cfg.packing!r} is not supported with pipeline parallelism yet "
                        f"(model.pipeline_model_parallel_size {m.pipeline_model_parallel_size}); use packing=padded")
    cp = m.context_parallel_size
    if cp > 1 and cfg.packing == "padded":
        problems.append(f"model.context_parallel_size {cp} needs packed micro-batches: packing='fixed' or "
                        f"'budget', got packing='padded'")
    if cfg.packing == "budget":
        problems += _budget_problems(cfg)
    if cfg.rollout.pooled and cp > 1:
        problems.append(f"rollout.mode={cfg.rollout.mode!r} is not supported with model.context_parallel_size="
                        f"{cp} (a replica's prompts live in one engine's pool, and CP ranks split their replica's "
                        f"prompts)")
    # vLLM's external launcher forms an engine from consecutive ranks, and Megatron's TP
    # groups are consecutive ranks too (TP is the innermost dimension); an engine wider than
    # a TP group would span two DP ranks, which sample different prompts.
    tp, vtp = m.tensor_model_parallel_size, cfg.rollout.tensor_parallel_size
    if tp % vtp and cfg.rollout.placement == "colocated":
        problems.append(f"vLLM TP {vtp} must divide Megatron TP {tp} (rollout.tensor_parallel_size={vtp}, "
                        f"model.tensor_model_parallel_size={tp}): a vLLM engine must not span two DP ranks")
    return problems


def _budget_problems(cfg: Any) -> List[str]:
    """``packing="budget"``: a positive budget of at least one CP rank's share of the longest sequence."""
    if cfg.max_tokens_per_microbatch <= 0:
        return [f"max_tokens_per_microbatch must be > 0 with packing='budget', got {cfg.max_tokens_per_microbatch}"]
    m = cfg.model
    cp, longest = m.context_parallel_size, cfg.data.max_prompt_len + cfg.rollout.max_response_len
    # with CP the budget is one rank's tokens: the sequence padded to whole chunks, over CP
    multiple = sequence_multiple(cp, m.tensor_model_parallel_size, m.sequence_parallel)
    per_rank = rank_tokens(longest, cp, m.tensor_model_parallel_size, m.sequence_parallel)
    if cfg.max_tokens_per_microbatch >= per_rank:
        return []
    return [f"max_tokens_per_microbatch {cfg.max_tokens_per_microbatch} < the longest sequence "
            f"data.max_prompt_len + rollout.max_response_len = {cfg.data.max_prompt_len} + "
            f"{cfg.rollout.max_response_len} = {longest}"
            + (f", padded to a multiple of {multiple}, over context_parallel_size {cp} = {per_rank} tokens "
               f"per rank" if cp > 1 else "")
            + " (a sequence is never split between micro-batches; context parallelism splits it over its ranks)"]


def world_problems(cfg: Any, world_size: int, gpus_per_node: Optional[int] = None,
                   whole_micro_batches: bool = False) -> List[str]:
    """What ``cfg`` needs of ``world_size`` GPUs (the job's: with a separate
    ``rollout.mode``, the training ranks are all but the last ``rollout.separate.engine_ranks``): TP x PP x CP
    dividing the training ranks (and, given
    ``gpus_per_node``, the node topology), the prompts over DP and over a replica's CP ranks,
    the expert groups, partial rollouts' replicas against the engines; with
    ``whole_micro_batches`` also every DP rank's sequences in whole micro-batches (the recipes'
    check: the trainer pads a short last one)."""
    m = cfg.model
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    engines = cfg.rollout.separate.engine_ranks  # separate modes: the job's last ranks only generate
    if engines:
        if world_size <= engines:
            return [f"rollout.separate.engine_ranks={engines} leaves no training rank of the job's {world_size}"]
        if gpus_per_node is not None and engines % gpus_per_node and gpus_per_node % engines:
            return [f"rollout.separate.engine_ranks={engines} must be whole nodes of {gpus_per_node} GPUs or divide "
                    f"one (the trainers' TP groups must not straddle an engine)"]
        world_size -= engines
    if world_size % (tp * pp * cp):
        return [f"{world_size} GPUs are not divisible by TP {tp} x PP {pp} x CP {cp}"]
    problems = []
    if gpus_per_node is not None:
        if tp > gpus_per_node or gpus_per_node % tp:
            problems.append(f"TP {tp} must divide the {gpus_per_node} GPUs of a node")
        elif gpus_per_node % (tp * cp) and (tp * cp) % gpus_per_node:
            problems.append(f"TP {tp} x CP {cp} must divide the {gpus_per_node} GPUs of a node or span whole "
                            f"nodes (Megatron places TP, then CP ranks next to each other)")
    problems += _batch_problems(cfg, world_size // (tp * pp * cp), whole_micro_batches)
    problems += _partial_problems(cfg.rollout, world_size // (tp * pp * cp))
    etp, ep = m.expert_tensor_parallel_size or tp, m.expert_model_parallel_size
    if world_size % (etp * ep * pp):
        problems.append(f"{world_size} GPUs are not divisible by ETP {etp} x EP {ep} x PP {pp} "
                        f"(Megatron's expert groups)")
    return problems


def _batch_problems(cfg: Any, dp: int, whole_micro_batches: bool) -> List[str]:
    """Prompts and sequences over DP (which excludes CP: the CP ranks of a DP rank share its
    sequences, and split its prompts for sampling)."""
    problems = []
    if cfg.prompts_per_step % cfg.minibatch_prompts:
        problems.append(f"prompts_per_step {cfg.prompts_per_step} is not divisible by minibatch_prompts "
                        f"{cfg.minibatch_prompts}")
    if cfg.minibatch_prompts % dp:
        problems.append(f"minibatch_prompts {cfg.minibatch_prompts} is not divisible by DP {dp}")
    cp = cfg.model.context_parallel_size
    if cfg.prompts_per_step % dp == 0 and (cfg.prompts_per_step // dp) % cp:
        problems.append(f"prompts_per_step {cfg.prompts_per_step} / DP {dp} = {cfg.prompts_per_step // dp} prompts "
                        f"per replica must be a multiple of model.context_parallel_size {cp} (its CP ranks share "
                        f"the sampling)")
    mini_sequences = cfg.minibatch_prompts * cfg.rollout.group_size
    if whole_micro_batches and mini_sequences % (dp * cfg.micro_batch_size):
        problems.append(f"{mini_sequences} sequences per mini-batch are not divisible by DP {dp} x micro_batch_size "
                        f"{cfg.micro_batch_size}")
    return problems


def _partial_problems(rollout: Any, dp: int) -> List[str]:
    """Partial rollouts: each DP replica's pool lives on one engine, so no engine may be left
    without a replica (`stapo_megatron.rollout.remote.plan_chunks` gives a replica one engine
    only when there are as many replicas as engines or more)."""
    if rollout.mode != "partial" or dp >= rollout.num_engines:
        return []
    return [f"rollout.mode='partial' needs at least as many trainer replicas (DP {dp}) as engines "
            f"(rollout.separate.engine_ranks={rollout.separate.engine_ranks} / rollout.tensor_parallel_size="
            f"{rollout.tensor_parallel_size} = {rollout.num_engines}): each replica's pool lives on one engine"]


def model_problems(spec: Any, cfg: Any) -> List[str]:
    """What the architecture ``spec`` (a `stapo_megatron.bridge.hf_config.QwenSpec`) needs of
    ``cfg``'s layout: heads and KV heads over TP (x CP for the all-to-all CP exchanges) and vLLM's
    TP, layers over PP, experts over EP and their widths over ETP; sequence parallelism needs TP."""
    # here, not at the top: the config tree imports this module without the bridge (or torch)
    from stapo_megatron.bridge.hybrid_config import check_hybrid_parallel, delta_net_layout_problems

    m = cfg.model
    tp, cp, vtp = m.tensor_model_parallel_size, m.context_parallel_size, cfg.rollout.tensor_parallel_size
    # "a2a" CP scatters heads over the CP ranks (Ulysses), so heads must split over TP x CP
    split = tp * cp if m.cp_comm_type.startswith("a2a") else tp
    what = f"TP {tp} x CP {cp} (cp_comm_type {m.cp_comm_type!r})" if split != tp else f"tensor_model_parallel_size {tp}"
    problems = [f"{name} {count} is not divisible by {what}"
                for name, count in (("num_attention_heads", spec.num_attention_heads),
                                    ("num_query_groups", spec.num_query_groups)) if count % split]
    if spec.num_query_groups % vtp:
        problems.append(f"num_query_groups {spec.num_query_groups} is not divisible by vLLM TP {vtp}")
    if spec.num_layers % m.pipeline_model_parallel_size:
        problems.append(f"num_layers {spec.num_layers} is not divisible by pipeline_model_parallel_size "
                        f"{m.pipeline_model_parallel_size}")
    if m.sequence_parallel and tp == 1:
        problems.append("sequence_parallel needs tensor_model_parallel_size > 1")
    # Qwen3.5's delta-net layers: CP from megatron-core 0.19 (heads per TP rank over CP), no sequence
    # parallelism with packing (the bridge's check)
    problems += delta_net_layout_problems(spec, cp, m.sequence_parallel, packed=cfg.packing != "padded",
                                          tensor_model_parallel_size=tp)
    problems += [f"{field} {value} is not divisible by {name} {size}"
                 for size, name, field, value in check_hybrid_parallel(spec, tp) if value % size]
    return problems + _expert_problems(spec, cfg)


def _expert_problems(spec: Any, cfg: Any) -> List[str]:
    """Experts over EP and expert widths over ETP; EP/ETP on a dense model."""
    ep, etp = cfg.model.expert_model_parallel_size, cfg.model.expert_tensor_parallel_size
    if not spec.is_moe:
        return [] if ep == 1 and etp in (None, 1) else [
            f"expert_model_parallel_size {ep} / expert_tensor_parallel_size {etp} need an MoE model "
            f"({spec.architecture} has no experts)"]
    etp = etp or cfg.model.tensor_model_parallel_size
    problems = []
    if spec.num_moe_experts % ep:
        problems.append(f"num_moe_experts {spec.num_moe_experts} is not divisible by expert_model_parallel_size {ep}")
    if spec.moe_ffn_hidden_size % etp:
        problems.append(f"moe_ffn_hidden_size {spec.moe_ffn_hidden_size} is not divisible by "
                        f"expert_tensor_parallel_size {etp}")
    return problems


def layout_problems(cfg: Any, cluster: Cluster, spec: Any = None, whole_micro_batches: bool = True) -> List[str]:
    """Every problem of ``cfg`` on ``cluster``: `model_problems` (given the architecture
    ``spec``), `config_problems` and `world_problems` (empty when it can run)."""
    problems = model_problems(spec, cfg) if spec is not None else []
    problems += [p for p in config_problems(cfg) if p not in problems]
    return problems + world_problems(cfg, cluster.world_size, cluster.gpus_per_node, whole_micro_batches)


def raise_problems(problems: List[str], what: str) -> None:
    """One ValueError listing ``problems`` under ``what`` (nothing when there are none)."""
    if problems:
        raise ValueError(f"{what}:\n  - " + "\n  - ".join(problems))
