"""Pure tensor transforms between HF Qwen and Megatron parameter layouts.

Legend: ``ng`` query groups (HF num_key_value_heads), ``nh`` query heads, ``d`` head dim
(kv_channels), ``H`` hidden size, ``F`` ffn hidden size, ``V`` vocabulary, ``*`` any trailing
dims (``(H,)`` for weights, ``()`` for biases).

Megatron's fused ``linear_qkv`` stores, per query group, that group's ``nh/ng`` query heads,
then its key head, then its value head: rows ``[g0: q.. k v | g1: q.. k v | ...]``. TP shards
are contiguous runs of whole groups, so the same layout holds for any TP size that divides ng.

With an output gate (Qwen3.5's full attention, megatron-core ``attention_output_gate``) HF's
q_proj holds ``[query_h; gate_h]`` per head and Megatron's group holds its query heads, then their
gates, then k, then v: ``[g0: q.. gate.. k v | ...]``.

Megatron's gated delta net (megatron-core ``ssm/gated_delta_net.py``) fuses its input
projections into ``in_proj`` = ``[query; key; value; z; beta; alpha]`` and its convolution over
``[query; key; value]`` channels, both *per TP shard* like linear_fc1 (`merge_tp_pieces`); its
dist checkpoint stores each piece under its own key (``in_proj.weight.query`` ...).

Megatron's ``linear_fc1`` (SwiGLU) holds ``[gate; up]`` *per TP shard*: with TP=t the full
in-memory tensor is ``[gate_0; up_0; gate_1; up_1; ...]``. Its dist-checkpoint form (see
megatron.core.transformer.mlp.apply_swiglu_sharded_factory) is the TP=1 layout ``[gate; up]``.
"""

from __future__ import annotations

import torch


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int,
              kv_channels: int, gated: bool = False) -> torch.Tensor:
    """HF q/k/v projections (weights ``[rows, H]`` or biases ``[rows]``) -> Megatron linear_qkv.

    Args:
        q: ``[nh*d, *]`` (``gated``: ``[nh*2d, *]``, ``[query_h; gate_h]`` per head); k, v: ``[ng*d, *]``.
    Returns:
        ``[(nh + 2*ng)*d, *]`` in GQA-grouped order (``gated``: ``[(2nh + 2ng)*d, *]``).
    """
    ng, d = num_query_groups, kv_channels
    if gated:
        if q.shape[0] % (2 * d):
            raise ValueError(f"gated q_proj rows {q.shape[0]} are not a multiple of 2 x kv_channels {d}")
        heads = q.reshape(-1, 2, d, *q.shape[1:])  # [nh, (query, gate), d, *]
        q = torch.cat([heads[:, 0].reshape(ng, -1, *q.shape[1:]), heads[:, 1].reshape(ng, -1, *q.shape[1:])],
                      dim=1).reshape(-1, *q.shape[1:])  # per group: its queries, then their gates
    if k.shape != v.shape or k.shape[0] != ng * d or q.shape[0] % (ng * d) or q.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"q/k/v shapes {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)} do not fit "
            f"num_query_groups={ng} x kv_channels={d}"
        )
    tail = q.shape[1:]
    q_g = q.reshape(ng, -1, *tail)  # [ng, (nh/ng)*d, *]
    k_g = k.reshape(ng, d, *tail)
    v_g = v.reshape(ng, d, *tail)
    return torch.cat([q_g, k_g, v_g], dim=1).reshape(-1, *tail)


def _check_qkv_rows(qkv: torch.Tensor, nh: int, ng: int, d: int, gated: bool = False) -> None:
    nq = 2 * nh if gated else nh
    if qkv.shape[0] != (nq + 2 * ng) * d:
        raise ValueError(
            f"linear_qkv has {qkv.shape[0]} rows, expected ({'2 x ' if gated else ''}num_attention_heads {nh} + "
            f"2 x num_query_groups {ng}) x kv_channels {d} = {(nq + 2 * ng) * d}"
        )


def split_qkv(qkv: torch.Tensor, num_attention_heads: int, num_query_groups: int,
              kv_channels: int, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `merge_qkv`: Megatron linear_qkv ``[(nh+2ng)*d, *]`` -> (q, k, v)."""
    q, k, v = split_qkv_pieces(qkv, num_attention_heads, num_query_groups, kv_channels, gated)
    return torch.cat(q), torch.cat(k), torch.cat(v)


def split_qkv_pieces(qkv: torch.Tensor, num_attention_heads: int, num_query_groups: int,
                     kv_channels: int, gated: bool = False
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """`split_qkv` without copies: contiguous row views of a contiguous linear_qkv, per query
    group (``gated``: per head, its query then its gate); concatenating each list gives q, k, v
    (streaming writers append the pieces)."""
    nh, ng, d = num_attention_heads, num_query_groups, kv_channels
    _check_qkv_rows(qkv, nh, ng, d, gated)
    qn = nh // ng * d
    per_group = qkv.reshape(ng, (qn * (2 if gated else 1)) + 2 * d, *qkv.shape[1:])
    if gated:  # HF's q_proj: [query_h; gate_h] for each head h of each group
        q = [g[part + h * d: part + (h + 1) * d] for g in per_group for h in range(nh // ng) for part in (0, qn)]
        qn *= 2
    else:
        q = [g[:qn] for g in per_group]
    return (q, [g[qn:qn + d] for g in per_group], [g[qn + d:] for g in per_group])


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor, tensor_model_parallel_size: int = 1) -> torch.Tensor:
    """HF gate_proj/up_proj ``[F, H]`` -> Megatron linear_fc1 ``[2F, H]`` for TP size t.

    t=1 gives the checkpoint layout ``[gate; up]``; t>1 the concatenation of the t in-memory
    shards ``[gate_i; up_i]``.
    """
    if gate.shape != up.shape:
        raise ValueError(f"gate_proj shape {tuple(gate.shape)} != up_proj shape {tuple(up.shape)}")
    t = tensor_model_parallel_size
    if gate.shape[0] % t:
        raise ValueError(f"tensor_model_parallel_size {t} does not divide ffn rows {gate.shape[0]}")
    tail = gate.shape[1:]
    per_shard = torch.stack([gate.reshape(t, -1, *tail), up.reshape(t, -1, *tail)], dim=1)
    return per_shard.reshape(-1, *tail)  # [t, 2, F/t, *] -> [2F, *]


def split_gate_up(fc1: torch.Tensor, tensor_model_parallel_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `merge_gate_up`: linear_fc1 ``[2F, H]`` -> (gate ``[F, H]``, up ``[F, H]``)."""
    t = tensor_model_parallel_size
    if fc1.shape[0] % (2 * t):
        raise ValueError(f"linear_fc1 rows {fc1.shape[0]} not divisible by 2 x TP {t}")
    tail = fc1.shape[1:]
    per_shard = fc1.reshape(t, 2, -1, *tail)
    return per_shard[:, 0].reshape(-1, *tail), per_shard[:, 1].reshape(-1, *tail)


def merge_tp_pieces(pieces: list[torch.Tensor], tensor_model_parallel_size: int = 1) -> torch.Tensor:
    """Column-parallel pieces ``[r_j, *]`` -> one fused weight whose TP shard i is ``[p0_i; p1_i; ...]``
    (each piece split in t equal row blocks): the delta net's in_proj and conv1d for TP size t."""
    t = tensor_model_parallel_size
    bad = [tuple(p.shape) for p in pieces if p.shape[0] % t]
    if bad:
        raise ValueError(f"tensor_model_parallel_size {t} does not divide the rows of pieces {bad}")
    return torch.cat([block for i in range(t) for block in (p.chunk(t)[i] for p in pieces)])


def split_tp_pieces(fused: torch.Tensor, rows: list[int], tensor_model_parallel_size: int = 1) -> list[torch.Tensor]:
    """Inverse of `merge_tp_pieces`: the pieces of ``rows`` rows each."""
    t = tensor_model_parallel_size
    if fused.shape[0] != sum(rows) or any(r % t for r in rows):
        raise ValueError(f"fused weight of {fused.shape[0]} rows does not split into pieces {rows} over TP {t}")
    shards = [torch.split(s, [r // t for r in rows]) for s in fused.chunk(t)]
    return [torch.cat([shard[j] for shard in shards]) for j in range(len(rows))]


def pad_vocab(weight: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """Append zero rows to ``[V, H]`` up to ``[padded_vocab_size, H]``.

    Zero rows give padding tokens a zero embedding and a zero logit; Megatron never samples
    them because the trainer and exporters cut logits back to V.
    """
    rows = weight.shape[0]
    if padded_vocab_size < rows:
        raise ValueError(f"padded vocabulary {padded_vocab_size} smaller than {rows} rows")
    if padded_vocab_size == rows:
        return weight
    pad = weight.new_zeros(padded_vocab_size - rows, *weight.shape[1:])
    return torch.cat([weight, pad], dim=0)


def unpad_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """First ``vocab_size`` rows of a padded ``[Vp, H]`` embedding or output weight."""
    if weight.shape[0] < vocab_size:
        raise ValueError(f"weight has {weight.shape[0]} rows, fewer than vocab_size {vocab_size}")
    return weight[:vocab_size]


def tp_shard(tensor: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The ``tp_rank``-th of ``tp_size`` equal contiguous chunks along ``dim``."""
    if tensor.shape[dim] % tp_size:
        raise ValueError(f"TP size {tp_size} does not divide dim {dim} of shape {tuple(tensor.shape)}")
    return tensor.chunk(tp_size, dim=dim)[tp_rank]
