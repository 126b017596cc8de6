"""Context parallelism of Qwen3.5's delta-net layers on gloo (tier b, megatron-core 0.19 and later,
`mcore_versions.delta_net_has_context_parallel`; ``make test-mcore019`` runs it against 0.19.2):
the tiny Qwen3.5 (2 key and 4 value delta-net heads, so CP = 2 splits them) on one packed row of
three sequences at CP = 2 against CP = 1 with the same weights (`helpers.delta_net_cp_workers`),
and two STAPO updates at CP = 2 against CP = 1 (the dense model's training test on the tiny
Qwen3.5, `helpers.context_parallel_workers`).

Tolerances (fp32, CPU). CP = 2 computes the same per-token terms: the delta-net layers exchange
the row all-to-all and run each whole sequence on half of the heads (the same recurrence per
head as CP = 1), the full-attention layer gathers the keys (`bridge.attention.SDPAttention`), so
only the grouping of fp32 reductions differs: logits to `LOGIT_ATOL` at O(1) logits (the CP
attention's tolerance, `context_parallel_workers.ATTN_ATOL`; measured 1.8e-7), every gradient
(summed over the CP ranks) to `GRAD_RTOL` of its parameter's largest gradient entry (measured
7.2e-7 absolute on the embedding's largest entry 3.45, 2e-7 of it)."""

import pytest
import torch

from stapo_megatron.mcore.mcore_versions import delta_net_has_context_parallel
from tests.helpers.delta_net_cp_workers import LENGTHS, delta_net_cp_worker
from tests.helpers.dist_utils import run_distributed

LOGIT_ATOL = 1e-5
"""CP = 2 vs CP = 1 logits: see the module docstring."""
GRAD_RTOL = 1e-5
"""CP = 2 (summed over CP) vs CP = 1 gradients, relative to the parameter's largest |gradient|."""

pytestmark = pytest.mark.skipif(not delta_net_has_context_parallel(),
                                reason="megatron-core before 0.19 has no delta-net context parallelism "
                                       "(refused: tests/bridge/test_hybrid_config.py)")


@pytest.mark.slow
def test_cp2_logits_and_gradients_equal_cp1():
    """Each rank's CP = 2 logits equal the CP = 1 logits at the positions it holds (its two
    chunks of each of the 3 sequences); every parameter's gradient, summed over the CP ranks,
    equals CP = 1's (the delta-net conv weights are sliced per CP rank in the forward, so each
    rank's gradient covers its slice); the checkpoint saves the same whole tensors at both sizes."""
    results = run_distributed(2, delta_net_cp_worker)
    for res in results:
        ref, got = res[1], res[2]
        assert got["idx"].numel() == sum(LENGTHS) // 2 and ref["logits"].abs().max() > 0.1
        torch.testing.assert_close(got["logits"], ref["logits"][got["idx"]], atol=LOGIT_ATOL, rtol=0)
        assert sorted(got["grads"]) == sorted(ref["grads"])
        conv = [n for n in ref["grads"] if n.endswith("self_attention.conv1d.weight")]
        assert len(conv) == 3  # the 3 delta-net layers
        for name, want in ref["grads"].items():
            scale = float(want.abs().max())
            assert scale > 0, name  # every parameter takes part
            torch.testing.assert_close(got["grads"][name], want, atol=GRAD_RTOL * scale, rtol=0, msg=name)
        assert got["checkpoint"] == ref["checkpoint"]
        assert any(".conv1d.weight" in key for key in ref["checkpoint"])


@pytest.mark.slow
def test_cp2_trains_qwen35_as_cp1():
    """The dense model's CP test (`test_context_parallel_training.test_cp2_trains_as_cp1`) on the
    tiny Qwen3.5: CP=1 (DP=2) then CP=2 (DP=1) in the same processes, two STAPO updates on the
    same mini-batch, the CP=2 budget per rank (24 tokens) below the longest sequence; loss,
    counts, S2T mask, metrics and weights as CP=1 (`context_parallel_workers._check_same`'s
    tolerances)."""
    from tests.helpers.context_parallel_workers import _check_same, _train_worker

    results = run_distributed(2, _train_worker, 1, (1, 2), (48, 24), "stapo_300", "qwen3.5")
    assert max(res[2]["tokens"] for res in results) <= 24
    _check_same(results, 2)
