"""Tier a: the SDPA core attention equals Megatron's local DotProductAttention on the same weights.

Tolerances (fp32, CPU): logits ATOL 2e-5 at O(1)-O(5) logits, parameter gradients 2e-5
relative to each gradient's largest entry -- both kernels compute the same softmax(QK^T/sqrt(d))V
in fp32 and differ only in summation order (measured ~4e-6 and ~2e-6).
"""


import pytest
import torch

from stapo_megatron.bridge.tiny import tiny_config
from tests.helpers.engine_parity import randomize

LOGIT_ATOL = 2e-5
GRAD_RTOL = 2e-5


def _pair(variant):
    from stapo_megatron.bridge import build_gpt_model

    local = build_gpt_model(tiny_config(variant), core_attention="local")
    sdpa = build_gpt_model(tiny_config(variant), core_attention="sdpa")
    randomize(local, seed=3)
    sdpa.load_state_dict(local.state_dict())
    return local, sdpa


@pytest.mark.parametrize("variant", ["qwen3", "qwen2.5"])  # GQA 2:1 with q/k norm; GQA 4:1 with qkv bias, tied
def test_sdpa_equals_local_attention(parallel, variant):
    from stapo_megatron.bridge.attention import SDPAttention

    local, sdpa = _pair(variant)
    assert isinstance(sdpa.decoder.layers[0].self_attention.core_attention, SDPAttention)
    assert sdpa.state_dict().keys() == local.state_dict().keys()  # no parameters or buffers of its own
    assert sdpa.sharded_state_dict().keys() == local.sharded_state_dict().keys()
    vocab = tiny_config(variant)["vocab_size"]
    tokens = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(48).expand(2, 48)
    out_local = local(tokens, pos, attention_mask=None)
    out_sdpa = sdpa(tokens, pos, attention_mask=None)
    assert out_local.abs().max() > 1.0
    torch.testing.assert_close(out_sdpa, out_local, atol=LOGIT_ATOL, rtol=0)
    upstream = torch.randn(out_local.shape, generator=torch.Generator().manual_seed(1))
    out_local.backward(upstream)
    out_sdpa.backward(upstream)
    for (name, p), q in zip(local.named_parameters(), sdpa.parameters()):
        assert (q.grad - p.grad).abs().max() <= GRAD_RTOL * p.grad.abs().max(), name


def test_explicit_mask_equals_causal(parallel):
    """Megatron's boolean mask convention (True = masked out) gives the causal result."""
    _, sdpa = _pair("qwen3")
    tokens = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(16)[None]
    masked_out = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        torch.testing.assert_close(sdpa(tokens, pos, attention_mask=masked_out),
                                   sdpa(tokens, pos, attention_mask=None), atol=1e-6, rtol=0)


def test_layer_spec_choices_and_cpu_fusions(parallel):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from stapo_megatron.bridge import spec_from_hf_config
    from stapo_megatron.bridge.kernels import fused_kernel_settings
    from stapo_megatron.bridge.model import default_core_attention, layer_spec

    spec = spec_from_hf_config(tiny_config("qwen3"))
    assert default_core_attention() == ("sdpa" if torch.cuda.is_available() else "local")
    core = lambda name: layer_spec(spec, use_te=False, core_attention=name).submodules.self_attention.submodules.core_attention  # noqa: E731
    assert core("local") is DotProductAttention
    assert core("sdpa").__name__ == "SDPAttention"
    with pytest.raises(ValueError, match="core_attention must be one of"):
        core("flash")
    if not torch.cuda.is_available():
        assert not any(fused_kernel_settings(use_te=False).values())
