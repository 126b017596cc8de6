"""Tier b: `iter_hf_weights` at TP=2 x PP=2 equals the converter's export, tensor for tensor.

Four gloo ranks build a DDP-wrapped GPTModel with random weights, save it with Megatron's own
sharded save, and stream it with `iter_hf_weights`. The reference is `stapo-convert
mcore-to-hf` of that checkpoint: a path through dist_checkpointing's resharding instead of
in-memory TP all-gathers and PP broadcasts. The match must be bit-exact (both only move and
slice fp32 values). Variants: Qwen3 (q/k norm, untied) and Qwen2.5 (qkv bias, tied, GQA 4:1).
"""

import torch

from stapo_megatron.bridge import hf_shapes, spec_from_hf_config
from stapo_megatron.bridge.tiny import tiny_config


def test_job_order_and_gathered_layouts():
    """Tier a: the stream order and the conversion of gathered TP=2 tensors, no processes."""
    from stapo_megatron.bridge import mappings_for, merge_gate_up, merge_qkv
    from stapo_megatron.rollout.weight_sync import _jobs, _to_hf

    spec = spec_from_hf_config(tiny_config("qwen3"))
    jobs = list(_jobs(spec, [[0, 1], [2, 3]]))
    names = [n for m, layer, _ in jobs for n in m.hf_names(layer)]
    assert names == list(dict.fromkeys(names)) and set(names) == set(hf_shapes(spec))
    assert [stage for _, layer, stage in jobs if layer is None] == [0, 1, 1]  # embed; norm, lm_head
    assert {layer: stage for _, layer, stage in jobs if layer is not None} == {0: 0, 1: 0, 2: 1, 3: 1}
    rows = {m.transform: m for m in mappings_for(spec)}
    gate, up = torch.randn(96, 64), torch.randn(96, 64)
    # all-gathering two TP shards [gate_r; up_r] along rows gives merge_gate_up(..., 2)
    got = _to_hf(merge_gate_up(gate, up, 2), rows["gate_up"], spec, tp_size=2)
    assert torch.equal(got[0], gate) and torch.equal(got[1], up)
    q, k, v = torch.randn(128, 64), torch.randn(64, 64), torch.randn(64, 64)
    got = _to_hf(merge_qkv(q, k, v, 2, 32), rows["qkv"], spec, tp_size=2)
    assert all(torch.equal(a, b) for a, b in zip(got, (q, k, v)))
    padded = torch.randn(384, 64)
    assert torch.equal(_to_hf(padded, rows["vocab"], spec, tp_size=2)[0], padded[:300])


def test_hf_stream_is_the_order_iter_hf_weights_streams(parallel):
    """Tier a, one process: the names and shapes the bucket planner is given for a spec
    (`hf_stream`) are those `iter_hf_weights` yields, in its order, dense and MoE."""
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.rollout.weight_sync import hf_stream, iter_hf_weights

    for variant in ("qwen3", "qwen3-moe"):
        model = build_gpt_model(tiny_config(variant), params_dtype=torch.float32)
        streamed = [(name, tuple(t.shape)) for name, t in iter_hf_weights(model, tiny_config(variant), parallel)]
        assert streamed == hf_stream(spec_from_hf_config(tiny_config(variant))), variant
        assert len(streamed) == {"qwen3": 47, "qwen3-moe": 87}[variant]


def test_gathered_qwen35_layouts_at_tp2():
    """Tier a: a Qwen3.5's gathered TP=2 tensors back to HF: the delta net's in_proj (per shard
    [q k v z b a]) and conv1d (per shard [q k v]), and the gated linear_qkv; rows only for the
    layers of their type."""
    from stapo_megatron.bridge import mappings_for, merge_qkv
    from stapo_megatron.bridge.hybrid_config import delta_net_dims
    from stapo_megatron.bridge.transforms import merge_tp_pieces
    from stapo_megatron.rollout.weight_sync import _jobs, _to_hf

    spec = spec_from_hf_config(tiny_config("qwen3.5"))
    names = [n for m, layer, _ in _jobs(spec, [[0, 1, 2, 3]]) for n in m.hf_names(layer)]
    assert names == list(dict.fromkeys(names)) and set(names) == set(hf_shapes(spec))
    rows = {m.transform: m for m in mappings_for(spec)}
    d = delta_net_dims(spec)
    qkv, z, b, a = (torch.randn(r, 64) for r in (d["conv"], d["v"], d["heads"], d["heads"]))
    q, k, v = torch.split(qkv, [d["qk"], d["qk"], d["v"]])
    got = _to_hf(merge_tp_pieces([q, k, v, z, b, a], 2), rows["delta_in_proj"], spec, tp_size=2)
    assert all(torch.equal(x, y) for x, y in zip(got, (qkv, z, b, a))) and len(got) == 4
    conv = torch.randn(d["conv"], 1, 4)
    got = _to_hf(merge_tp_pieces(list(torch.split(conv, [d["qk"], d["qk"], d["v"]])), 2), rows["delta_conv"], spec, 2)
    assert len(got) == 1 and torch.equal(got[0], conv)
    q, k, v = torch.randn(2 * 4 * 32, 64), torch.randn(64, 64), torch.randn(64, 64)
    got = _to_hf(merge_qkv(q, k, v, 2, 32, gated=True), rows["qkv"], spec, tp_size=2)
    assert all(torch.equal(x, y) for x, y in zip(got, (q, k, v)))
