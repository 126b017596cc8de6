"""The training side's configs: `ModelConfig` (which model, at which parallel layout) and `OptimConfig`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional

from stapo_megatron.utils import check_at_least

@dataclasses.dataclass
class OptimConfig:
    """AdamW settings (defaults: the JustRL recipe the paper uses)."""

    lr: float = 1e-6
    """Peak learning rate (constant after warm-up in the paper)."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    clip_grad: float = 1.0
    """Global gradient-norm clip."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP (Megatron DistributedOptimizer)."""
    overlap_grad_reduce: bool = False
    """Reduce gradient buckets over DP during the last micro-batch's backward instead of after
    it (Megatron DDP's ``overlap_grad_reduce``; `mcore.step.wrap_ddp` sets the schedule's
    ``no_sync_func`` / ``grad_sync_func`` for it). The same gradients, earlier."""
    optimizer: str = "adam"
    """"adam" (AdamW) or "sgd" (plain SGD, momentum 0: used by the parity tests, where Adam
    would amplify fp32 reduction-order noise on near-zero gradients)."""

    def __post_init__(self):
        def finite(name, low, high=math.inf, low_open=False):
            value = getattr(self, name)
            ok = math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
            if not ok:
                interval = f"{'(' if low_open else '['}{low}, {high}{']' if math.isfinite(high) else ')'}"
                raise ValueError(f"OptimConfig.{name} must be finite and in {interval}, got {value}")

        finite("lr", 0.0, low_open=True)
        finite("weight_decay", 0.0)
        finite("clip_grad", 0.0)  # 0 = no clipping (Megatron's convention)
        finite("adam_beta1", 0.0, 1.0)
        finite("adam_beta2", 0.0, 1.0)
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f'OptimConfig.optimizer must be "adam" or "sgd", got {self.optimizer!r}')


CP_COMM_TYPES = ("p2p", "all_gather", "a2a")
"""Megatron's ``cp_comm_type`` values (TransformerConfig) this project supports. Megatron's fourth,
"a2a+p2p", needs hierarchical CP groups (``hierarchical_context_parallel_sizes`` in both
``parallel_state.initialize_model_parallel`` and the TransformerConfig); `mcore.parallel` does not
build them, and without them megatron-core's TE attention passes ``cp_group=None`` (TE then
attends within each rank's own chunks against row-wide ``cu_seqlens``), so it is refused."""


@dataclasses.dataclass
class ModelConfig:
    """Which model, at which parallel layout."""

    hf_dir: str = ""
    """HF model folder (config.json, tokenizer, safetensors): architecture, tokenizer, and the
    folder vLLM starts from."""
    megatron_ckpt: Optional[str] = None
    """Initial weights as a Megatron dist checkpoint (`stapo-convert hf-to-mcore`); None keeps
    the random init (tiny demo models only)."""
    tensor_model_parallel_size: int = 1
    """Training TP."""
    pipeline_model_parallel_size: int = 1
    """Training PP."""
    bf16: bool = False
    """Train in bf16 (GPU); fp32 on CPU."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1): the activations outside the TP-split
    matmuls (norms, residuals) are split over the TP ranks along the sequence."""
    recompute_granularity: Optional[str] = None
    """Activation recomputation: None (off), "full" (keep only the inputs of recomputed layers
    and rerun them in backward) or "selective" (recompute the attention core only)."""
    recompute_method: Optional[str] = None
    """With "full": "uniform" (layers in groups of ``recompute_num_layers``, each group's input
    kept) or "block" (recompute only the first ``recompute_num_layers`` layers of a stage)."""
    recompute_num_layers: Optional[int] = None
    """With "full": layers per group ("uniform") or recomputed layers per stage ("block")."""
    context_parallel_size: int = 1
    """Training CP: each packed sequence is padded to a multiple of 2 x CP tokens and split over
    the CP ranks in 2 x CP load-balanced chunks (rank r: chunks r and 2 CP - 1 - r;
    `stapo_megatron.batch.context_parallel`), DP = world / (TP x PP x CP). Needs packed
    micro-batches (``TrainerConfig.packing`` "fixed" or "budget") and so PP = 1; the S2T
    statistics and the normaliser are reduced over DP x CP; GRPO's sequence-mean loss and the
    ``seq_mask`` rollout correction sum their per-sequence terms over CP (`cp_sum`). Mixture-of-experts
    models: the aux loss, its weight and the ``moe/*`` metrics are over whole rows, as at CP=1
    (`stapo_megatron.mcore.moe`); EP folds over DP x CP."""
    cp_comm_type: str = "p2p"
    """How attention exchanges K/V over CP on the transformer-engine spec (Megatron's
    ``cp_comm_type``: "p2p", "all_gather", "a2a"; "a2a+p2p" is refused, see ``CP_COMM_TYPES``);
    the local spec (`bridge.attention.SDPAttention`) always all-gathers K and V."""
    expert_model_parallel_size: int = 1
    """MoE: EP, the experts of each layer split over it (carved out of DP x CP)."""
    expert_tensor_parallel_size: Optional[int] = None
    """MoE: TP inside each expert (None: Megatron's default, the dense TP)."""

    def __post_init__(self):
        check_at_least(self, 1, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                       "context_parallel_size", "expert_model_parallel_size")
        if self.cp_comm_type == "a2a+p2p":
            raise ValueError('model.cp_comm_type "a2a+p2p" needs hierarchical context-parallel groups '
                             "(megatron-core's hierarchical_context_parallel_sizes), which this project does "
                             'not build: use "a2a" (heads over CP) or "p2p" (K/V ring)')
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"model.cp_comm_type must be one of {CP_COMM_TYPES}, got {self.cp_comm_type!r}")
        if self.context_parallel_size > 1 and self.pipeline_model_parallel_size > 1:
            raise ValueError(f"model.context_parallel_size {self.context_parallel_size} with "
                             f"pipeline_model_parallel_size {self.pipeline_model_parallel_size}: context "
                             f"parallelism needs packed micro-batches, which pipelining does not support yet")

    def context_parallel_settings(self) -> Dict[str, Any]:
        """CP as Megatron TransformerConfig fields ({} without CP): TE's CP attention reads them."""
        if self.context_parallel_size == 1:
            return {}
        return dict(context_parallel_size=self.context_parallel_size, cp_comm_type=self.cp_comm_type)

    def memory_settings(self) -> Dict[str, Any]:
        """Sequence parallelism / recomputation as Megatron TransformerConfig fields."""
        out: Dict[str, Any] = {}
        if self.sequence_parallel:
            if self.tensor_model_parallel_size < 2:
                raise ValueError("model.sequence_parallel needs tensor_model_parallel_size > 1")
            out["sequence_parallel"] = True
        if self.recompute_granularity:
            out["recompute_granularity"] = self.recompute_granularity
            if self.recompute_granularity == "full":
                out["recompute_method"] = self.recompute_method or "uniform"
                out["recompute_num_layers"] = self.recompute_num_layers or 1
        return out
