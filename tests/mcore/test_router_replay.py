"""Router replay (R3) for the tiny Qwen3-MoE (4 experts, top-2): `stapo_megatron.mcore.router_replay`.

- tier a: the routes' layout in padded and packed micro-batches (`NO_ROUTE` at each sequence's
  last token and padding), the sequence-parallel slice and the filler;
- one process, real megatron-core: with replay every position's Megatron ``routing_map`` is the
  given routes (random valid routes, far from the model's own choice), the replayed log-probs
  equal transformers' with its routers forced to the same routes, full recomputation replays
  the same routes in backward (loss and gradients equal the unrecomputed pass), nothing stays
  in megatron-core's FIFO after a pass, and a model built without replay, a dense model and a
  micro-batch without routes are refused;
- slow, 2 gloo ranks: the same routing-map and HF-parity checks at TP=2 with sequence
  parallelism (each TP rank routes half of the sequence) and at EP=2 (routing before dispatch).
"""

import dataclasses
import math

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from stapo_megatron.batch.microbatch import NO_ROUTE, MicroBatch, pack_sequences
from stapo_megatron.batch.minibatches import MicroBatchLayout, pack_planned, plan_budget
from stapo_megatron.batch.packing import pack_thd
from stapo_megatron.batch.records import records_from_lists
from stapo_megatron.mcore.router_replay import fill_missing, local_routes
from tests.helpers.route_recorder import RouteRecorder
from tests.helpers.router_replay_workers import (E, GRAD_RTOL, K, L, LOGPROB_ATOL, VARIANT, _hf_logprobs,
                                                _loss_and_grads, _microbatch, build_replay_model, expected_maps,
                                                forced_hf_routes, random_routes, replayed_pass)


# ---------------------------------------------------------------------------- tier a: layout


def test_padded_rows_carry_routes_then_no_route():
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10, 11]]
    routes = [random_routes(4, L, seed=1), random_routes(5, L, seed=2)]  # P + R - 1 positions each
    mb = pack_sequences(records_from_lists(prompts, responses, [1.0, -1.0], [[0.0] * 2, [0.0] * 4], routes=routes),
                        pad_id=0, seq_length=8)
    assert mb.routes.shape == (2, 8, L, K) and mb.routes.dtype == torch.int16
    assert torch.equal(mb.routes[0, :4], routes[0].to(torch.int16))
    assert (mb.routes[0, 4:] == NO_ROUTE).all()  # the last response token, then padding
    assert torch.equal(mb.routes[1, :5], routes[1].to(torch.int16)) and (mb.routes[1, 5:] == NO_ROUTE).all()
    with pytest.raises(ValueError, match="sequence 1: routed experts"):
        pack_sequences(records_from_lists(prompts, responses, [0.0, 0.0], [[0.0] * 2, [0.0] * 4],
                                          routes=[routes[0], routes[0]]), 0, 8)
    with pytest.raises(ValueError, match="sequence 0 has no routed experts"):
        pack_sequences(records_from_lists(prompts, responses, [0.0, 0.0], [[0.0] * 2, [0.0] * 4],
                                          routes=[None, routes[1]]), 0, 8)


def test_packed_row_carries_each_sequences_routes():
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10, 11]]
    routes = [random_routes(4, L, seed=1), random_routes(5, L, seed=2)]
    mb = pack_thd(records_from_lists(prompts, responses, [1.0, -1.0], [[0.0] * 2, [0.0] * 4], routes=routes),
                  pad_id=0, align=8)
    # row: sequence 0 (5 tokens), sequence 1 (6 tokens), alignment tail (5)
    assert mb.cu_seqlens.tolist() == [0, 5, 11, 16] and mb.routes.shape == (1, 16, L, K)
    row = mb.routes[0]
    assert torch.equal(row[0:4], routes[0].to(torch.int16)) and (row[4] == NO_ROUTE).all()
    assert torch.equal(row[5:10], routes[1].to(torch.int16)) and (row[10:] == NO_ROUTE).all()
    # a record's routes go to the micro-batch that holds it (here DP rank 1's of a 2-rank budget plan)
    records = records_from_lists(prompts * 2, responses * 2, [0.0] * 4, [[0.0] * 2, [0.0] * 4] * 2, routes=routes * 2)
    layout = MicroBatchLayout("budget", max_tokens=16)
    plan = plan_budget([r.length for r in records], layout, num_ranks=2, seed=0)
    mbs = pack_planned(records.__getitem__, plan[1], layout, seed=0)
    assert mbs
    for mb in mbs:
        for start, end in zip(mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist()):
            n = end - start
            if n in (5, 6):  # a real sequence (the tail is shorter here)
                assert torch.equal(mb.routes[0, start:end - 1], routes[n - 5].to(torch.int16))


def test_sequence_parallel_slice_is_sequence_major():
    routes_BSLK = torch.arange(2 * 4 * L * K).view(2, 4, L, K)  # B = 2 rows, S = 4 positions
    whole = local_routes(routes_BSLK)
    assert whole.shape == (8, L, K) and torch.equal(whole[1], routes_BSLK[1, 0])  # token s * B + b
    rank1 = local_routes(routes_BSLK, tp_rank=1, tp_size=2, sequence_parallel=True)
    # TP rank 1 routes positions 2 and 3 of both rows: (s=2,b=0), (s=2,b=1), (s=3,b=0), (s=3,b=1)
    assert torch.equal(rank1, torch.stack([routes_BSLK[0, 2], routes_BSLK[1, 2], routes_BSLK[0, 3], routes_BSLK[1, 3]]))
    assert torch.equal(local_routes(routes_BSLK, 1, 2, sequence_parallel=False), whole)  # no SP: every token
    with pytest.raises(ValueError, match="do not split"):
        local_routes(routes_BSLK[:, :3], 0, 2, sequence_parallel=True)


def test_filler_is_k_distinct_valid_experts_spread_over_positions():
    routes = torch.full((6, L, K), NO_ROUTE, dtype=torch.int16)
    routes[0] = torch.tensor([3, 1])
    filled = fill_missing(routes, E)
    assert filled.dtype == torch.long and torch.equal(filled[0], torch.tensor([[3, 1]] * L))
    for t in range(1, 6):
        assert sorted(filled[t, 0].tolist()) == sorted({(t * K + j) % E for j in range(K)})
    assert {tuple(filled[t, 0].tolist()) for t in range(1, 6)} == {(2, 3), (0, 1)}  # not all on expert 0


def test_replay_config_is_checked():
    from stapo_megatron.config import TrainerConfig
    from stapo_megatron.mcore.config import ModelConfig
    from stapo_megatron.rollout.config import RolloutSampling
    from stapo_megatron.trainer.routing import check_replay_engine

    with pytest.raises(ValueError, match="vllm_model_runner_v2=True"):
        RolloutSampling(routing_replay=True, engine="vllm")
    RolloutSampling(routing_replay=True, engine="vllm", vllm_model_runner_v2=True)  # a GPU run may
    # context parallelism splits the routes with the tokens (tests/integration/test_moe_context_parallel.py)
    TrainerConfig(packing="fixed", model=ModelConfig(context_parallel_size=2),
                  rollout=RolloutSampling(routing_replay=True, engine="hf"))
    # the machine: vLLM returns routes only from Model Runner V2 on a GPU; the HF engine always
    with pytest.raises(ValueError, match="without a GPU"):
        check_replay_engine("vllm", True, on_gpu=False)
    with pytest.raises(ValueError, match="vllm_model_runner_v2=False"):
        check_replay_engine("vllm", False, on_gpu=True)
    check_replay_engine("vllm", True, on_gpu=True)
    check_replay_engine("hf", False, on_gpu=False)


# ------------------------------------------------------------- one process, real megatron-core


@pytest.fixture(scope="module")
def synced(parallel, tmp_path_factory):
    """A replay-enabled Megatron MoE with random O(1)-logit weights and an fp32 HF engine synced to them."""
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.hf_engine import HFEngine
    from stapo_megatron.rollout.weight_sync import sync_weights
    from tests.helpers.moe_sync_workers import randomize_experts

    hf_dir = str(tmp_path_factory.mktemp("moe") / "hf")
    save_tiny_hf_model(hf_dir, VARIANT, dtype=torch.float32, seed=0)
    model = build_replay_model()
    randomize_experts(model, seed=5)
    model.eval()
    engine = HFEngine(hf_dir, RolloutConfig(dtype="float32"))
    sync_weights(model, tiny_config(VARIANT), parallel, engine)
    return model, engine


def test_replay_routes_every_token_and_matches_forced_transformers(parallel, synced):
    model, engine = synced
    tokens_BS = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    routes_BSLK = random_routes(2, 16, L, seed=3)
    routes_BSLK[1, 12:] = NO_ROUTE  # a shorter sequence: the filler routes its tail
    natural, natural_maps = replayed_pass(model, parallel, tokens_BS, routes_BSLK, replay=False)
    replayed, maps = replayed_pass(model, parallel, tokens_BS, routes_BSLK)
    want = expected_maps(routes_BSLK)
    for layer in range(L):
        assert torch.equal(maps[layer], want[:, layer]), layer
    # the random routes are not the model's own: replay changed most (token, layer) sets
    differ = sum((natural_maps[layer] != want[:, layer]).any(-1).float().mean() for layer in range(L)) / L
    assert differ > 0.5
    hf_routes = fill_missing(local_routes(routes_BSLK), E).view(16, 2, L, K).transpose(0, 1)
    with forced_hf_routes(engine.model, hf_routes):
        forced = _hf_logprobs(engine, tokens_BS)
    assert (replayed - forced).abs().max().item() <= LOGPROB_ATOL
    assert (natural - _hf_logprobs(engine, tokens_BS)).abs().max().item() <= LOGPROB_ATOL  # unforced: natural
    assert (replayed - natural).abs().max().item() > 0.1  # the check has teeth
    # nothing left behind in megatron-core's RouterReplay: a later pass routes on its own
    from stapo_megatron.mcore.router_replay import replay_routers
    for _, replay in replay_routers(model):
        assert replay.replay_backward_list == [] and replay.target_topk_idx is None
        assert replay.router_replay_action is None


def test_full_recompute_replays_the_same_routes_in_backward(parallel):
    from stapo_megatron.mcore.router_replay import replay_routers
    from tests.helpers.moe_sync_workers import randomize_experts

    plain = build_replay_model()
    randomize_experts(plain, seed=7)
    recompute = build_replay_model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    recompute.load_state_dict(plain.state_dict())
    gen = torch.Generator().manual_seed(4)
    mbs = [_microbatch(torch.randint(0, 300, (2, 12), generator=gen), random_routes(2, 12, L, seed=10 + i))
           for i in range(3)]
    calls = {}
    for model in (plain, recompute):
        model.train()
        router = model.decoder.layers[0].mlp.router
        router.register_forward_hook(lambda *_, key=id(model): calls.__setitem__(key, calls.get(key, 0) + 1))
    held_plain, held_recompute = [], []
    with RouteRecorder(plain) as rec_plain:
        loss_plain, grads_plain = _loss_and_grads(plain, mbs, 12, held_plain)
    with RouteRecorder(recompute) as rec_recompute:
        loss_recompute, grads_recompute = _loss_and_grads(recompute, mbs, 12, held_recompute)
    # the recomputation really reran the routers: once more per micro-batch, in backward, on the
    # micro-batch's own targets (every layer, every token)
    assert calls[id(plain)] == 3 and calls[id(recompute)] == 6
    assert rec_plain.mismatches(mbs, E) == dict(forward=3 * L, recompute=0, own=0, mismatched=0)
    assert rec_recompute.mismatches(mbs, E) == dict(forward=3 * L, recompute=3 * L, own=0, mismatched=0)
    # only a recomputing model keeps a micro-batch's targets past its forward (until its backward)
    assert held_plain == [0, 0, 0] and held_recompute == [1, 1, 1]
    assert math.isclose(loss_plain, loss_recompute, rel_tol=GRAD_RTOL)
    assert set(grads_plain) == set(grads_recompute) and any(".router." in n for n in grads_plain)
    for name, g in grads_plain.items():
        torch.testing.assert_close(grads_recompute[name], g, rtol=GRAD_RTOL, atol=1e-7, msg=name)
    for model in (plain, recompute):  # the FIFO was popped (recompute) or cleared (plain) after the pass
        assert all(r.replay_backward_list == [] for _, r in replay_routers(model))


def test_replay_is_refused_without_routes_or_a_replay_model(parallel):
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.mcore.schedule import PassContext, compute_logprob_entropy

    tokens_BS = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="dense"):
        build_gpt_model(tiny_config("qwen3"), moe_enable_routing_replay=True)
    with pytest.raises(ValueError, match="fused router ignores"):
        build_gpt_model(tiny_config(VARIANT), moe_enable_routing_replay=True, moe_router_fusion=True)
    plain = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32)
    ctx = PassContext(plain, 8, 1.0, parallel, 300, replay_routes=True)
    with pytest.raises(ValueError, match="moe_enable_routing_replay"):
        compute_logprob_entropy(ctx, [_microbatch(tokens_BS, random_routes(1, 8, L))])
    ctx = dataclasses.replace(ctx, model=build_replay_model())
    with pytest.raises(ValueError, match="carries no routes"):
        compute_logprob_entropy(ctx, [_microbatch(tokens_BS)])
    with pytest.raises(ValueError, match="top-3"):
        compute_logprob_entropy(ctx, [_microbatch(tokens_BS, torch.zeros(1, 8, L, 3, dtype=torch.long))])


# ------------------------------------------------------------------------ slow: TP + SP, EP on gloo


# ------------------------------------------------------------------------ slow: the real trainer


