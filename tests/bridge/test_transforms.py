"""Tier a: QKV / gate-up / vocabulary transforms against hand-built layouts, and the mapping table."""

import pytest
import torch

from stapo_megatron.bridge import (
    mappings_for,
    merge_gate_up,
    merge_qkv,
    pad_vocab,
    spec_from_hf_config,
    split_gate_up,
    split_qkv,
    split_qkv_pieces,
    tp_shard,
    unpad_vocab,
)
from stapo_megatron.bridge.tiny import tiny_config
from stapo_megatron.bridge.transforms import merge_tp_pieces, split_tp_pieces


def _rows(tag: float, n: int, d: int, width: int = 3) -> torch.Tensor:
    """n*d rows; row r holds tag + r (so every row is identifiable)."""
    return (tag + torch.arange(n * d, dtype=torch.float64)).unsqueeze(1).repeat(1, width)


def test_qkv_grouped_order_by_hand():
    # 4 query heads, 2 groups, head dim 1: rows are [q0 q1 k0 v0 | q2 q3 k1 v1].
    q, k, v = _rows(0, 4, 1), _rows(100, 2, 1), _rows(200, 2, 1)
    merged = merge_qkv(q, k, v, num_query_groups=2, kv_channels=1)
    assert merged[:, 0].tolist() == [0, 1, 100, 200, 2, 3, 101, 201]


@pytest.mark.parametrize("nh, ng, d", [(4, 2, 32), (8, 2, 16), (4, 4, 8), (6, 1, 4)])
def test_qkv_roundtrip_weight_and_bias(nh, ng, d):
    q, k, v = torch.randn(nh * d, 5), torch.randn(ng * d, 5), torch.randn(ng * d, 5)
    merged = merge_qkv(q, k, v, ng, d)
    assert merged.shape == ((nh + 2 * ng) * d, 5)
    for a, b in zip(split_qkv(merged, nh, ng, d), (q, k, v)):
        assert torch.equal(a, b)
    qb, kb, vb = torch.randn(nh * d), torch.randn(ng * d), torch.randn(ng * d)  # biases are 1-D
    for a, b in zip(split_qkv(merge_qkv(qb, kb, vb, ng, d), nh, ng, d), (qb, kb, vb)):
        assert torch.equal(a, b)


def test_qkv_pieces_are_contiguous_views():
    nh, ng, d = 8, 2, 4
    merged = merge_qkv(torch.randn(nh * d, 3), torch.randn(ng * d, 3), torch.randn(ng * d, 3), ng, d)
    for pieces, whole in zip(split_qkv_pieces(merged, nh, ng, d), split_qkv(merged, nh, ng, d)):
        assert all(p.is_contiguous() and p.data_ptr() >= merged.data_ptr() for p in pieces)
        assert torch.equal(torch.cat(pieces), whole)


def test_qkv_tp_shard_holds_whole_groups():
    # A TP shard of the merged tensor equals merging that shard's own heads and groups.
    nh, ng, d, tp = 8, 4, 2, 2
    q, k, v = torch.randn(nh * d, 3), torch.randn(ng * d, 3), torch.randn(ng * d, 3)
    merged = merge_qkv(q, k, v, ng, d)
    for r in range(tp):
        local = merge_qkv(tp_shard(q, 0, r, tp), tp_shard(k, 0, r, tp), tp_shard(v, 0, r, tp), ng // tp, d)
        assert torch.equal(tp_shard(merged, 0, r, tp), local)


def test_qkv_shape_errors_name_shapes():
    with pytest.raises(ValueError, match=r"\(8, 3\)/\(4, 3\)/\(2, 3\)"):
        merge_qkv(torch.zeros(8, 3), torch.zeros(4, 3), torch.zeros(2, 3), 2, 2)
    with pytest.raises(ValueError, match="linear_qkv has 10 rows"):
        split_qkv(torch.zeros(10, 3), 4, 2, 2)


def test_gate_up_per_tp_shard_interleave():
    gate, up = _rows(0, 4, 1), _rows(100, 4, 1)
    assert merge_gate_up(gate, up, 1)[:, 0].tolist() == [0, 1, 2, 3, 100, 101, 102, 103]
    two = merge_gate_up(gate, up, 2)
    assert two[:, 0].tolist() == [0, 1, 100, 101, 2, 3, 102, 103]
    # Each TP rank's contiguous shard is its own [gate_i; up_i], as Megatron's SwiGLU expects.
    assert torch.equal(tp_shard(two, 0, 1, 2), torch.cat([gate[2:], up[2:]]))
    for t in (1, 2, 4):
        g, u = split_gate_up(merge_gate_up(gate, up, t), t)
        assert torch.equal(g, gate) and torch.equal(u, up)


def test_vocab_pad_unpad():
    w = torch.randn(300, 8, dtype=torch.bfloat16)
    padded = pad_vocab(w, 384)
    assert padded.shape == (384, 8) and torch.all(padded[300:] == 0)
    assert torch.equal(unpad_vocab(padded, 300), w)
    with pytest.raises(ValueError, match="padded vocabulary 200 smaller than 300"):
        pad_vocab(w, 200)


def test_mapping_table_per_variant():
    names = {v: {m.megatron for m in mappings_for(spec_from_hf_config(tiny_config(v)))}
             for v in ("qwen2", "qwen3", "qwen3-tied")}
    assert "decoder.layers.*.self_attention.linear_qkv.bias" in names["qwen2"]
    assert "decoder.layers.*.self_attention.q_layernorm.weight" not in names["qwen2"]
    assert "decoder.layers.*.self_attention.k_layernorm.weight" in names["qwen3"]
    assert "output_layer.weight" in names["qwen3"] and "output_layer.weight" not in names["qwen3-tied"]


def test_mapping_names_local_spec_and_checkpoint_keys():
    rows = {m.megatron: m for m in mappings_for(spec_from_hf_config(tiny_config("qwen3")))}
    ln = rows["decoder.layers.*.self_attention.linear_qkv.layer_norm_weight"]
    assert ln.megatron_name(3) == "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert ln.megatron_name(3, local_spec=True) == "decoder.layers.3.input_layernorm.weight"
    assert ln.checkpoint_key == "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    assert ln.hf_names(3) == ("model.layers.3.input_layernorm.weight",)
    qkv = rows["decoder.layers.*.self_attention.linear_qkv.weight"]
    assert qkv.hf_names(0)[1] == "model.layers.0.self_attn.k_proj.weight" and qkv.tp_axis == 0
    assert rows["decoder.layers.*.mlp.linear_fc2.weight"].tp_axis == 1


def test_gated_qkv_grouped_order_by_hand():
    # 4 heads (head dim 1) in 2 groups, HF q_proj [q0 g0 q1 g1 q2 g2 q3 g3]: Megatron holds per
    # group its queries, then their gates, then k, then v (megatron-core attention_output_gate).
    q = torch.tensor([0, 10, 1, 11, 2, 12, 3, 13], dtype=torch.float64).unsqueeze(1)
    k, v = _rows(100, 2, 1, width=1), _rows(200, 2, 1, width=1)
    merged = merge_qkv(q, k, v, num_query_groups=2, kv_channels=1, gated=True)
    assert merged[:, 0].tolist() == [0, 1, 10, 11, 100, 200, 2, 3, 12, 13, 101, 201]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(merged, 4, 2, 1, gated=True), (q, k, v)))


@pytest.mark.parametrize("nh, ng, d", [(4, 2, 32), (8, 2, 16), (4, 4, 8)])
def test_gated_qkv_pieces_are_views_in_hf_order(nh, ng, d):
    q, k, v = torch.randn(2 * nh * d, 5), torch.randn(ng * d, 5), torch.randn(ng * d, 5)
    merged = merge_qkv(q, k, v, ng, d, gated=True)
    pieces = split_qkv_pieces(merged, nh, ng, d, gated=True)
    assert all(p.data_ptr() >= merged.data_ptr() for p in pieces[0])  # views, no copies
    assert all(torch.equal(torch.cat(p), t) for p, t in zip(pieces, (q, k, v)))


def test_tp_pieces_by_hand_and_back():
    # pieces of 4, 2, 2 rows at TP=2: shard 0 = [a0 a1 b0 c0], shard 1 = [a2 a3 b1 c1]
    a, b, c = (_rows(tag, n, 1, width=1) for tag, n in ((0, 4), (100, 2), (200, 2)))
    fused = merge_tp_pieces([a, b, c], 2)
    assert fused[:, 0].tolist() == [0, 1, 100, 200, 2, 3, 101, 201]
    assert torch.equal(merge_tp_pieces([a, b, c], 1), torch.cat([a, b, c]))
    assert all(torch.equal(x, y) for x, y in zip(split_tp_pieces(fused, [4, 2, 2], 2), (a, b, c)))
    with pytest.raises(ValueError, match="does not divide the rows of pieces"):
        merge_tp_pieces([a, _rows(0, 3, 1)], 2)
