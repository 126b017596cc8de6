"""LoRA adapters on a real megatron-core GPTModel (TP = 1): exact at step 0, the merged weights'
function after an update, only adapters trained, the base back with the adapters off."""

import pytest
import torch

from stapo_megatron.mcore.lora_config import LoraConfig
from tests.helpers.lora_models import forward, full_adapter_weights, merged_copy, tiny_gpt, tokens

MERGE_TOL = 1e-5
"""fp32: B (A x) against (W0 + s B A) x differs only by the order of the sums (logits <= 1; measured 1.5e-6)."""


def _lora_model(**lora_fields):
    from stapo_megatron.mcore.lora import apply_lora

    model = tiny_gpt()
    adapters = apply_lora(model, LoraConfig(rank=4, alpha=8.0, **lora_fields))
    return model, adapters


def test_step_zero_equals_the_base_exactly(parallel):
    base = tiny_gpt()
    model, adapters = _lora_model()
    assert sorted(adapters) == sorted(f"decoder.layers.{i}.{m}" for i in range(2) for m in (
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"))
    with torch.no_grad():
        want, got = forward(base, tokens()), forward(model, tokens())
    assert torch.equal(got, want), "B = 0: the adapters add exact zeros"
    assert float(want.abs().max()) > 0.01
    for adapter in adapters.values():
        assert not adapter.B.any() and adapter.A.abs().max() > 0


def test_only_the_adapters_require_grad_and_get_one(parallel):
    from stapo_megatron.mcore.lora import adapter_parameters

    model, adapters = _lora_model()
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable == [n for n, _ in model.named_parameters() if n.endswith((".lora.A", ".lora.B"))]
    assert len(trainable) == 2 * len(adapters) == 16
    assert {id(p) for p in adapter_parameters(model)} == {id(p) for p in model.parameters() if p.requires_grad}
    forward(model, tokens()).square().mean().backward()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, name
    # B = 0: A gets exactly zero gradient at the first step, B a nonzero one (as LoRA starts)
    for adapter in adapters.values():
        assert not adapter.A.grad.any() and adapter.B.grad.abs().max() > 0


def test_updated_adapters_equal_the_merged_weights(parallel):
    from stapo_megatron.mcore.lora import adapters_disabled

    model, adapters = _lora_model()
    base_logits = forward(model, tokens()).detach()
    # a manual update: loss, gradient, an SGD step on A and B by hand (B first, A once B != 0)
    for _ in range(2):
        model.zero_grad()
        forward(model, tokens()).square().mean().backward()
        with torch.no_grad():
            for adapter in adapters.values():
                adapter.A -= 50.0 * adapter.A.grad
                adapter.B -= 50.0 * adapter.B.grad
    assert all(a.B.abs().max() > 0 for a in adapters.values())
    # then larger hand-set values, so that the adapters move the logits well past the tolerance
    for name, adapter in adapters.items():
        adapter.load_full_(*full_adapter_weights(name, adapter.full_shapes))
    with torch.no_grad():
        got = forward(model, tokens())
        want = forward(merged_copy(model, tiny_gpt(seed=99)), tokens())
        with adapters_disabled(model):
            off = forward(model, tokens())
    torch.testing.assert_close(got, want, atol=MERGE_TOL, rtol=0)
    assert float((got - base_logits).abs().max()) > 1000 * MERGE_TOL
    assert torch.equal(off, base_logits), "adapters off: the frozen base, bit for bit"
    assert all(a.enabled for a in adapters.values()), "restored on exit"


def test_adapters_disabled_restores_on_error_and_needs_adapters(parallel):
    from stapo_megatron.mcore.lora import adapters_disabled

    model, adapters = _lora_model()
    with pytest.raises(RuntimeError, match="inside"):
        with adapters_disabled(model):
            assert not any(a.enabled for a in adapters.values())
            raise RuntimeError("inside")
    assert all(a.enabled for a in adapters.values())
    with pytest.raises(ValueError, match="no LoRA adapters"):
        with adapters_disabled(tiny_gpt()):
            pass


def test_targets_scaling_dropout_and_layout_independent_init(parallel):
    from stapo_megatron.mcore.lora import apply_lora

    model, adapters = _lora_model(target_modules=["linear_qkv", "linear_fc2"], dropout=0.5)
    assert sorted(adapters) == ["decoder.layers.0.mlp.linear_fc2", "decoder.layers.0.self_attention.linear_qkv",
                                "decoder.layers.1.mlp.linear_fc2", "decoder.layers.1.self_attention.linear_qkv"]
    qkv = adapters["decoder.layers.0.self_attention.linear_qkv"]
    assert qkv.scaling == 2.0 and qkv.A.shape == (4, 64) and qkv.B.shape == (4 * 32 + 2 * 2 * 32, 4)
    # A: U(-1/sqrt(in), 1/sqrt(in)), keyed by seed and place: another model, the same A
    assert float(qkv.A.detach().abs().max()) <= 64 ** -0.5
    again = apply_lora(tiny_gpt(seed=5), LoraConfig(rank=4, alpha=8.0, target_modules=["linear_qkv"]))
    assert torch.equal(again["decoder.layers.0.self_attention.linear_qkv"].A, qkv.A)
    assert not torch.equal(adapters["decoder.layers.1.self_attention.linear_qkv"].A, qkv.A)
    # dropout: on in training (two forwards differ), off in eval (the same)
    for name, adapter in adapters.items():
        adapter.load_full_(*full_adapter_weights(name, adapter.full_shapes))
    with torch.no_grad():
        model.train()
        assert not torch.equal(forward(model, tokens()), forward(model, tokens()))
        model.eval()
        assert torch.equal(forward(model, tokens()), forward(model, tokens()))


def test_refusals_name_the_field(parallel):
    from stapo_megatron.mcore.lora import apply_lora

    model = tiny_gpt()
    with pytest.raises(ValueError, match=r"lora.rank 65 is larger than decoder.layers.0.self_attention.linear_proj's "
                                         r"smaller dimension 64 \(in 128, out 64\)"):
        apply_lora(model, LoraConfig(rank=65))
    assert all(p.requires_grad for p in model.parameters()), "a refusal leaves the model untouched"
    apply_lora(model, LoraConfig(rank=64, target_modules=["linear_proj"]))  # 128 x 64: r = 64 fits
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model, LoraConfig(rank=4))
    with pytest.raises(ValueError, match="full_shapes|this adapter takes"):
        adapter = model.get_submodule("decoder.layers.0.self_attention.linear_proj").lora
        adapter.load_full_(torch.zeros(64, 64), torch.zeros(64, 63))


MOE = dict(architecture="Qwen3MoeForCausalLM", num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
"""A tiny Qwen3-MoE (every layer's MLP: router and 4 experts, the local spec's SequentialMLP)."""


def test_experts_get_adapters_only_when_asked(parallel):
    from stapo_megatron.mcore.lora import adapters_disabled, apply_lora

    with pytest.warns(UserWarning, match=r"no \['linear_fc1', 'linear_fc2'\] to adapt \(the experts' are adapted "
                                         r"only with lora.experts=True\)"):
        dense_only = apply_lora(tiny_gpt(**MOE), LoraConfig(rank=4))
    assert sorted(dense_only) == [f"decoder.layers.{i}.self_attention.{m}" for i in range(2)
                                  for m in ("linear_proj", "linear_qkv")], "no dense MLP; experts not asked"
    model = tiny_gpt(**MOE)
    with torch.no_grad():
        base_logits = forward(model, tokens())
    config = LoraConfig(rank=4, alpha=8.0, experts=True, target_modules=["linear_fc1", "linear_fc2"])
    adapters = apply_lora(model, config)
    assert sorted(adapters) == [f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{m}" for i in range(2)
                                for e in range(4) for m in ("linear_fc1", "linear_fc2")]
    fc1 = adapters["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1"]
    assert fc1.glu and fc1.full_shapes == ((4, 64), (2 * 32, 4))
    assert not any(p.requires_grad for n, p in model.named_parameters() if "router" in n)
    for name, adapter in adapters.items():
        adapter.load_full_(*full_adapter_weights(name, adapter.full_shapes))
    with torch.no_grad():
        got = forward(model, tokens())
        want = forward(merged_copy(model, tiny_gpt(seed=99, **MOE)), tokens())
        with adapters_disabled(model):
            off = forward(model, tokens())
    torch.testing.assert_close(got, want, atol=MERGE_TOL, rtol=0)
    assert float((got - base_logits).abs().max()) > 1000 * MERGE_TOL
    assert torch.equal(off, base_logits)


def test_merged_parameters_are_the_merged_weights(parallel):
    from stapo_megatron.mcore.lora import MergedParameters, adapters_disabled

    model, adapters = _lora_model()
    for name, adapter in adapters.items():
        adapter.load_full_(*full_adapter_weights(name, adapter.full_shapes))
    want = dict(merged_copy(model, tiny_gpt(seed=99)).named_parameters())
    merged = MergedParameters(model)
    assert sorted(merged) == sorted(n for n, _ in model.named_parameters()), "every parameter, by its name"
    for name, tensor in want.items():
        # fp32 rounding of the float64 sum, as merged_copy's in-place fp32 add rounds it
        torch.testing.assert_close(merged[name], tensor.detach(), atol=1e-6, rtol=0)
        assert not merged[name].requires_grad
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert not torch.equal(merged[qkv], model.get_submodule(qkv[: -len(".weight")]).weight)
    with adapters_disabled(model):
        plain = MergedParameters(model)
        assert all(torch.equal(plain[n], p) for n, p in model.named_parameters()), "adapters off: the base"
