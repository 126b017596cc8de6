"""The Triton kernels of the log-prob/entropy op equal its torch path (tiers a and b, and c on a GPU): the multi-process and end-to-end tests (the single-process ones and the helpers are in ``tests/ops/test_triton_path.py``)."""

from __future__ import annotations
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
import pytest
import torch
from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy
from tests.helpers.dist_utils import run_distributed
from tests.ops.test_triton_path import DEVICES, GRAD_ATOL, GRAD_RTOL, PATH_GRAD_ATOL, VALUE_TOL, _reference, _tp_worker  # noqa: F401


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,entropy_grad", [(torch.float32, True), (torch.bfloat16, False)], ids=str)
def test_tp2_kernels_match_torch_path_and_full_vocabulary(device, dtype, entropy_grad):
    (out0, logits, target, upstream), (out1, _, _, _) = run_distributed(2, _tp_worker, device, dtype, entropy_grad)
    for impl in ("triton", "torch"):
        assert out0[impl][3] == out1[impl][3] == 2, f"{impl}: exactly 2 collectives (MAX, packed SUM)"
        assert out0[impl][5] == out1[impl][5] == 2, f"{impl}: sum p^2 needs no collective of its own"
    x, ref_lp, ref_h = _reference(logits, target, 1.0, 290)
    collision = torch.softmax(logits[:, :290].double(), -1).square().sum(-1)
    for impl in ("triton", "torch"):
        for out in (out0, out1):
            torch.testing.assert_close(out[impl][4].double(), collision, atol=VALUE_TOL, rtol=0)
    ((ref_lp * upstream[0].double()).sum() + (ref_h * upstream[1].double()).sum() * entropy_grad).backward()
    for impl in ("triton", "torch"):
        for out in (out0, out1):  # every rank holds the full-vocabulary values
            torch.testing.assert_close(out[impl][0].double(), ref_lp, atol=VALUE_TOL, rtol=0)
            torch.testing.assert_close(out[impl][1].double(), ref_h, atol=VALUE_TOL, rtol=0)
    grad = torch.cat([out0["triton"][2], out1["triton"][2]], dim=-1)
    assert not grad[:, 290:].any()
    torch.testing.assert_close(grad.double()[:, :290], x.grad[:, :290], atol=GRAD_ATOL, rtol=GRAD_RTOL[dtype])
    grad_t = torch.cat([out0["torch"][2], out1["torch"][2]], dim=-1)
    torch.testing.assert_close(grad.float(), grad_t.float(), atol=PATH_GRAD_ATOL[dtype], rtol=0)
