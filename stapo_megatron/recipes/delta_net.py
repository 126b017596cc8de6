"""Qwen3.5's gated delta-net layers in the memory and step-time models: what a delta-net layer
holds and computes where a full-attention layer would hold a KV cache and compute attention.

A Qwen3.5 text model (`stapo_megatron.bridge.hybrid_config`) has ``layer_types`` with three of
every four layers a gated delta net (linear attention) and the fourth gated full attention. For
the recipes' models that changes four things, each a function here that `recipes.memory` and
`recipes.step_model` call (a model without delta-net layers gets what it got before):

- **parameters**: the token mixer of a delta-net layer is in_proj (q, k, v, z rows and the b, a
  rows of its value heads), a depthwise causal conv1d over q/k/v, A_log and dt_bias per value
  head, the gated RMSNorm (one value-head-sized weight) and out_proj
  (`stapo_megatron.bridge.hybrid_config.delta_net_params`), not q/k/v/o and q/k norms;
- **vLLM's cache**: only full-attention layers keep K and V per token (`kv_bytes_per_token`);
  a delta-net layer keeps, per sequence, its recurrent state (value heads x key dim x value dim,
  fp32: the checkpoints' ``mamba_ssm_dtype``) and its conv state (the last kernel - 1 inputs of
  the conv, bf16): constant in the sequence's length (`state_bytes_per_sequence`);
- **activations** (`kept_mixer_bytes`, `recompute_mixer_bytes`): what the token mixer keeps for
  its backward, counted op by op from megatron-core 0.16.1's ``GatedDeltaNet.forward`` and fla's
  ``chunk_gated_delta_rule``; not yet measured on a GPU (the full-attention count was, within
  1.1%);
- **FLOPs** (`delta_rule_flops_per_token`): the chunked delta rule is linear in the sequence's
  length; the projections are in the parameter count (2 FLOPs a parameter and token), and only
  the full-attention layers add the quadratic causal-attention term.

Context parallelism is not modelled: the bridge builds the gated delta net without it (0.16 and
0.17 have none), and the layout check refuses it (`stapo_megatron.bridge.hybrid_config.delta_net_layout_problems`).
"""

from __future__ import annotations

from stapo_megatron.bridge.hybrid_config import FULL_ATTENTION, LINEAR_ATTENTION, delta_net_dims, delta_net_params

CHUNK_SIZE = 64
"""Tokens per chunk of fla's ``chunk_gated_delta_rule`` (its default ``BT``): the intra-chunk
matrices are chunk-sized per token."""
STATE_DTYPE_BYTES = 4
"""The recurrent state in fp32 (Qwen3.5's config ``mamba_ssm_dtype: float32``; vLLM keeps it so)."""
CONV_STATE_DTYPE_BYTES = 2
"""The conv state in the model's bf16."""


def num_linear_layers(spec) -> int:
    """Delta-net (linear attention) layers of ``spec`` (0 for a Qwen2/3 model)."""
    return len(spec.layers_of_type(LINEAR_ATTENTION)) if spec.is_hybrid else 0


def num_attention_layers(spec) -> int:
    """Layers with full (quadratic, KV-cached) attention: all of a Qwen2/3 model's."""
    return len(spec.layers_of_type(FULL_ATTENTION)) if spec.is_hybrid else spec.num_layers


def attention_mixer_params(spec) -> int:
    """Parameters of one full-attention token mixer: q (with the output gate's rows when
    ``attention_output_gate``), k, v, o and the q/k norms."""
    h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
    gate = q if spec.attention_output_gate else 0
    return h * (q + gate + 2 * kv) + q * h + (2 * spec.kv_channels if spec.qk_layernorm else 0)


def mixer_params_difference(spec) -> int:
    """Parameters a delta-net layer has more than a full-attention layer (negative: fewer); the
    rest of the layer (norms, MLP or experts) is the same."""
    return delta_net_params(spec) - attention_mixer_params(spec) if spec.is_hybrid else 0


def kv_bytes_per_token(spec, tensor_parallel_size: int = 1) -> float:
    """bf16 K and V of every full-attention layer for one token, over vLLM's TP."""
    return 2 * num_attention_layers(spec) * spec.kv_size * 2 / tensor_parallel_size


def recurrent_state_bytes(spec, tensor_parallel_size: int = 1) -> float:
    """One sequence's recurrent states (value heads x key head dim x value head dim, fp32) in
    every delta-net layer, over vLLM's TP (which splits the heads)."""
    per_layer = spec.linear_num_value_heads * spec.linear_key_head_dim * spec.linear_value_head_dim
    return num_linear_layers(spec) * per_layer * STATE_DTYPE_BYTES / tensor_parallel_size


def conv_state_bytes(spec, tensor_parallel_size: int = 1) -> float:
    """One sequence's conv states (the last kernel - 1 inputs of each q/k/v channel, bf16) in
    every delta-net layer, over vLLM's TP."""
    channels = delta_net_dims(spec)["conv"]
    return (num_linear_layers(spec) * channels * (spec.linear_conv_kernel_dim - 1) * CONV_STATE_DTYPE_BYTES
            / tensor_parallel_size)


def state_bytes_per_sequence(spec, tensor_parallel_size: int = 1) -> float:
    """What vLLM holds per running sequence for the delta-net layers, whatever its length."""
    return recurrent_state_bytes(spec, tensor_parallel_size) + conv_state_bytes(spec, tensor_parallel_size)


def kv_cache_tokens(spec, free_bytes: float, tensor_parallel_size: int, seq_len: int) -> int:
    """Tokens of cache ``free_bytes`` hold on one vLLM rank: all of it K and V for a model of
    full-attention layers; for a hybrid model, sequences of ``seq_len`` tokens each with its
    delta-net states (`state_bytes_per_sequence`), counted in their tokens."""
    per_token = kv_bytes_per_token(spec, tensor_parallel_size)
    free = max(0.0, free_bytes)
    if not spec.is_hybrid:
        return int(free / per_token)
    sequences = free / (seq_len * per_token + state_bytes_per_sequence(spec, tensor_parallel_size))
    return int(sequences * seq_len)


def kept_mixer_bytes(spec, tensor_parallel_size: int) -> float:
    """Bytes per token a delta-net token mixer keeps for its backward (after its input norm,
    which a full-attention layer has too), on this TP rank, op by op:

    - in_proj's q/k/v rows into the conv, the conv's output (kept by SiLU) and SiLU's output:
      6 conv (conv = 2 qk + v channels);
    - fla's l2norm of q and k keeps its bf16 outputs: 4 qk;
    - q and k repeated to the value heads (the kernel's inputs): 4 heads x key head dim;
    - the kernel's g (fp32), beta (bf16) and its intra-chunk matrix (fp32, `CHUNK_SIZE` a token
      and head; fla recomputes the chunk states in its backward): (6 + 4 `CHUNK_SIZE`) heads;
    - the kernel's output (2 v), the gated RMSNorm's fp32 input copy and output (8 v), the fp32
      gate and normalised output its product keeps (8 v), and out_proj's bf16 input (2 v): 20 v.

    All of it split over TP (heads and channels are); an estimate, not yet measured on a GPU."""
    d = delta_net_dims(spec)
    heads, qk, v = d["heads"], d["qk"], d["v"]
    repeated = 4 * heads * spec.linear_key_head_dim
    return (6 * d["conv"] + 4 * qk + repeated + (6 + 4 * CHUNK_SIZE) * heads + 20 * v) / tensor_parallel_size


def attention_mixer_bytes(spec, layout) -> float:
    """Bytes per token a full-attention token mixer keeps after its input norm (`recipes.memory.
    kept_layer_bytes`: q/k norms, attention, the K/V gathered over CP with ``cp_comm_type``
    "all_gather", Qwen3.5's output gate), over TP (``layout``: a `recipes.memory.ParallelLayout`)."""
    q, kv, cp = spec.q_size, spec.kv_size, layout.context_parallel_size
    gathered = 4 * kv * (cp - 1) if layout.cp_comm_type == "all_gather" else 0
    gate = 6 * q if spec.attention_output_gate else 0
    return (14 * (q + kv) + gathered + gate) / layout.tensor_model_parallel_size


def kept_mixer_difference(spec, layout) -> float:
    """Bytes per token the delta-net layers keep beyond what as many full-attention layers would
    (`kept_mixer_bytes` less `attention_mixer_bytes`, each); 0 without delta-net layers."""
    if not spec.is_hybrid:
        return 0.0
    mixer = kept_mixer_bytes(spec, layout.tensor_model_parallel_size)
    return num_linear_layers(spec) * (mixer - attention_mixer_bytes(spec, layout))


def recompute_mixer_bytes(spec, tensor_parallel_size: int) -> float:
    """bf16 elements per token (over TP) full recomputation rebuilds of a delta-net token mixer:
    in_proj's q/k/v and z outputs, the conv's output, the kernel's output and the gated norm's:
    2 conv + 3 v (the full-attention count is 2 q + 2 kv)."""
    d = delta_net_dims(spec)
    return (2 * d["conv"] + 3 * d["v"]) / tensor_parallel_size


def delta_rule_flops_per_token(spec) -> float:
    """Forward FLOPs per token of the delta rule in every delta-net layer, beyond its
    projections (which the parameter count covers): per value head, the chunked form's
    intra-chunk products (k k^T, q k^T, the triangular solve's and the output's products with
    v: about 2 `CHUNK_SIZE` (key + value head dim) for causal chunks) and the state's three
    products (read by w and q, updated by k: 6 key x value head dim); plus the depthwise conv
    (2 x channels x kernel). Linear in the sequence length: no term grows with the context."""
    if not spec.is_hybrid:
        return 0.0
    d = delta_net_dims(spec)
    dk, dv = spec.linear_key_head_dim, spec.linear_value_head_dim
    per_head = 2 * CHUNK_SIZE * (dk + dv) + 6 * dk * dv
    return num_linear_layers(spec) * (d["heads"] * per_head + 2 * d["conv"] * spec.linear_conv_kernel_dim)
