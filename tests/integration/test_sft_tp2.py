"""The warm-start's label-smoothing term: cross-entropy to the uniform distribution, TP-sharded: the
multi-process and end-to-end tests (the single-process ones are in ``tests/mcore/test_sft.py``)."""

import pytest
import torch
from tests.helpers.dist_utils import run_distributed
from tests.helpers.uniform_ce import V, _reference, _tp_worker  # noqa: F401


@pytest.mark.slow
def test_uniform_cross_entropy_tp2_equals_unsharded():
    ref, ref_grad = _reference()
    for rank, (out, grad) in enumerate(run_distributed(2, _tp_worker)):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(grad, ref_grad[:, rank * V // 2 : (rank + 1) * V // 2], atol=1e-6, rtol=0)
