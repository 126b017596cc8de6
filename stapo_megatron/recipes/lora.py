"""LoRA recipes: the paper's STAPO protocol training low-rank adapters on one node of 8 GPUs.

`paper.paper_recipe`'s settings (JustRL + S2T: 256 prompts x 8 rollouts a step, 16k-token
sequences, the +1/-1 reward, 3000 steps; `stapo_megatron.recipes.paper`) with the ``lora``
section on every dense linear (`LORA_RANK`, `LORA_ALPHA`), the learning rate raised for the
adapters (`LORA_LR`) and a layout for a single node, where the frozen base needs no gradients,
no optimizer state and no second copy for a KL reference (`stapo_megatron.recipes.memory`):

- ``qwen3_14b_lora``: Qwen3-14B-Base, the paper's largest model, which the paper recipe trains
  on 8 nodes;
- ``qwen3_32b_lora``: Qwen3-32B (no base checkpoint of the 32B was released, so the post-trained
  model), which full fine-tuning cannot fit on these 8 GPUs at all (`full_finetune_problems`:
  81 GB of training state per GPU before vLLM's share).

The module offers what the launcher asks of `paper` (``ARCHITECTURES``, ``LAYOUTS``,
``DISPLAY_NAMES``, ``paper_recipe``, ``layout_for``, ``check_paper_config``) under the same
names; `recipe_module` says which of the two holds a recipe.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Dict, List, Optional

from stapo_megatron.batch.alignment import rank_tokens
from stapo_megatron.bridge.hf_config import QwenSpec
from stapo_megatron.config import TrainerConfig
from stapo_megatron.config.parallel_layout import Cluster
from stapo_megatron.mcore.config import ModelConfig
from stapo_megatron.mcore.lora_config import LoraConfig
from stapo_megatron.recipes import paper
from stapo_megatron.recipes.memory import ParallelLayout

LORA_RANK = 32
"""``lora.rank``: Tinker's default rank; for RL, LoRA Without Regret (Schulman et al., Thinking
Machines Lab 2025) finds even very small ranks match full fine-tuning, since a policy-gradient
step carries little information."""
LORA_ALPHA = 32.0
"""``lora.alpha``: the adapter output scaled by alpha / r, as in LoRA Without Regret (alpha 32)."""
LORA_LR = 1e-5
"""``optim.lr``: 10x the paper recipes' full-weight lr of 1e-6. LoRA Without Regret measured the
optimal LoRA learning rate at about 10x full fine-tuning's, across models and for RL (Tinker's
``hyperparam_utils.get_lora_lr_over_full_finetune_lr`` returns the fixed factor 10); verl and
NeMo-RL raise it by about the same for their LoRA GRPO examples."""

QWEN3_32B = dataclasses.replace(paper.ARCHITECTURES["qwen3_14b"], num_layers=64, num_attention_heads=64,
                                ffn_hidden_size=25600, max_position_embeddings=40960)
"""Qwen3-32B as in its HF config.json: 64 layers of width 5120, 64 query and 8 KV heads of 128,
SwiGLU width 25600, untied embeddings; 32.8B parameters."""

ARCHITECTURES: Dict[str, QwenSpec] = {"qwen3_14b_lora": paper.ARCHITECTURES["qwen3_14b"],
                                      "qwen3_32b_lora": QWEN3_32B}
"""The architecture of each LoRA recipe."""
DISPLAY_NAMES = {"qwen3_14b_lora": "Qwen3-14B-Base", "qwen3_32b_lora": "Qwen3-32B"}
"""The HF model each LoRA recipe starts from."""

_ONE_NODE = ModelConfig(tensor_model_parallel_size=8, bf16=True, sequence_parallel=True, recompute_granularity="full",
                        recompute_method="uniform", recompute_num_layers=1)
"""TP = 8 over the node (both models have 8 KV heads), sequence parallelism, full recomputation of
single layers: the one replica holds a whole 16k-token sequence."""

LAYOUTS: Dict[str, ParallelLayout] = {
    # Full fine-tuning fits one node only with vLLM at 0.35 (70.1 GB, ~18 min a step); the
    # adapters free 29 GB of gradients and optimizer state, which buy vLLM 0.55 of the card
    # (2.0M KV tokens instead of 1.2M): 58.4 GB. Without recomputation it would be 81.4 GB.
    "qwen3_14b_lora": ParallelLayout(num_nodes=1, model=_ONE_NODE, vllm_tensor_parallel_size=8,
                                     vllm_gpu_memory_utilization=0.55, lora_rank=LORA_RANK),
    # The 32B's full fine-tune holds 81.3 GB of training state per GPU before vLLM; with the
    # adapters 16.9 GB, and vLLM TP=8 at 0.55 (8.2 GB of weights a GPU, 1.1M KV tokens): 64.2 GB.
    "qwen3_32b_lora": ParallelLayout(num_nodes=1, model=_ONE_NODE, vllm_tensor_parallel_size=8,
                                     vllm_gpu_memory_utilization=0.55, lora_rank=LORA_RANK),
}
"""The layout of each LoRA recipe (`stapo_megatron.recipes.memory.memory_estimate`)."""


def paper_recipe(size: str, method: str = "stapo", run_dir: Optional[str] = None) -> TrainerConfig:
    """The LoRA recipe ``size`` (`LAYOUTS`): `paper.paper_recipe`'s protocol for ``method`` with
    the layout's model and vLLM settings, the ``lora`` section and `LORA_LR` (warm-up as the
    paper's). A KL term (``method="grpo"``) costs no reference copy and keeps vLLM's share."""
    if size not in LAYOUTS:
        raise ValueError(f"size must be one of {sorted(LAYOUTS)}, got {size!r}")
    layout = LAYOUTS[size]
    cfg = paper.paper_recipe("qwen3_14b", method, run_dir or f"runs/{size}_{method}")
    return dataclasses.replace(
        cfg, model=dataclasses.replace(layout.model), micro_batch_size=layout.micro_batch_size,
        max_tokens_per_microbatch=rank_tokens(layout.seq_len, layout.context_parallel_size) * layout.micro_batch_size,
        rollout=dataclasses.replace(cfg.rollout, tensor_parallel_size=layout.vllm_tensor_parallel_size,
                                    gpu_memory_utilization=layout.vllm_gpu_memory_utilization),
        optim=dataclasses.replace(cfg.optim, lr=LORA_LR),
        lora=LoraConfig(rank=layout.lora_rank, alpha=LORA_ALPHA))


def qwen3_14b_lora(method: str = "stapo", run_dir: Optional[str] = None) -> TrainerConfig:
    """Qwen3-14B-Base with LoRA r=32 on 1 node x 8 GPUs: TP=8, full recomputation, vLLM TP=8 at 0.55."""
    return paper_recipe("qwen3_14b_lora", method, run_dir)


def qwen3_32b_lora(method: str = "stapo", run_dir: Optional[str] = None) -> TrainerConfig:
    """Qwen3-32B with LoRA r=32 on 1 node x 8 GPUs: TP=8, full recomputation, vLLM TP=8 at 0.55."""
    return paper_recipe("qwen3_32b_lora", method, run_dir)


def layout_for(size: str, cfg: TrainerConfig) -> ParallelLayout:
    """The `ParallelLayout` of ``cfg`` (after overrides) on the recipe's node."""
    return ParallelLayout.of(cfg, LAYOUTS[size].cluster)


def full_finetune_problems(size: str) -> List[str]:
    """Why the recipe's model cannot be fully fine-tuned on the recipe's GPUs and layout (the
    recipe without its ``lora`` section, at its learning rate's scale that does not matter here):
    the paper check's problems (`paper.layout_problems`)."""
    cfg = dataclasses.replace(paper_recipe(size), lora=None)
    return paper.layout_problems(ARCHITECTURES[size], layout_for(size, cfg), cfg)


def check_paper_config(size: str, cfg: TrainerConfig, num_nodes: Optional[int] = None,
                       gpus_per_node: Optional[int] = None, check_paths: bool = True) -> None:
    """`paper.check_paper_config` for a LoRA recipe: ValueError naming every problem of the
    layout on ``num_nodes`` x ``gpus_per_node`` GPUs (default: the recipe's node) and, with
    ``check_paths``, each path left to the user."""
    default = LAYOUTS[size]
    layout = ParallelLayout.of(cfg, Cluster(num_nodes or default.num_nodes, gpus_per_node or default.gpus_per_node))
    problems = paper.layout_problems(ARCHITECTURES[size], layout, cfg)
    if cfg.lora is None:
        problems.append(f"lora is None: recipe {size} trains LoRA adapters (set lora.rank=...; full fine-tuning "
                        f"is the paper recipes')")
    if check_paths:
        for field, value, what in (
            ("model.hf_dir", cfg.model.hf_dir, f"the HF folder of {DISPLAY_NAMES[size]}"),
            ("model.megatron_ckpt", cfg.model.megatron_ckpt, "its `stapo-convert hf-to-mcore` checkpoint"),
            ("data.train_path", cfg.data.train_path, "DAPO-Math-17k, parquet or JSONL"),
            ("data.eval_path", cfg.data.eval_path or cfg.eval.sets, "a held-out JSONL/parquet, or eval.sets"),
        ):
            if not value:
                problems.append(f"{field} is not set ({what})")
    if problems:
        raise ValueError(f"recipe {size} cannot run:\n  - " + "\n  - ".join(problems))


def recipe_module(recipe: str):
    """The module that holds the cluster recipe ``recipe``: this one for `LAYOUTS`, else `paper`."""
    return sys.modules[__name__] if recipe in LAYOUTS else paper
