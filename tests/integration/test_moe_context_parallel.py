"""Mixture of experts with context parallelism: the tiny Qwen3-MoE (4 experts, top-2, aux-loss: the multi-process and end-to-end tests (the single-process ones and the helpers are in ``tests/mcore/test_moe_context_parallel.py``)."""

import dataclasses
import math
import re
import zlib
import pytest
import torch
from tests.helpers.dist_utils import run_distributed
from tests.batch.test_context_parallel import COUNTS, VALUES, _rollouts
from tests.mcore.test_router_replay import E, K, L, random_routes
from tests.mcore.test_moe_context_parallel import LAYOUTS, LOGPROB_ATOL, _assert_same_weights, _check_metrics, _logprob_rows, _merged, results  # noqa: F401


@pytest.mark.slow
def test_routing_counts_at_cp2_equal_cp1(results):
    ref = results[0][LAYOUTS[0]]["counts"]
    assert 0 < ref[0].min() and (ref[0] < ref[2]).all(), "some routes must agree and some differ"
    for layout in LAYOUTS[1:]:
        assert torch.equal(results[0][layout]["counts"], ref), layout


@pytest.mark.slow
def test_aux_loss_gradient_at_cp2_equals_cp1(results):
    ref = LAYOUTS[0]
    start, want = _merged(results, ref, "start"), _merged(results, ref, "after_aux")
    router = "decoder.layers.0.mlp.router.weight"
    assert (want[router] - start[router]).abs().max() > 1e-3, "the aux loss must move the router"
    assert [results[0][layout]["local_experts"] for layout in LAYOUTS] == [E, E, E // 2]  # EP=2 splits them
    for layout in LAYOUTS[1:]:
        # the CP ranks keep different shares of each row: a per-rank weight would differ here
        assert any(a != b for a, b in zip(results[0][layout]["kept_here"], results[1][layout]["kept_here"]))
        _assert_same_weights(results, layout, ref, "after_aux")
        for res in results:
            _check_metrics(res[layout]["aux_only"], res[ref]["aux_only"], layout, "aux_only")


@pytest.mark.slow
def test_replay_at_cp2_equals_cp1(results):
    ref = LAYOUTS[0]
    want_rows = _logprob_rows(results, ref, "replayed_logprob")
    plain_rows = _logprob_rows(results, ref, "plain_logprob")
    # replay changes the log-probs (the random routes are far from the model's own)
    assert max((a - b).abs().max() for a, b in zip(want_rows, plain_rows)) > 0.1
    for layout in LAYOUTS:
        assert all(res[layout]["replayed_maps"] for res in results), layout
    for layout in LAYOUTS[1:]:
        for got, want in zip(_logprob_rows(results, layout, "replayed_logprob"), want_rows):
            torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0)
        _assert_same_weights(results, layout, ref, "after_replay")
        for res in results:
            _check_metrics(res[layout]["replay"], res[ref]["replay"], layout, "replay")


@pytest.mark.slow
def test_stapo_update_at_cp2_equals_cp1(results):
    ref = LAYOUTS[0]
    first = results[0][ref]["stapo"]
    assert first["silenced_count"] > 0 and first["moe/aux_loss"] > 0
    assert max(res[(2, 1)]["tokens"] for res in results) * 2 == max(res[ref]["tokens"] for res in results)
    for layout in LAYOUTS[1:]:
        for res in results:
            _check_metrics(res[layout]["stapo"], res[ref]["stapo"], layout, "stapo")
        _assert_same_weights(results, layout, ref, "after_stapo")
