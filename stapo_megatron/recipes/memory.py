"""The per-GPU memory model of colocated STAPO training and vLLM rollouts on 80 GB GPUs.

`ParallelLayout` says where a run goes and the settings that decide its memory per GPU (a `ModelConfig`
and a cluster, checked by `stapo_megatron.config.parallel_layout`); `memory_estimate`
gives the bytes of each component on the most loaded GPU (its assumptions are in its docstring).
The paper recipes (`stapo_megatron.recipes.paper`) choose their layouts with it, the launcher's
dry run prints it, and ``scripts/memory_table.py`` writes the table of docs/recipes.md from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from stapo_megatron.bridge.hf_config import QwenSpec, dense_layer_params, expert_params, num_params
from stapo_megatron.bridge.transformer_config import padded_vocab_size
from stapo_megatron.config import TrainerConfig
from stapo_megatron.mcore.config import ModelConfig
from stapo_megatron.mcore.lora_config import LORA_TARGETS, LoraConfig, rank_problems
from stapo_megatron.batch.alignment import rank_tokens
from stapo_megatron.recipes import delta_net
from stapo_megatron.config.parallel_layout import Cluster
from stapo_megatron.rollout.weight_buckets import planned_staging_bytes

GB = 1e9
"""Decimal gigabyte: estimates are compared with 80e9 bytes, below an 80 GB card's 85.9e9."""

GPU_MEMORY_BYTES = 80 * GB
"""The budget every layout must fit (H100/A100 80 GB), with ~5.9e9 bytes of the card left spare."""
GPU_TOTAL_BYTES = 80 * 2**30
"""What an "80 GB" card reports as its total memory (80 GiB = 85.9e9 bytes): vLLM takes
``gpu_memory_utilization`` as a fraction of this (``torch.cuda.mem_get_info()[1]``), not of 80e9."""

MAX_PROMPT_LEN = 1024
"""Paper: longer DAPO-Math prompts are dropped."""
MAX_RESPONSE_LEN = 15360
"""Paper: maximum response tokens."""
SEQ_LEN = MAX_PROMPT_LEN + MAX_RESPONSE_LEN
"""Longest training sequence (prompt + response): the activation and logits sizes use it."""


MODEL_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "cp_comm_type",
                "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
                "recompute_granularity", "recompute_method", "recompute_num_layers")
"""The `ModelConfig` fields the memory model reads, readable on a `ParallelLayout` by the same names."""


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Where one run goes and the settings that decide its memory per GPU: the cluster, the
    trainer's `ModelConfig` (TP/PP/CP/EP, sequence parallelism, recomputation: `MODEL_FIELDS`, read
    on the layout by the same names) and the rollout engine's share. `ParallelLayout.of` derives one from
    a `TrainerConfig` and a cluster; a recipe's layout hands its ``model`` to its `TrainerConfig`
    as it is, so nothing is copied between the two."""

    num_nodes: int
    """Slurm nodes."""
    model: ModelConfig
    """The training model's parallel layout and memory settings (`MODEL_FIELDS`)."""
    vllm_tensor_parallel_size: int
    """vLLM's own TP. It divides the Megatron TP so a vLLM engine never spans two DP ranks
    (which get different prompts); equal to it, each model-parallel group runs one engine."""
    vllm_gpu_memory_utilization: float
    """vLLM's fraction of the GPU's total memory (`GPU_TOTAL_BYTES`: weights + KV cache). Counted on top of all training memory, an
    upper bound: vLLM sleeps during the update (``RolloutSampling.sleep_during_training``) and
    the trainer empties PyTorch's cache before waking it, so the real peak is nearer
    max(training, persistent state + vLLM); the sum is the margin for fragmentation."""
    gpus_per_node: int = 8
    """GPUs per node."""
    vllm_gpu_memory_utilization_with_reference: Optional[float] = None
    """vLLM's share for methods that keep a frozen reference model (``loss.kl_coef > 0``: GRPO),
    whose bf16 copy of the weights takes memory from it; None = `vllm_gpu_memory_utilization`."""
    reference_model: bool = False
    """Whether the run holds a reference model (a bf16 copy of this rank's weights)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch (one 16k-token sequence)."""
    seq_len: int = SEQ_LEN
    """Longest training sequence (prompt + response) in tokens: the activations and logits of a
    micro-batch are ``micro_batch_size`` such sequences."""
    engine_ranks: int = 0
    """Separate modes (``rollout.separate.engine_ranks``): the job's last GPUs run only vLLM, at
    ``vllm_gpu_memory_utilization`` of their card; the others only train. 0: colocated."""
    weight_bucket_mb: int = 512
    """Separate placement: the weight transfer's bucket (``rollout.separate.weight_bucket_mb``); what an
    engine GPU holds of a transfer beside vLLM's share: `engine_staging_bytes`."""
    lora_rank: int = 0
    """LoRA (``lora.rank``): the base frozen, gradients and optimizer state for the adapters only,
    the reference free (`adapter_params_per_gpu`); 0: full fine-tuning."""
    lora_targets: Tuple[str, ...] = LORA_TARGETS
    """``lora.target_modules``."""
    lora_experts: bool = False
    """``lora.experts``: the MoE experts' linears adapted too."""

    @classmethod
    def of(cls, cfg: TrainerConfig, cluster: Cluster) -> "ParallelLayout":
        """The layout of ``cfg`` on ``cluster``: its model, vLLM TP and share, micro-batch,
        reference model (``loss.kl_coef > 0``) and longest sequence."""
        return cls(num_nodes=cluster.num_nodes, gpus_per_node=cluster.gpus_per_node, model=cfg.model,
                   vllm_tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                   vllm_gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                   micro_batch_size=cfg.micro_batch_size, reference_model=cfg.loss.kl_coef > 0,
                   seq_len=cfg.data.max_prompt_len + cfg.rollout.max_response_len,
                   engine_ranks=cfg.rollout.separate.engine_ranks,
                   weight_bucket_mb=cfg.rollout.separate.weight_bucket_mb,
                   **({} if cfg.lora is None else dict(lora_rank=cfg.lora.rank, lora_experts=cfg.lora.experts,
                                                       lora_targets=tuple(cfg.lora.target_modules))))

    def replace(self, **changes: Any) -> "ParallelLayout":
        """A copy with ``changes`` of its own fields or of its model's (`MODEL_FIELDS`)."""
        model = {k: changes.pop(k) for k in list(changes) if k in MODEL_FIELDS}
        return dataclasses.replace(self, model=dataclasses.replace(self.model, **model), **changes)

    @property
    def cluster(self) -> Cluster:
        """Its nodes and GPUs."""
        return Cluster(self.num_nodes, self.gpus_per_node)

    @property
    def world_size(self) -> int:
        """GPUs of the run."""
        return self.num_nodes * self.gpus_per_node

    @property
    def training_ranks(self) -> int:
        """GPUs that train: all of them, less the engines' with separate placement."""
        return self.world_size - self.engine_ranks

    @property
    def data_parallel_size(self) -> int:
        """DP = training GPUs / (TP x PP x CP)."""
        return self.training_ranks // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                                       * self.context_parallel_size)

    @property
    def expert_tensor_size(self) -> int:
        """ETP: `expert_tensor_parallel_size`, else the dense TP."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Megatron's expert data-parallel size, world / (ETP x EP x PP): the ranks over which the
        distributed optimizer shards the expert parameters (the dense ones: DP x CP)."""
        return self.training_ranks // (self.expert_tensor_size * self.expert_model_parallel_size
                                       * self.pipeline_model_parallel_size)


for _name in MODEL_FIELDS:  # layout.tensor_model_parallel_size reads layout.model's: one copy of each
    setattr(ParallelLayout, _name, property(lambda self, name=_name: getattr(self.model, name),
                                    doc=f"``model.{_name}`` (`ModelConfig`)."))


FRAMEWORK_OVERHEAD_BYTES = 4 * GB
"""CUDA context, NCCL communicators of the Megatron and vLLM groups, allocator fragmentation
(an allowance, not derived)."""
VLLM_RUNTIME_BYTES = 2 * GB
"""vLLM's own activations / sampler buffers inside its share (an allowance)."""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the most loaded GPU (first/last pipeline stage) of one layout."""

    weights: float
    """bf16 parameters of this rank's shard (2 B/param), LoRA adapters included."""
    grads: float
    """Megatron DDP's fp32 gradient buffer (``grad_reduce_in_fp32=True``, 4 B/param) of the
    trained parameters (with LoRA: the adapters only)."""
    optimizer: float
    """Distributed optimizer: fp32 master weights + Adam m and v (12 B/param), the dense
    parameters' / (DP x CP), the experts' / the expert data-parallel size."""
    activations: float
    """What the backward needs of this rank's 1/CP of the micro-batch: with full recomputation
    every layer's bf16 input plus one layer's activations and their gradients, without it every
    layer's activations (`memory_estimate`)."""
    logits: float
    """The loss on TP-sharded logits: the bf16 output and its bf16 gradient (4 B per token and
    local vocabulary entry). On CUDA the op runs its Triton kernels, which keep the fp32 softmax
    statistics in registers ([N]-sized outputs only; measured on the H100 2026-11-24:
    `benchmarks/RESULTS.md`, extra peak 1.000x the logits = the gradient)."""
    overhead: float
    """`FRAMEWORK_OVERHEAD_BYTES`."""
    vllm: float
    """vLLM's colocated share: ``vllm_gpu_memory_utilization`` x the card's total memory
    (`GPU_TOTAL_BYTES`, see `ParallelLayout`)."""
    vllm_kv_tokens: int
    """Tokens of KV cache one vLLM rank holds after its weights and runtime."""
    reference: float = 0.0
    """The frozen reference model of methods with a KL term (bf16, 2 B/param), else 0 (and with
    LoRA, whose reference is its own base)."""

    @property
    def training(self) -> float:
        """Everything but vLLM."""
        return (self.weights + self.grads + self.optimizer + self.activations + self.logits + self.overhead
                + self.reference)

    @property
    def total(self) -> float:
        """Peak bytes per GPU: training plus vLLM's share (`ParallelLayout.vllm_gpu_memory_utilization`)."""
        return self.training + self.vllm

    def as_gb(self) -> Dict[str, float]:
        """The table row: components, training, vLLM and total in GB."""
        names = ("weights", "grads", "optimizer", "activations", "logits", "overhead", "reference", "training",
                 "vllm", "total")
        return {name: round(getattr(self, name) / GB, 1) for name in names}


def expert_params_per_gpu(spec: QwenSpec, layout: ParallelLayout) -> int:
    """Expert parameters on one rank: its layers' experts / EP, each split over ETP."""
    if not spec.is_moe:
        return 0
    local_experts = spec.num_moe_experts // layout.expert_model_parallel_size
    per_stage = spec.num_layers // layout.pipeline_model_parallel_size
    return per_stage * local_experts * expert_params(spec) // layout.expert_tensor_size


def params_per_gpu(spec: QwenSpec, layout: ParallelLayout) -> int:
    """Parameters on the most loaded rank: its layers / TP plus the padded embedding and (for
    untied models, or any model with PP > 1) the output layer / TP on the stages holding them,
    plus its experts (`expert_params_per_gpu`)."""
    tp, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    layers = spec.num_layers // pp * dense_layer_params(spec) // tp
    layers += delta_net.num_linear_layers(spec) // pp * delta_net.mixer_params_difference(spec) // tp  # Qwen3.5
    vocab_rows = padded_vocab_size(spec.vocab_size, tp) // tp * spec.hidden_size
    # PP = 1: the one stage holds the embedding and, untied, the output layer. PP > 1: the
    # first stage holds the embedding, the last the output layer (a copy when tied).
    tables = (1 if spec.tie_word_embeddings else 2) if pp == 1 else 1
    return layers + tables * vocab_rows + spec.hidden_size + expert_params_per_gpu(spec, layout)


def adapter_params_per_gpu(spec: QwenSpec, layout: ParallelLayout) -> int:
    """LoRA parameters on one rank (`stapo_megatron.mcore.lora`'s placement): per layer of its
    stage and targeted linear, a column-parallel base's (``linear_qkv``, ``linear_fc1``) A r x in
    whole and B out/TP x r, a row-parallel base's (``linear_proj``, ``linear_fc2``) A r x in/TP
    and B out x r whole; the experts' (expert-TP 1) per local expert. 0 without LoRA."""
    r, tp = layout.lora_rank, layout.tensor_model_parallel_size
    if not r:
        return 0
    h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
    dense = {"linear_qkv": r * (h + (q + 2 * kv) // tp), "linear_proj": r * (q // tp + h)}
    if not spec.is_moe:
        f = spec.ffn_hidden_size
        dense.update(linear_fc1=r * (h + 2 * f // tp), linear_fc2=r * (f // tp + h))
    per_layer = sum(n for target, n in dense.items() if target in layout.lora_targets)
    if spec.is_moe and layout.lora_experts:
        fe, local = spec.moe_ffn_hidden_size, spec.num_moe_experts // layout.expert_model_parallel_size
        expert = {"linear_fc1": r * (h + 2 * fe), "linear_fc2": r * (fe + h)}
        per_layer += local * sum(n for target, n in expert.items() if target in layout.lora_targets)
    return spec.num_layers // layout.pipeline_model_parallel_size * per_layer


def lora_rank_problems(spec: QwenSpec, layout: ParallelLayout) -> List[str]:
    """A ``lora.rank`` larger than a targeted linear of ``spec`` (`rank_problems`, the rule
    `stapo_megatron.mcore.lora.apply_lora` applies when the model is built): the dense linears,
    the experts' with ``lora.experts`` (a MoE model has no dense MLP)."""
    if not layout.lora_rank:
        return []
    h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
    ffn = spec.moe_ffn_hidden_size if spec.is_moe else spec.ffn_hidden_size
    shapes = {"linear_qkv": (h, q + 2 * kv), "linear_proj": (q, h)}
    if not spec.is_moe or layout.lora_experts:
        shapes.update(linear_fc1=(h, 2 * ffn), linear_fc2=(ffn, h))
    config = LoraConfig(rank=layout.lora_rank, target_modules=list(layout.lora_targets), experts=layout.lora_experts)
    return rank_problems(config, shapes)


RECOMPUTE_MODES = ("full", "selective", None)
"""The recomputation settings `memory_estimate` models (`ParallelLayout.recompute_granularity`)."""
MOE_ROUTING_IMBALANCE = 1.5
"""MoE: tokens the most loaded expert rank receives over its even share (dropless routing, no
capacity factor). An allowance, not derived: the aux loss pulls it towards 1, and the expert
load metrics of a run (max / mean tokens per expert) say what it is."""


SWIGLU_BYTES = 6
"""Bytes per token and MLP unit (ffn, an expert's moe_ffn) that a SwiGLU MLP keeps on CUDA:
Megatron's fused SwiGLU (``bias_activation_fusion``, on wherever Triton is:
`stapo_megatron.bridge.kernels`) saves only its bf16 input, gate and up (4), and recomputes
silu(gate) in its backward; the second linear keeps the bf16 product (2). Unfused (the CPU)
it keeps silu(gate) besides (8; ``benchmarks/saved_bytes.py`` measures both)."""


def kept_layer_bytes(spec: QwenSpec, layout: ParallelLayout) -> float:
    """Bytes per token that one decoder layer keeps for its backward without recomputation
    (local spec, SDPA / flash attention, bf16, on CUDA with Triton), counted op by op from the
    tensors autograd saves (``torch.autograd.graph.saved_tensors_hooks`` on a Qwen3-1.7B-shaped
    layer on the CPU; the MLP as Megatron's fused SwiGLU saves on CUDA):

    - each of the two RMSNorms: its fp32 input copy and fp32 normalised output (torch's RMSNorm
      computes in fp32) and the bf16 output the next linear saves: 10 h bytes;
    - q/k norms: two fp32 copies of q and k: 8 (q + kv);
    - attention: the fused QKV output (v is a view of it), q and k after RoPE, the output
      (kept by flash attention and by the output projection): 6 (q + kv) [+ 4 kv x (CP - 1) for
      the K and V gathered over CP with ``cp_comm_type="all_gather"``] [+ 6 q with Qwen3.5's
      output gate: its rows of the fused output, the gate's sigmoid and the output before it];
    - dense MLP: `SWIGLU_BYTES` ffn, the fused SwiGLU's input and the second linear's input
      (counting 10 ffn, more than even the unfused SwiGLU keeps, the model over-counted the
      GPU by 4 ffn per layer: +10% at 8k and +13% at 16k tokens on the H200). MoE: the router's fp32 logits and
      probabilities (8 E), then per routed copy (top-k, x `MOE_ROUTING_IMBALANCE`) the permuted
      input and expert output (4 h) and the expert MLP (`SWIGLU_BYTES` moe_ffn / ETP).

    h-sized terms are split over TP with sequence parallelism, q/kv/ffn over TP. Calibrated
    against the GPU's ``max_memory_allocated`` (``tests/recipes/test_memory_calibration.py``
    holds the measured rows): Qwen3-1.7B, 4 x 8192 / 16384 tokens without recomputation on the
    H200, 64.2 / 97.3 GB allocated against `memory_estimate`'s 64.7 / 98.3 GB without its
    allowance (+0.7% / +1.1%).
    """
    tp = layout.tensor_model_parallel_size
    sp = tp if layout.sequence_parallel else 1
    h = spec.hidden_size
    attention = 10 * h / sp + delta_net.attention_mixer_bytes(spec, layout)
    if spec.is_moe:
        copies = spec.moe_router_topk * MOE_ROUTING_IMBALANCE
        mlp = 10 * h / sp + 8 * spec.num_moe_experts / sp + copies * (
            4 * h / sp + SWIGLU_BYTES * spec.moe_ffn_hidden_size / layout.expert_tensor_size)
        # Qwen3.5-MoE's shared expert: a SwiGLU MLP every token passes (its one-row gate is negligible)
        mlp += SWIGLU_BYTES * (spec.moe_shared_expert_intermediate_size or 0) / tp
    else:
        mlp = 10 * h / sp + SWIGLU_BYTES * spec.ffn_hidden_size / tp
    return attention + mlp


def _recompute_layer_bytes(spec: QwenSpec, layout: ParallelLayout) -> float:
    """bf16 bytes per token of the one layer full recomputation rebuilds: LN inputs/outputs and
    the two residual inputs (4h, split over TP only with sequence parallelism), q/k/v and the
    attention output (2q + 2kv), gate/up outputs and the SwiGLU output (3 ffn; an MoE: 3
    moe_ffn / ETP and the permuted input per routed copy), all split over TP."""
    tp = layout.tensor_model_parallel_size
    sp = tp if layout.sequence_parallel else 1
    h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
    if spec.is_moe:
        mlp = spec.moe_router_topk * MOE_ROUTING_IMBALANCE * (
            3 * spec.moe_ffn_hidden_size / layout.expert_tensor_size + h / sp)
        mlp += 3 * (spec.moe_shared_expert_intermediate_size or 0) / tp  # Qwen3.5-MoE's shared expert
    else:
        mlp = 3 * spec.ffn_hidden_size / tp
    mixer = (2 * q + 2 * kv + (q if spec.attention_output_gate else 0)) / tp
    if spec.is_hybrid:  # the larger of the two layer kinds is the one rebuilt at the peak
        mixer = max(mixer, delta_net.recompute_mixer_bytes(spec, tp))
    return 2 * (4 * h / sp + mixer + mlp)


def memory_estimate(spec: QwenSpec, layout: ParallelLayout, seq_len: Optional[int] = None,
                    gpu_bytes: float = GPU_TOTAL_BYTES) -> MemoryEstimate:
    """Per-GPU memory of colocated STAPO training (Megatron) and rollouts (vLLM).

    Assumptions: bf16 weights, fp32 gradient buffer, Megatron's distributed optimizer (fp32
    master + Adam states of the dense parameters sharded over DP x CP, Megatron's data-parallel
    group with context parallelism; those of the experts over the expert data-parallel group,
    world / (ETP x EP x PP)), micro-batches of ``micro_batch_size`` sequences of ``seq_len``
    tokens of which each CP rank holds 1/CP (`rank_tokens`: activations, logits and the
    recomputation buffers shrink with CP, weights and gradients do not), sequence parallelism
    (h-sized activations split over TP), flash attention (no s x s scores), 1F1B pipelining
    (the first stage keeps PP micro-batches in flight: L layers' activations in total), the
    STAPO loss on vocabulary-sharded logits, and vLLM's whole share on top (it sleeps during the
    update, but wakes while PyTorch's cache still holds the training memory).

    Recomputation (`ParallelLayout.recompute_granularity`): "full" (uniform, 1 layer per group) keeps
    every layer's bf16 input plus one layer's activations and their gradients while it is
    recomputed; None keeps every layer's activations (`kept_layer_bytes`) plus one layer's
    gradients; "selective" is counted as None: Megatron's selective recomputation rebuilds the
    core attention, whose inputs it keeps, and with flash attention that saves only the
    softmax statistics (the H100 run of Qwen3-1.7B at 16k was out of memory with both).
    MoE: experts / EP per rank, each split over ETP; the routed copies of each token through
    its experts (balanced routing times `MOE_ROUTING_IMBALANCE`).

    Args:
        seq_len: the longest training sequence (None: `ParallelLayout.seq_len`).
        gpu_bytes: the card's total memory, of which vLLM takes its fraction (`GPU_TOTAL_BYTES`).

    Returns the components of `MemoryEstimate`; `MemoryEstimate.total` must stay below the
    budget `GPU_MEMORY_BYTES`.
    """
    if layout.recompute_granularity not in RECOMPUTE_MODES:
        raise ValueError(f"recompute_granularity must be one of {RECOMPUTE_MODES}, got {layout.recompute_granularity!r}")
    if layout.recompute_granularity == "full" and (layout.recompute_method, layout.recompute_num_layers) != (
            "uniform", 1):
        raise ValueError(f"memory_estimate models full recomputation of single layers (recompute_method 'uniform', "
                         f"recompute_num_layers 1), got {layout.recompute_method!r}, {layout.recompute_num_layers}")
    tp = layout.tensor_model_parallel_size
    sp = tp if layout.sequence_parallel else 1
    tokens = rank_tokens(seq_len or layout.seq_len, layout.context_parallel_size) * layout.micro_batch_size
    params = params_per_gpu(spec, layout)
    experts = expert_params_per_gpu(spec, layout)
    dense_shards = layout.data_parallel_size * layout.context_parallel_size
    optimizer = 12 * ((params - experts) / dense_shards + experts / max(1, layout.expert_data_parallel_size))
    adapters = adapter_params_per_gpu(spec, layout)
    trained = params
    if layout.lora_rank:  # the frozen base: no gradient, no optimizer state (expert adapters counted as dense)
        trained, optimizer = adapters, 12 * adapters / dense_shards
    if layout.recompute_granularity == "full":
        kept_inputs = 2 * spec.hidden_size / sp * tokens * spec.num_layers
        activations = kept_inputs + 2 * _recompute_layer_bytes(spec, layout) * tokens
    else:
        activations = ((spec.num_layers + 1) * kept_layer_bytes(spec, layout)
                       + delta_net.kept_mixer_difference(spec, layout)) * tokens
    logits = tokens * padded_vocab_size(spec.vocab_size, tp) / tp * (2 + 2)
    vllm = layout.vllm_gpu_memory_utilization * gpu_bytes  # on a training GPU only when colocated
    reference = 2 * params if layout.reference_model and not layout.lora_rank else 0.0  # LoRA: its own base
    vllm_weights = 2 * num_params(spec) / layout.vllm_tensor_parallel_size
    kv_tokens = delta_net.kv_cache_tokens(spec, vllm - vllm_weights - VLLM_RUNTIME_BYTES,
                                          layout.vllm_tensor_parallel_size, seq_len or layout.seq_len)
    return MemoryEstimate(
        weights=2 * (params + adapters), grads=4 * trained, optimizer=optimizer,
        activations=activations, logits=logits, overhead=FRAMEWORK_OVERHEAD_BYTES,
        vllm=0.0 if layout.engine_ranks else vllm, reference=reference,
        vllm_kv_tokens=kv_tokens,
    )


def engine_staging_bytes(spec: QwenSpec, layout: ParallelLayout) -> float:
    """Separate placement: what an engine GPU holds beside vLLM's share during a weight transfer
    (vLLM sizes its KV cache to fill the share): the received buckets vLLM's layer-wise reload
    still keeps and the reload layer it materialises, at the worst moment of the transfer
    (`stapo_megatron.rollout.weight_buckets.planned_staging_bytes`: buckets of
    ``rollout.separate.weight_bucket_mb`` cut between reload layers, bf16, the layer split over vLLM's TP);
    0 colocated (the in-process engine takes the tensors one at a time)."""
    if not layout.engine_ranks:
        return 0.0
    return float(planned_staging_bytes(spec, layout.weight_bucket_mb * 2**20, dtype_bytes=2,
                                       tensor_parallel_size=layout.vllm_tensor_parallel_size))


def describe(spec: QwenSpec, layout: ParallelLayout) -> str:
    """One line for the launcher's dry run: the parallel sizes, sequence and recomputation, vLLM,
    and the estimate's total against the budget."""
    est = memory_estimate(spec, layout)
    experts = (f" EP={layout.expert_model_parallel_size} ETP={layout.expert_tensor_size}" if spec.is_moe else "")
    if layout.engine_ranks:  # separate placement: the two pools
        engines = layout.engine_ranks // layout.vllm_tensor_parallel_size
        return (f"{layout.num_nodes} x {layout.gpus_per_node} GPUs, separate placement: {layout.training_ranks} train "
                f"(TP={layout.tensor_model_parallel_size} PP={layout.pipeline_model_parallel_size} "
                f"CP={layout.context_parallel_size}{experts} DP={layout.data_parallel_size}; {layout.seq_len}-token "
                f"sequences, recompute {layout.recompute_granularity or 'none'}; {est.training / GB:.1f} GB of "
                f"{GPU_MEMORY_BYTES / GB:.0f} GB), {layout.engine_ranks} generate ({engines} vLLM engines of TP="
                f"{layout.vllm_tensor_parallel_size} at {layout.vllm_gpu_memory_utilization} of the card, "
                f"{engine_staging_bytes(spec, layout) / GB:.1f} GB of weight buckets beside it: KV cache for "
                f"{est.vllm_kv_tokens} tokens per GPU)")
    lora = f" LoRA r={layout.lora_rank}" if layout.lora_rank else ""
    return (f"{layout.num_nodes} x {layout.gpus_per_node} GPUs{lora}: TP={layout.tensor_model_parallel_size} "
            f"PP={layout.pipeline_model_parallel_size} CP={layout.context_parallel_size}{experts} "
            f"DP={layout.data_parallel_size}; {layout.seq_len}-token sequences ("
            f"{rank_tokens(layout.seq_len, layout.context_parallel_size)} per CP rank), recompute "
            f"{layout.recompute_granularity or 'none'}; vLLM TP={layout.vllm_tensor_parallel_size} at "
            f"{layout.vllm_gpu_memory_utilization} of the card; {est.training / GB:.1f} GB training + "
            f"{est.vllm / GB:.1f} GB vLLM = {est.total / GB:.1f} GB of {GPU_MEMORY_BYTES / GB:.0f} GB")
