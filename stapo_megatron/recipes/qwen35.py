"""The paper's recipe on Qwen3.5: the dense Qwen3.5-27B and the mixture-of-experts Qwen3.5-35B-A3B.

The architectures are the HF text configs (``text_config`` of the released checkpoints) read by the
converter's own mapping (`stapo_megatron.bridge.hf_config.spec_from_hf_config`), so the recipes
count what ``stapo-convert`` builds. The STAPO settings are the Qwen3 recipes' (`paper.paper_recipe`:
JustRL + S2T, 3000 steps, lr 1e-6, 256 x 8 rollouts, 16k-token sequences); only the layout differs,
chosen with the memory model (`recipes.memory`, with the delta-net layers of `recipes.delta_net`):

- the layouts have no context parallelism, so a 16k sequence is whole on a rank (Qwen3.5 runs
  with CP from megatron-core 0.19, `bridge.hybrid`; the layout check refuses
  ``model.context_parallel_size`` > 1 on 0.16 to 0.18);
- the packed delta-net layer is built without sequence parallelism (on 0.16 and 0.17 it runs each
  sequence on its own, whole on every TP rank), so packing (``packing="budget"``) goes without
  sequence parallelism, and sequence parallelism with ``packing="padded"`` (which pipeline
  parallelism needs too);
- vLLM's TP must divide the KV heads (4 for the 27B, 2 for the 35B-A3B) and Megatron's TP.

`QWEN35_LAYOUTS` and `QWEN35_ARCHITECTURES` join `paper.LAYOUTS` / `paper.ARCHITECTURES`, so
``paper_recipe("qwen35_27b")`` (``paper.qwen35_27b()``, ``paper.qwen35_35b_a3b()``), the launchers'
dry runs and ``scripts/memory_table.py`` take them as they take the Qwen3 recipes.
"""

from __future__ import annotations

from typing import Dict

from stapo_megatron.bridge.hf_config import QwenSpec, spec_from_hf_config
from stapo_megatron.mcore.config import ModelConfig
from stapo_megatron.recipes.memory import ParallelLayout

_QWEN35_TEXT = dict(
    hidden_act="silu", attention_bias=False, rms_norm_eps=1e-6, vocab_size=248320, tie_word_embeddings=False,
    max_position_embeddings=262144, head_dim=256, full_attention_interval=4, linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, mtp_num_hidden_layers=1,
    initializer_range=0.02,
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25),
)
"""What the two released text configs share: the 248,320-token vocabulary, untied embeddings,
head_dim 256, partial rotary 0.25 at rope_theta 1e7, RMSNorm eps 1e-6, three delta-net layers of
every four (``full_attention_interval`` 4, transformers' default ``layer_types``), delta-net heads
of 128 channels and 16 key heads, a conv kernel of 4, one MTP layer, 262,144 positions.
Sources: transformers' ``Qwen3_5TextConfig`` / ``Qwen3_5MoeTextConfig`` defaults (its docstring
checkpoints are Qwen/Qwen3.5-27B and Qwen/Qwen3.5-35B-A3B), the released ``config.json`` as
quoted by public conversion code (slime's ``scripts/models/qwen3.5-27B.sh`` and
``qwen3.5-35B-A3B.sh``: rotary base 1e7, untied embeddings, 0.25 rotary). Not checked against
the hub file itself here (no network): ``max_position_embeddings`` (262,144: the model card's
context, transformers' default is 32,768; it changes nothing these recipes compute) and
``mtp_num_hidden_layers`` 1 for the 35B-A3B (carried unchanged by the converter, not trained)."""

QWEN35_27B_CONFIG = dict(
    _QWEN35_TEXT, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=5120,
    intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
    linear_num_value_heads=48)
"""Qwen/Qwen3.5-27B's text config: 64 layers (48 delta net, 16 gated full attention) of width
5120, SwiGLU 17408, 24 query heads over 4 KV heads, 48 delta-net value heads (slime's 27B script
gives the attention and MLP shapes; the delta-net value heads, 48, are what public copies of the
27B's ``text_config`` list, not checked against the hub file; transformers' defaults are the 9B's
32). 26.9B parameters by
`num_params` (the card: 27B, its vision tower aside)."""

QWEN35_35B_A3B_CONFIG = dict(
    _QWEN35_TEXT, architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", hidden_size=2048,
    num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, linear_num_value_heads=32,
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    router_aux_loss_coef=0.001)
"""Qwen/Qwen3.5-35B-A3B's text config (transformers' ``Qwen3_5MoeTextConfig`` defaults, which
slime's 35B-A3B script repeats): 40 layers (30 delta net, 10 gated full attention) of width 2048,
16 query heads over 2 KV heads, 32 delta-net value heads, every MLP 256 routed experts (top-8,
width 512) and a gated shared expert of width 512. 34.7B parameters, 3.5B active per token by
`num_params` / `num_active_params` (the card: 35B, 3B active)."""

QWEN35_ARCHITECTURES: Dict[str, QwenSpec] = {
    "qwen35_27b": spec_from_hf_config(QWEN35_27B_CONFIG),
    "qwen35_35b_a3b": spec_from_hf_config(QWEN35_35B_A3B_CONFIG),
}
"""The architecture of each Qwen3.5 recipe (read by the converter's mapping)."""
QWEN35_DISPLAY_NAMES = {"qwen35_27b": "Qwen3.5-27B", "qwen35_35b_a3b": "Qwen3.5-35B-A3B"}
"""The HF model each Qwen3.5 recipe starts from (Qwen3.5 has no separate -Base release of these sizes)."""


def _model(tensor_model_parallel_size: int, sequence_parallel: bool, **changes) -> ModelConfig:
    """A Qwen3.5 recipe's `ModelConfig`: bf16 and full recomputation of single layers, CP 1."""
    return ModelConfig(tensor_model_parallel_size=tensor_model_parallel_size, bf16=True,
                       sequence_parallel=sequence_parallel, recompute_granularity="full", recompute_method="uniform",
                       recompute_num_layers=1, **changes)


QWEN35_LAYOUTS: Dict[str, ParallelLayout] = {
    # 8 nodes: TP=4 (the 4 KV heads), PP=2 (32 layers a stage), DP=8, full recomputation,
    # sequence parallelism with padded micro-batches (pipeline parallelism needs them; a
    # micro-batch is one sequence, so nothing is padded). At PP=1 the weights, fp32 gradients
    # and optimizer of 6.7B parameters a rank leave no room for vLLM's 13.4 GB of weights
    # (92.8 GB at a 0.3 share, sequence parallelism off for packing). vLLM TP=4 at 0.4: 1.0M
    # tokens of KV cache per rank (16 of 64 layers keep K and V; each sequence's delta-net
    # states take 38 MB a rank).
    "qwen35_27b": ParallelLayout(num_nodes=8, model=_model(4, True, pipeline_model_parallel_size=2),
                                 vllm_tensor_parallel_size=4, vllm_gpu_memory_utilization=0.4),
    # MoE, 8 nodes: TP=2 (the 2 KV heads bound Megatron's and vLLM's TP), EP=64 with ETP=1 (4
    # whole experts a rank), DP=32, full recomputation, packed micro-batches without sequence
    # parallelism. vLLM TP=2 holds 34.7 GB of bf16 weights a rank, so its share is 0.5 (6 GB of
    # cache, ~31 sequences of 16k tokens; 0.46 beside GRPO's 3.5 GB reference: ~14 sequences);
    # EP=32 on 8 nodes is 82.0 GB, 4 nodes at EP=32 88.4 GB.
    "qwen35_35b_a3b": ParallelLayout(num_nodes=8, model=_model(2, False, expert_model_parallel_size=64,
                                                               expert_tensor_parallel_size=1),
                                     vllm_tensor_parallel_size=2, vllm_gpu_memory_utilization=0.5,
                                     vllm_gpu_memory_utilization_with_reference=0.46),
}
"""The parallel layout of each Qwen3.5 recipe (see `memory_estimate` and the table of docs/recipes.md)."""

QWEN35_PACKING = {"qwen35_27b": "padded", "qwen35_35b_a3b": "budget"}
"""``packing`` of each Qwen3.5 recipe: padded where pipeline parallelism needs it (one sequence a
micro-batch, with sequence parallelism), else the Qwen3 recipes' budget packing."""

