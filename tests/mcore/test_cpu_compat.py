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
