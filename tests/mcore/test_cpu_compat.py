"""Tier a: the CPU shims of `mcore.cpu_compat` act only inside the upstream calls that need them."""

import pytest
import torch

from stapo_megatron.mcore import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shims apply only without CUDA")


def test_tensor_names_are_torch_own_outside_the_scoped_calls():
    cpu_compat.apply()
    x = torch.ones(2)
    assert torch.Tensor.type is cpu_compat._ORIG_TENSOR_TYPE and torch.Tensor.cuda is cpu_compat._ORIG_TENSOR_CUDA
    assert x.type() == "torch.FloatTensor"
    with cpu_compat.cuda_tensor_names():
        with cpu_compat.cuda_tensor_names():  # nested scoped calls (DistributedOptimizer.__init__)
            assert x.type() == "torch.cuda.FloatTensor"
        assert x.type() == "torch.cuda.FloatTensor" and x.cuda() is x
        assert x.type(torch.float64).dtype == torch.float64  # a conversion is still a conversion
    assert x.type() == "torch.FloatTensor"
    assert torch.Tensor.type is cpu_compat._ORIG_TENSOR_TYPE and torch.Tensor.cuda is cpu_compat._ORIG_TENSOR_CUDA


def test_upstream_clip_grads_runs_on_cpu_and_leaves_tensor_type_alone():
    """megatron-core's clip_grads.py asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``:
    the wrapped function passes it for CPU fp32 grads and clips them by max_norm / total_norm."""
    cpu_compat.apply()
    from megatron.core.optimizer import clip_grads, optimizer

    assert optimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([3.0, 4.0])
    clip_grads.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=5.0)
    coeff = 1.0 / (5.0 + 1.0e-6)  # upstream's clip_coeff
    assert param.grad.tolist() == pytest.approx([3.0 * coeff, 4.0 * coeff], rel=1e-6)
    assert param.grad.type() == "torch.FloatTensor"


def _delta_rule_inputs(tokens: int):
    """q, k, v [1, tokens, 2, 8] (q, k unit rows, as the layer l2-normalises them), log decays
    g < 0 and write strengths beta in (0, 1) [1, tokens, 2]."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, tokens, 2, 8, generator=gen) for _ in range(3))
    q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    g = -torch.nn.functional.softplus(torch.randn(1, tokens, 2, generator=gen))
    return q, k, v, g, torch.sigmoid(torch.randn(1, tokens, 2, generator=gen))


def test_delta_net_kernels_are_set_in_every_module_the_layer_reads():
    """megatron-core 0.19.2's gdn.py binds ``chunk_gated_delta_rule`` by name at import, next to
    common.py's: each holds the torch kernel `stapo_megatron.mcore.delta_rule` and the torch L2 norm."""
    cpu_compat.apply()
    from stapo_megatron.mcore import delta_rule
    from stapo_megatron.mcore.mcore_versions import delta_net_modules, delta_net_takes_packed

    for module in delta_net_modules():
        assert module.chunk_gated_delta_rule is delta_rule.chunk_gated_delta_rule
        assert module.l2norm is cpu_compat._torch_l2norm and module.HAVE_FLA
        assert (getattr(module, "causal_conv1d", None) is cpu_compat._torch_causal_conv1d) == delta_net_takes_packed()


def test_varlen_delta_rule_runs_each_sequence_alone():
    """With fla's ``cu_seqlens`` each packed sequence gets exactly what it gets alone (the same
    kernel on the same slice: bit for bit); the state would otherwise flow into the next one."""
    cpu_compat.apply()
    from stapo_megatron.mcore.mcore_versions import delta_net_modules

    rule = delta_net_modules()[0].chunk_gated_delta_rule
    x = _delta_rule_inputs(70 + 5)  # one sequence past a 64-token chunk, then a short one
    cu = torch.tensor([0, 70, 75], dtype=torch.int32)
    packed, state = rule(*x, initial_state=None, output_final_state=False, cu_seqlens=cu)
    alone = [rule(*(t[:, a:b] for t in x), initial_state=None, output_final_state=False)[0] for a, b in ((0, 70), (70, 75))]
    assert state is None and torch.equal(packed, torch.cat(alone, dim=1))
    flowing, _ = rule(*x, initial_state=None, output_final_state=False)
    assert torch.equal(flowing[:, :70], alone[0]) and (flowing[:, 70:] - alone[1]).abs().max() > 1e-3


def test_causal_conv1d_is_the_layers_conv_and_restarts_per_sequence():
    """The torch stand-in for fla's causal_conv1d ([B, T, D] in, weight [D, W]) equals the depthwise
    nn.Conv1d with W - 1 padding cut to T, then SiLU (megatron-core's own torch path), within fp32
    rounding of the two convolutions' sums; with ``cu_seqlens`` the second sequence starts from zeros."""
    conv = torch.nn.Conv1d(6, 6, kernel_size=4, groups=6, padding=3, bias=True)
    x = torch.randn(1, 11, 6, generator=torch.Generator().manual_seed(1))
    want = torch.nn.functional.silu(conv(x.transpose(1, 2))[..., :11]).transpose(1, 2)
    got, state = cpu_compat._torch_causal_conv1d(x, conv.weight.squeeze(1), conv.bias, activation="silu")
    assert state is None
    tol = 1e-6  # 4-term sums of O(1) values in fp32, summed in another order by each convolution
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    cu = torch.tensor([0, 7, 11], dtype=torch.int32)
    packed, _ = cpu_compat._torch_causal_conv1d(x, conv.weight.squeeze(1), conv.bias, activation="silu", cu_seqlens=cu)
    second, _ = cpu_compat._torch_causal_conv1d(x[:, 7:], conv.weight.squeeze(1), conv.bias, activation="silu")
    torch.testing.assert_close(packed, torch.cat([got[:, :7], second], dim=1), rtol=0, atol=tol)
    assert (got[:, 7:10] - second[:, :3]).abs().max() > 1e-2  # without the boundary the first sequence leaks in
