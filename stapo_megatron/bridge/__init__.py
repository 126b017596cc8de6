"""HF Qwen <-> Megatron bridge: config reading (`hf_config`), kernel choice (`kernels`),
TransformerConfig (`transformer_config`), model builder, mapping table, transforms.

Dense Qwen2/2.5/3 and Qwen3-MoE (`hf_config.py` reads the router and expert fields,
`transformer_config.py` maps them; `model.py` builds the MoE layer spec; `mapping.py` has the
router/expert rows with a per-expert wildcard); the Qwen3.5 text models, dense and MoE (`hybrid_config.py` reads
its layer pattern and delta-net fields, `hybrid.py` builds its gated delta-net and gated
full-attention layers, `mapping.py` has their rows, per layer type); the text tower of Qwen3.5's
vision-language checkpoints (`vision_language.py`: its config and tensor names; the vision tower
is kept aside by the converter).

Used by the converter (`stapo_megatron/conversion/`), the trainer and the rollout weight sync. Importing it
does not import megatron-core; the functions that need it import it when called.
"""

from stapo_megatron.bridge.hf_config import SUPPORTED_ARCHITECTURES, QwenSpec, load_hf_config, spec_from_hf_config
from stapo_megatron.bridge.transformer_config import (
    DEFAULT_VOCAB_DIVISOR,
    check_parallel_sizes,
    padded_vocab_size,
    transformer_config_from_spec,
)
from stapo_megatron.bridge.mapping import ParamMapping, hf_shapes, mappings_for, megatron_shape
from stapo_megatron.bridge.model import build_gpt_model, layer_spec, load_checkpoint
from stapo_megatron.bridge.transforms import (
    merge_gate_up,
    merge_qkv,
    pad_vocab,
    split_gate_up,
    split_qkv,
    split_qkv_pieces,
    tp_shard,
    unpad_vocab,
)

__all__ = [
    "DEFAULT_VOCAB_DIVISOR", "SUPPORTED_ARCHITECTURES", "QwenSpec", "check_parallel_sizes", "load_hf_config",
    "padded_vocab_size", "spec_from_hf_config", "transformer_config_from_spec", "ParamMapping", "hf_shapes",
    "mappings_for", "megatron_shape", "build_gpt_model", "layer_spec", "load_checkpoint", "merge_gate_up",
    "merge_qkv", "pad_vocab", "split_gate_up", "split_qkv", "split_qkv_pieces", "tp_shard", "unpad_vocab",
]
