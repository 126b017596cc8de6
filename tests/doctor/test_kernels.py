"""Tier a: the doctor's delta-net row on the CPU (the torch kernel the CPU shim installs for
megatron-core's GatedDeltaNet) and its token-by-token reference by hand. The op, attention and
TE rows run on a GPU (tests/gpu/test_gpu.py)."""

import math

import pytest
import torch

from stapo_megatron.doctor import kernels


def test_the_recurrence_by_hand():
    """One head of key/value size 1: S_1 = beta_1 k_1 v_1; S_2 = a_2 S_1 + beta_2 k_2 (v_2 - a_2 S_1 k_2);
    o_t = S_t q_t (scale 1/sqrt(1))."""
    q, k, v = (torch.tensor([[[[x]], [[y]]]]) for x, y in ((1.0, 2.0), (0.5, 1.0), (3.0, -1.0)))
    g, beta = torch.tensor([[[0.0], [math.log(0.5)]]]), torch.tensor([[[0.5], [0.25]]])
    s1 = 0.5 * 0.5 * 3.0
    s2 = 0.5 * s1 + 0.25 * 1.0 * (-1.0 - 0.5 * s1 * 1.0)
    out = kernels.recurrent_delta_rule(q, k, v, g, beta)
    assert out.flatten().tolist() == pytest.approx([s1 * 1.0, s2 * 2.0], abs=1e-7)  # fp32 rounding


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: the torch kernel")
def test_the_cpu_row_checks_the_torch_kernel_the_model_runs():
    row = kernels.check_delta_net()
    assert row.status == "pass" and row.values["kernel"] == "stapo_megatron.mcore.delta_rule.chunk_gated_delta_rule"
    assert row.values["error"] <= kernels.DELTA_RULE_TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (fla's Triton kernels)")
def test_the_cuda_row_checks_flas_kernel():
    row = kernels.check_delta_net()
    assert row.status == "pass", row.detail
    assert row.values["kernel"].startswith("fla.") and row.values["error"] <= kernels.DELTA_RULE_TOL
