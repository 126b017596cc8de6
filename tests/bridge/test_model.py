"""Tier a: which sharded-state-dict entries `bridge.load_checkpoint` leaves unread, with the names
transformer-engine's layers give them (TE is not installed on the CPU, so its layout is written
out here from megatron-core's ``TEGroupedLinear._sharded_state_dict_grouped``), and a converted MoE
checkpoint loading into the local spec without them; and the MoE settings a model build refuses
at context parallelism > 1 (what CP would compute per chunk instead of per micro-batch)."""

import pytest
import torch

from stapo_megatron.bridge.model import extra_state_keys

TE_GROUPED_MLP_KEYS = [  # one MoE layer, 4 local experts, TEGroupedMLP (megatron-core 0.16 - 0.19)
    "decoder.layers.0.mlp.router.weight",
    *(f"decoder.layers.0.mlp.experts.linear_fc{i}.weight{g}" for i in (1, 2) for g in range(4)),
    *(f"decoder.layers.0.mlp.experts.linear_fc{i}._extra_state{'' if g == 0 else g}" for i in (1, 2) for g in range(4)),
    "decoder.layers.0.self_attention.linear_qkv._extra_state",
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
    "decoder.layers.0.self_attention.core_attention._extra_state",
]


def test_every_extra_state_of_te_grouped_linears_is_left_unread():
    got = extra_state_keys(TE_GROUPED_MLP_KEYS)
    assert got == [k for k in TE_GROUPED_MLP_KEYS if "_extra_state" in k] and len(got) == 10
    assert "decoder.layers.0.mlp.experts.linear_fc2._extra_state3" in got
    assert not any(k.endswith(("weight0", "weight3", "layer_norm_weight")) for k in got)


def test_converted_moe_checkpoint_loads_without_extra_states(tmp_path):
    """The local spec's experts (SequentialMLP) with a converted checkpoint: every weight read, the
    logits those of the HF model (fp32, same tolerance as stapo-convert verify)."""
    from stapo_megatron.bridge import build_gpt_model, load_checkpoint
    from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
    from stapo_megatron.conversion.hf_to_mcore import convert_hf_to_mcore
    from stapo_megatron.conversion.verify import FP32_LOGIT_TOL, _megatron_forward, fixed_prompts, hf_logits
    from tests.helpers.dist_utils import one_rank_parallel

    hf = str(tmp_path / "hf")
    save_tiny_hf_model(hf, "qwen3-moe", dtype=torch.float32)
    convert_hf_to_mcore(hf, str(tmp_path / "ckpt"))
    tokens = fixed_prompts(300)
    with one_rank_parallel():
        model = build_gpt_model(tiny_config("qwen3-moe"), parallel_output=False)
        assert any(k.endswith("_extra_state") for k in extra_state_keys(model.sharded_state_dict()))
        load_checkpoint(model, str(tmp_path / "ckpt"))
        model.eval()
        with torch.no_grad():
            got = _megatron_forward(model, tokens)[..., :300]
    ref = hf_logits(hf, tokens)
    assert float((got - ref).abs().max()) <= FP32_LOGIT_TOL * max(1.0, float(ref.abs().max()))


def test_model_build_refuses_what_cp_would_make_per_chunk():
    from stapo_megatron.bridge.model import _check_moe_context_parallel

    _check_moe_context_parallel(2, {"moe_aux_loss_coeff": 0.01})  # the micro-batch switch loss: exact
    with pytest.raises(ValueError, match="moe_router_load_balancing_type='seq_aux_loss' with context_parallel_size 2"):
        _check_moe_context_parallel(2, {"moe_router_load_balancing_type": "seq_aux_loss"})
    with pytest.raises(ValueError, match="moe_z_loss_coeff=0.001 with context_parallel_size 2"):
        _check_moe_context_parallel(2, {"moe_z_loss_coeff": 0.001})
    with pytest.raises(ValueError, match="moe_expert_capacity_factor=1.5 with context_parallel_size 4"):
        _check_moe_context_parallel(4, {"moe_expert_capacity_factor": 1.5})
