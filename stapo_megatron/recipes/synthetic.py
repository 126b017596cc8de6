"""Synthetic rollouts and a tiny Qwen3 GPTModel (from `bridge.tiny`'s spec): the demo and tests need
no checkpoint.

Rollouts are G responses per prompt with binary rewards and group advantages (docs/design.md):
A_i = (R_i - mean_j R_j) / (std_j R_j + eps); groups with all-equal rewards get A = 0.
Token ids are random; what matters for exercising STAPO is that the model's probabilities of
the sampled tokens span the S2T thresholds.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from stapo_megatron.bridge.kernels import fused_kernel_settings
from stapo_megatron.bridge.tiny import QWEN3_TINY, tiny_qwen3_spec
from stapo_megatron.bridge.transformer_config import transformer_config_from_spec
from stapo_megatron.batch.microbatch import MicroBatch, group_advantages


def tiny_gpt_config(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_query_groups: int = 2,
    kv_channels: int = 32,
    ffn_hidden_size: int = 128,
):
    """The TransformerConfig of a tiny Qwen3 (`bridge.tiny.tiny_qwen3_spec`: RMSNorm, SwiGLU, GQA,
    q/k norm, no biases) on fp32, with these sizes, for the local layer spec on the CPU kernels.

    ``use_cpu_initialization`` creates every weight at full size from one seed and then shards
    it, so a given seed yields the same model at any TP/PP (the basis of the parity tests).
    """
    spec = tiny_qwen3_spec(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                           num_query_groups=num_query_groups, kv_channels=kv_channels, ffn_hidden_size=ffn_hidden_size)
    return transformer_config_from_spec(
        spec, tensor_model_parallel_size, pipeline_model_parallel_size, use_te=False,
        use_cpu_initialization=True, calculate_per_token_loss=True,
        # the unfused kernels whatever the machine (the local spec's reference path)
        **fused_kernel_settings(use_te=False, cuda=False))


def build_tiny_gpt(config, vocab_size: int, max_seq_length: int, seed: int = 1234, core_attention: str = "local"):
    """GPTModel with Megatron's local layer spec for this rank's pipeline stage; ``core_attention``
    "sdpa" swaps in `stapo_megatron.bridge.attention.SDPAttention` (needed for packed batches)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    if core_attention == "sdpa":
        from stapo_megatron.bridge.attention import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    elif core_attention != "local":
        raise ValueError(f'core_attention must be "local" or "sdpa", got {core_attention!r}')
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return GPTModel(
        config,
        spec,
        vocab_size=vocab_size,
        max_sequence_length=max_seq_length,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=QWEN3_TINY.rotary_base,
    )


def synthetic_rollouts(
    num_prompts: int,
    group_size: int,
    prompt_len: int,
    response_len: int,
    vocab_size: int,
    seed: int,
    micro_batch_size: int,
) -> Tuple[List[Dict[str, torch.Tensor]], Dict[str, float]]:
    """Random prompts/responses with Bernoulli(0.5) rewards, split into micro-batches.

    Response lengths vary (a random cut per sequence); labels are the next tokens and
    ``response_mask`` is True where the label is a response token. ``old_logprob`` is filled
    in by the caller's pi_old pass (``schedule.old_policy_pass``). Returns (micro-batches, stats).
    """
    gen = torch.Generator().manual_seed(seed)
    num_seq = num_prompts * group_size
    seq_len = prompt_len + response_len
    tokens = torch.randint(0, vocab_size, (num_seq, seq_len), generator=gen)
    lengths = torch.randint(response_len // 2, response_len + 1, (num_seq,), generator=gen)
    rewards = (torch.rand(num_prompts, group_size, generator=gen) < 0.5).float()
    adv_PG, num_flat = group_advantages(rewards)
    positions = torch.arange(seq_len)
    # label at position t is token t+1; it is a response token if prompt_len <= t+1 < end
    label_pos = positions + 1
    response_mask = (label_pos >= prompt_len) & (label_pos[None, :] < (prompt_len + lengths)[:, None])
    labels = torch.roll(tokens, -1, dims=1)
    advantages = adv_PG.reshape(num_seq, 1).expand(num_seq, seq_len).contiguous()
    microbatches = []
    for start in range(0, num_seq, micro_batch_size):
        sl = slice(start, start + micro_batch_size)
        microbatches.append(
            MicroBatch(
                tokens=tokens[sl],
                position_ids=positions.expand(tokens[sl].shape[0], seq_len).contiguous(),
                labels=labels[sl],
                response_mask=response_mask[sl],
                advantages=advantages[sl],
                seed=seed * 100_003 + start,
            )
        )
    stats = dict(reward_mean=rewards.mean().item(), num_flat_groups=num_flat)
    return microbatches, stats
