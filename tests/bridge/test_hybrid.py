"""Tier a/b: the Megatron model of a tiny Qwen3.5, dense and MoE (delta-net and gated full-attention
layers; routed experts and a gated shared expert) on the CPU: a converted checkpoint holds exactly the
keys the model's sharded state dict has, loads, and gives transformers' logits at TP = 1 (this
process) and TP = 2, PP = 2, and for the MoE EP = 2 (gloo ranks, `verify`).

The delta rule runs in `mcore.delta_rule` on the CPU (installed by `mcore.cpu_compat`), transformers'
in its own torch path; both chunk the recurrence in fp32, so the logits differ by fp32 rounding only,
within `HYBRID_LOGIT_TOL`."""

import json
import os

import pytest
import torch

from stapo_megatron.bridge import build_gpt_model, load_checkpoint
from stapo_megatron.bridge.mapping import CARRIED_PREFIX
from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from stapo_megatron.conversion.cli import main
from stapo_megatron.conversion.dcp_io import CheckpointReader
from stapo_megatron.conversion.hf_to_mcore import extra_state_objects
from stapo_megatron.mcore.mcore_versions import delta_net_has_context_parallel
from stapo_megatron.conversion.verify import (HYBRID_LOGIT_TOL, _megatron_forward, compare, fixed_prompts, hf_logits,
                                              verify)
from tests.helpers.dist_utils import one_rank_parallel


@pytest.fixture(scope="module", params=["qwen3.5", "qwen3.5-moe"])
def converted(request, tmp_path_factory):
    """A tiny fp32 Qwen3.5, dense or MoE (3 delta-net layers, then full attention; MTP tensors),
    and its conversion."""
    root = tmp_path_factory.mktemp(request.param)
    hf, ckpt = str(root / "hf"), str(root / "ckpt")
    save_tiny_hf_model(hf, request.param, dtype=torch.float32)
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt]) == 0
    return hf, ckpt


def _checkpoint_keys(model) -> tuple[set, set]:
    """The tensor keys and the object (``_extra_state``) keys the model's sharded state dict writes
    (megatron-core's factories applied: the delta net's in_proj and conv1d one key per piece)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    values = list(nested_values(sharded))
    return ({v.key for v in values if isinstance(v, ShardedTensor)},
            {v.unique_key for v in values if isinstance(v, ShardedObject)})


def test_converted_keys_are_the_models_and_logits_equal_transformers(converted):
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.attention import SelfAttention

    hf, ckpt = converted
    with open(os.path.join(hf, "config.json")) as f:
        cfg = json.load(f)
    tokens_BS = fixed_prompts(cfg["vocab_size"], num_prompts=2, seq_len=24)
    ref_BSV = hf_logits(hf, tokens_BS)
    with one_rank_parallel():
        model = build_gpt_model(cfg, parallel_output=False)
        mixers = [type(layer.self_attention) for layer in model.decoder.layers]
        assert [issubclass(m, GatedDeltaNet) for m in mixers] == [True] * 3 + [False] and mixers[3] is SelfAttention
        stored = {k for k in CheckpointReader(ckpt).tensors() if not k.startswith(CARRIED_PREFIX)}
        tensor_keys, object_keys = _checkpoint_keys(model)
        assert tensor_keys == stored
        assert object_keys == {o.key for o in extra_state_objects(model.qwen_spec)}
        assert any(k.startswith(CARRIED_PREFIX + "mtp.") for k in CheckpointReader(ckpt).tensors())
        load_checkpoint(model, ckpt)
        model.eval()
        with torch.no_grad():
            got_BSV = _megatron_forward(model, tokens_BS)[..., :cfg["vocab_size"]]
    row = compare(ref_BSV, got_BSV, 1, 1)
    assert row.ok(HYBRID_LOGIT_TOL), row
    assert row.logit_scale > 1.0  # O(1) logits: the comparison is not of near-zero numbers


@pytest.mark.slow
def test_tp2_and_pp2_logits_equal_transformers(converted):
    hf, ckpt = converted
    rows = verify(hf, ckpt, [(2, 1), (1, 2)], num_prompts=2, seq_len=24)
    assert [(r.tensor_model_parallel_size, r.pipeline_model_parallel_size) for r in rows] == [(2, 1), (1, 2)]
    assert all(r.ok(HYBRID_LOGIT_TOL) for r in rows), rows
    with open(os.path.join(hf, "config.json")) as f:
        if "num_experts" in json.load(f):  # the MoE: its experts over 2 ranks
            row, = verify(hf, ckpt, [(1, 1)], num_prompts=2, seq_len=24, expert_model_parallel_size=2)
            assert row.ok(HYBRID_LOGIT_TOL), row


def test_transformer_engine_spec_is_refused_for_delta_net_layers():
    with one_rank_parallel():
        with pytest.raises(ValueError, match="Qwen3_5ForCausalLM .delta-net layers. is built on the local spec only"):
            build_gpt_model(tiny_config("qwen3.5"), use_te=True)


@pytest.mark.skipif(delta_net_has_context_parallel(), reason="megatron-core 0.19 builds Qwen3.5 with context "
                    "parallelism (tests/integration/test_delta_net_context_parallel.py)")
def test_context_parallelism_is_refused_at_build_before_megatron_core_0_19():
    """The bridge refuses CP for the delta-net layers before megatron-core's TransformerConfig
    does (0.16's assert names neither the field nor the release)."""
    from megatron.core import __version__

    with one_rank_parallel(), pytest.raises(ValueError) as refused:
        build_gpt_model(tiny_config("qwen3.5"), core_attention="sdpa", context_parallel_size=2)
    assert str(refused.value).startswith(f"model.context_parallel_size 2 is not supported for Qwen3_5ForCausalLM on "
                                         f"megatron-core {__version__}")


def test_weight_stream_of_the_loaded_model_is_the_hf_checkpoint(converted):
    """`rollout.weight_sync.iter_hf_weights` (what the rollout engine is synced with) gives back every
    HF tensor of the text model bit for bit: the delta net's fused in_proj and conv1d split again,
    the gated q_proj re-interleaved, only the rows of each layer's type."""
    from safetensors.torch import load_file

    from stapo_megatron.rollout.weight_sync import iter_hf_weights

    hf, ckpt = converted
    with open(os.path.join(hf, "config.json")) as f:
        cfg = json.load(f)
    expected = load_file(os.path.join(hf, "model.safetensors"))
    with one_rank_parallel() as groups:
        model = build_gpt_model(cfg)
        load_checkpoint(model, ckpt)
        streamed = dict(iter_hf_weights(model, cfg, groups))
    assert sorted(streamed) == sorted(expected)
    assert all(torch.equal(streamed[n], expected[n]) for n in expected)


def test_packed_sequences_equal_padded():
    """Two sequences packed into one THD row (``cu_seqlens``) give each the logits it has alone in a
    padded batch: the delta net's convolution and recurrent state restart at the boundary (a
    state leaking from the first sequence would change every logit of the second). From
    megatron-core 0.18 the row goes through its GatedDeltaNet in one call, the kernel seeing
    ``cu_seqlens``; before, the layer here calls it once per sequence."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from stapo_megatron.mcore.mcore_versions import delta_net_takes_packed

    cfg = tiny_config("qwen3.5")
    lengths = (13, 9)
    tokens = fixed_prompts(cfg["vocab_size"], num_prompts=2, seq_len=max(lengths))
    seen = []  # cu_seqlens of each kernel call (0.18 and later bind the kernel to the layer)
    with one_rank_parallel():
        torch.manual_seed(0)
        model = build_gpt_model(cfg, parallel_output=False, core_attention="sdpa")
        model.eval()
        for mixer in (layer.self_attention for layer in model.decoder.layers):
            if delta_net_takes_packed() and hasattr(mixer, "gated_delta_rule"):
                mixer.gated_delta_rule = _recording(mixer.gated_delta_rule, seen)
        with torch.no_grad():
            alone = [model(tokens[i:i + 1, :n], torch.arange(n).unsqueeze(0), attention_mask=None)[0]
                     for i, n in enumerate(lengths)]
            packed_ids = torch.cat([tokens[i, :n] for i, n in enumerate(lengths)]).unsqueeze(0)
            positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
            cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                                     max_seqlen_kv=max(lengths))
            packed = model(packed_ids, positions, attention_mask=None, packed_seq_params=params)[0]
            leaky = model(packed_ids, positions, attention_mask=None)[0]  # one sequence: state flows on
    # logits [t, V] of batch row 0; the same per-sequence ops on the same inputs: equal up to fp32
    # rounding of differently shaped matmuls
    torch.testing.assert_close(packed, torch.cat(alone), rtol=0, atol=1e-5)
    # the comparison has power: without the boundary the second sequence's logits move by far more
    assert (leaky[lengths[0]:] - alone[1]).abs().max() > 1e-2
    if delta_net_takes_packed():  # the 3 delta-net layers of each forward: 2 sequences alone, packed, leaky
        assert [None if cu is None else cu.tolist() for cu in seen] == [None] * 6 + [[0, 13, 22]] * 3 + [None] * 3
    else:
        assert seen == []


def _recording(rule, seen):
    """``rule`` that also appends the ``cu_seqlens`` it is called with to ``seen``."""
    def call(*args, cu_seqlens=None, **kwargs):
        seen.append(cu_seqlens)
        return rule(*args, cu_seqlens=cu_seqlens, **kwargs)

    return call
