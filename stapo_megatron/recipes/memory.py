"""The per-GPU memory model of colocated STAPO training and vLLM rollouts on 80 GB GPUs.

`Layout` says where a run goes and the settings that decide its memory per GPU; `memory_estimate`
gives the bytes of each component on the most loaded GPU (its assumptions are in its docstring).
The paper recipes (`stapo_megatron.recipes.paper`) choose their layouts with it, the launcher's
dry run prints it, and ``scripts/memory_table.py`` writes the README's table from it.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

from stapo_megatron.bridge.config import QwenSpec, padded_vocab_size

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


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one run goes and the settings that decide its memory per GPU."""

    num_nodes: int
    """Slurm nodes."""
    tensor_model_parallel_size: int
    """Megatron TP (within a node: heads, KV heads and the vocabulary are split over it)."""
    pipeline_model_parallel_size: int
    """Megatron PP (layers are split over it)."""
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
    sequence_parallel: bool = True
    """Megatron sequence parallelism (needs TP > 1)."""
    recompute_granularity: Optional[str] = "full"
    """Activation recomputation ("full": only layer inputs are kept)."""
    recompute_method: Optional[str] = "uniform"
    """Full recompute of groups of `recompute_num_layers` layers."""
    recompute_num_layers: Optional[int] = 1
    """Layers per recompute group."""
    context_parallel_size: int = 1
    """Megatron CP (each sequence split over it)."""
    expert_model_parallel_size: int = 1
    """MoE: Megatron EP (experts split over it)."""

    @property
    def world_size(self) -> int:
        """GPUs of the run."""
        return self.num_nodes * self.gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        """DP = world / (TP x PP x CP)."""
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                                   * self.context_parallel_size)


FRAMEWORK_OVERHEAD_BYTES = 4 * GB
"""CUDA context, NCCL communicators of the Megatron and vLLM groups, allocator fragmentation
(an allowance, not derived)."""
VLLM_RUNTIME_BYTES = 2 * GB
"""vLLM's own activations / sampler buffers inside its share (an allowance)."""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the most loaded GPU (first/last pipeline stage) of one layout."""

    weights: float
    """bf16 parameters of this rank's shard (2 B/param)."""
    grads: float
    """Megatron DDP's fp32 gradient buffer (``grad_reduce_in_fp32=True``, 4 B/param)."""
    optimizer: float
    """Distributed optimizer: fp32 master weights + Adam m and v (12 B/param) / DP."""
    activations: float
    """Full recompute with sequence parallelism: every layer's bf16 input (kept), plus one
    layer's full activations and their gradients while it is recomputed."""
    logits: float
    """The loss on TP-sharded logits: the bf16 output and its bf16 gradient (4 B per token and
    local vocabulary entry). On CUDA the op runs its Triton kernels, which keep the fp32 softmax
    statistics in registers ([N]-sized outputs only; measured on the H100 2026-11-24:
    `benchmarks/RESULTS.md`, extra peak 1.000x the logits = the gradient)."""
    overhead: float
    """`FRAMEWORK_OVERHEAD_BYTES`."""
    vllm: float
    """vLLM's colocated share: ``vllm_gpu_memory_utilization`` x the card's total memory
    (`GPU_TOTAL_BYTES`, see `Layout`)."""
    vllm_kv_tokens: int
    """Tokens of KV cache one vLLM rank holds after its weights and runtime."""
    reference: float = 0.0
    """The frozen reference model of methods with a KL term (bf16, 2 B/param), else 0."""

    @property
    def training(self) -> float:
        """Everything but vLLM."""
        return (self.weights + self.grads + self.optimizer + self.activations + self.logits + self.overhead
                + self.reference)

    @property
    def total(self) -> float:
        """Peak bytes per GPU: training plus vLLM's share (`Layout.vllm_gpu_memory_utilization`)."""
        return self.training + self.vllm

    def as_gb(self) -> Dict[str, float]:
        """The table row: components, training, vLLM and total in GB."""
        names = ("weights", "grads", "optimizer", "activations", "logits", "overhead", "reference", "training",
                 "vllm", "total")
        return {name: round(getattr(self, name) / GB, 1) for name in names}


def _layer_params(spec: QwenSpec) -> int:
    """Parameters of one decoder layer (q/k/v/o, gate/up/down, two RMSNorms, q/k norms)."""
    h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
    attention = h * (q + 2 * kv) + q * h
    mlp = 3 * h * spec.ffn_hidden_size
    norms = 2 * h + (2 * spec.kv_channels if spec.qk_layernorm else 0)
    return attention + mlp + norms


def num_params(spec: QwenSpec) -> int:
    """Parameters of the HF model (unpadded vocabulary)."""
    embeddings = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    return spec.num_layers * _layer_params(spec) + embeddings + spec.hidden_size


def params_per_gpu(spec: QwenSpec, layout: Layout) -> int:
    """Parameters on the most loaded rank: its layers / TP plus the padded embedding and (for
    untied models, or any model with PP > 1) the output layer / TP on the stages holding them."""
    tp, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    layers = spec.num_layers // pp * _layer_params(spec) // tp
    vocab_rows = padded_vocab_size(spec.vocab_size, tp) // tp * spec.hidden_size
    # PP = 1: the one stage holds the embedding and, untied, the output layer. PP > 1: the
    # first stage holds the embedding, the last the output layer (a copy when tied).
    tables = (1 if spec.tie_word_embeddings else 2) if pp == 1 else 1
    return layers + tables * vocab_rows + spec.hidden_size


def memory_estimate(spec: QwenSpec, layout: Layout, seq_len: int = SEQ_LEN,
                    gpu_bytes: float = GPU_TOTAL_BYTES) -> MemoryEstimate:
    """Per-GPU memory of colocated STAPO training (Megatron) and rollouts (vLLM).

    Assumptions: bf16 weights, fp32 gradient buffer, Megatron's distributed optimizer (fp32
    master + Adam states sharded over DP), micro-batches of ``micro_batch_size`` sequences of
    ``seq_len`` tokens, full recomputation of every layer (uniform, 1 layer per group) with
    sequence parallelism (activations split over TP), flash attention (no s x s scores), 1F1B
    pipelining (the first stage keeps PP micro-batches in flight: L layer inputs in total),
    the STAPO loss on vocabulary-sharded logits, and vLLM's whole share on top (it sleeps during
    the update, but wakes while PyTorch's cache still holds the training memory).

    Args:
        gpu_bytes: the card's total memory, of which vLLM takes its fraction (`GPU_TOTAL_BYTES`).

    Returns the components of `MemoryEstimate`; `MemoryEstimate.total` must stay below the
    budget `GPU_MEMORY_BYTES`.
    """
    if layout.recompute_granularity != "full" or layout.recompute_num_layers != 1:
        raise ValueError(
            f"memory_estimate models full recomputation of single layers, got recompute_granularity "
            f"{layout.recompute_granularity!r}, recompute_num_layers {layout.recompute_num_layers}"
        )
    tp, dp = layout.tensor_model_parallel_size, layout.data_parallel_size
    h, q, kv, ffn = spec.hidden_size, spec.q_size, spec.kv_size, spec.ffn_hidden_size
    tokens = seq_len * layout.micro_batch_size
    sp = tp if layout.sequence_parallel else 1
    params = params_per_gpu(spec, layout)
    # bf16 bytes per token of one layer's activations: LN inputs/outputs and the two residual
    # inputs (4h, split over TP only with sequence parallelism), q/k/v and the attention output
    # (2q + 2kv), gate/up outputs and the SwiGLU output (3 ffn), all split over TP.
    layer_bytes = 2 * (4 * h / sp + (2 * q + 2 * kv + 3 * ffn) / tp)
    kept_inputs = 2 * h / sp * tokens * spec.num_layers
    activations = kept_inputs + 2 * layer_bytes * tokens
    logits = tokens * padded_vocab_size(spec.vocab_size, tp) / tp * (2 + 2)
    vllm = layout.vllm_gpu_memory_utilization * gpu_bytes
    reference = 2 * params if layout.reference_model else 0.0
    vllm_weights = 2 * num_params(spec) / layout.vllm_tensor_parallel_size
    kv_bytes_per_token = 2 * spec.num_layers * spec.kv_size * 2 / layout.vllm_tensor_parallel_size
    return MemoryEstimate(
        weights=2 * params, grads=4 * params, optimizer=12 * params / dp,
        activations=activations, logits=logits, overhead=FRAMEWORK_OVERHEAD_BYTES, vllm=vllm, reference=reference,
        vllm_kv_tokens=int(max(0.0, vllm - vllm_weights - VLLM_RUNTIME_BYTES) / kv_bytes_per_token),
    )
