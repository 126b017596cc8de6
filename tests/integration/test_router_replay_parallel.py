"""Router replay (R3) for the tiny Qwen3-MoE (4 experts, top-2): `stapo_megatron.mcore.router_replay`:
the multi-process and end-to-end tests (the single-process ones are in
``tests/mcore/test_router_replay.py``)."""

import math
import pytest
import torch
from stapo_megatron.bridge.tiny import save_tiny_hf_model
from stapo_megatron.batch.microbatch import NO_ROUTE, MicroBatch, pack_sequences
from stapo_megatron.batch.packing import pack_thd
from stapo_megatron.batch.records import records_from_lists
from tests.helpers.dist_utils import run_distributed
from tests.helpers.router_replay_workers import GRAD_RTOL, L, LOGPROB_ATOL, VARIANT, _layout_worker, _missing_routes_worker, _pp_recompute_worker, _trainer_worker, random_routes  # noqa: F401


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2-sp", "ep2"])
def test_replay_under_sequence_and_expert_parallelism(tmp_path, layout):
    """TP=2 + SP: each TP rank's routers see (and replay) its half of the sequence; EP=2: each
    rank routes its own tokens before the all-to-all. Replayed log-probs equal transformers'
    forced to the same routes with the synced weights."""
    hf_dir = str(tmp_path / "hf")
    save_tiny_hf_model(hf_dir, VARIANT, dtype=torch.float32, seed=0)
    tokens_BS = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    routes_BSLK = random_routes(2, 16, L, seed=5)
    routes_BSLK[0, 13:] = NO_ROUTE
    for r in run_distributed(2, _layout_worker, hf_dir, tokens_BS, routes_BSLK, layout):
        assert r["maps_equal"]
        assert r["num_routed"] == (16 // 2 * 2 if layout == "tp2-sp" else 16 * 1)  # S / TP x B, or S x its 1 row
        assert r["diff"] <= LOGPROB_ATOL


@pytest.mark.slow
def test_pipeline_recompute_pops_each_microbatchs_own_routes(tmp_path):
    """PP=2 with 1F1B over 4 micro-batches: the first stage runs a later micro-batch's forward
    before an earlier one's backward, so its recomputation must take the earlier routes from the
    FIFO (the last target set would be the later micro-batch's). Loss and gradients on both
    stages equal the unrecomputed pass."""
    gen = torch.Generator().manual_seed(2)
    tokens_MS = torch.randint(0, 300, (4, 12), generator=gen)
    routes_MSLK = random_routes(4, 12, L, seed=8)
    for r in run_distributed(2, _pp_recompute_worker, tokens_MS, routes_MSLK):
        (loss_plain, grads_plain), (loss_recompute, grads_recompute) = r["plain"], r["recompute"]
        assert math.isclose(loss_plain, loss_recompute, rel_tol=GRAD_RTOL, abs_tol=1e-6)
        assert set(grads_plain) == set(grads_recompute) and grads_plain
        for name, g in grads_plain.items():
            torch.testing.assert_close(grads_recompute[name], g, rtol=GRAD_RTOL, atol=1e-7, msg=name)
        assert r["plain_fifo_empty"] and r["recompute_fifo_empty"]


@pytest.mark.slow
@pytest.mark.parametrize("packing,cp", [("budget", 1), ("padded", 1), ("budget", 2)])
def test_trainer_steps_with_routing_replay(tmp_path, packing, cp):
    """Two RL steps of the tiny MoE recipe (EP=2, HF engine) with ``rollout.routing_replay``:
    the pi_old pass and the update (and an "exact" tau_H pre-pass) replay every micro-batch
    (each rank's share of the 16 samples, every forwarded token), and the step still logs the
    (unreplayed) routing disagreement: 0 with fp32 on both sides. With CP=2 (DP=1, EP=2 over
    the CP ranks) each rank replays and measures its chunks of every sequence: together every
    token once, and the replayed pi_old equals the engine's log-probs."""
    from stapo_megatron.recipes.tiny import prepare_tiny_model

    model_dir = str(tmp_path / "model")
    prepare_tiny_model(model_dir, "tiny_moe")
    results = run_distributed(2, _trainer_worker, str(tmp_path / "run"), model_dir, packing, cp, timeout=900)
    train_rows = [r for r in results[0]["rows"] if r.get("kind") == "train"]
    assert [r["step"] for r in train_rows] == [1, 2]
    for r in train_rows:
        assert math.isfinite(r["loss"]) and r["skipped"] == 0
        assert r["routing_tokens"] > 0 and r["routing_disagreement_max"] == 0.0
        assert r["rollout_train_logprob_diff"] < LOGPROB_ATOL
    passes = results[0]["passes"]  # pi_old, the update, and with tau_h_source "exact" its pre-pass
    for res in results:
        assert len(res["replayed"]) % (2 * passes) == 0 and min(res["replayed"]) > 0
        assert res["cp_sizes"] == {cp}  # the micro-batches were split over CP
    # both ranks together replayed every forwarded token of the 16 samples in each pass of a step
    assert sum(sum(res["replayed"]) for res in results) == passes * sum(r["routing_tokens"] for r in train_rows)


@pytest.mark.slow
def test_missing_routes_stop_every_rank_with_replay():
    results = run_distributed(2, _missing_routes_worker)
    for rank, r in enumerate(results):
        assert r["enabled"] and r["routes"] is True  # replay alone makes the engine record routes
        assert "returned no routed experts" in r["error"] and f"rank {rank}: {rank} of 2" in r["error"]
