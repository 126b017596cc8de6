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

import contextlib
import dataclasses
import math
import re

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from stapo_megatron.batch.microbatch import NO_ROUTE, MicroBatch, pack_sequences
from stapo_megatron.batch.minibatches import MicroBatchLayout, pack_planned, plan_budget
from stapo_megatron.batch.packing import pack_thd
from stapo_megatron.batch.records import records_from_lists
from stapo_megatron.mcore.router_replay import fill_missing, local_routes
from tests.helpers.dist_utils import run_distributed

VARIANT = "qwen3-moe"
E, K, L = 4, 2, 4
"""The tiny Qwen3-MoE: experts, experts per token, MoE layers."""

LOGPROB_ATOL = 1e-4
"""Per token, fp32 on both sides: the same routes and weights, only kernels and reduction orders
differ (~1e-6, `tests/rollout/test_moe_weight_sync.py`); routing one token of one layer to a
different expert moves log-probs by O(0.1)."""

GRAD_RTOL = 1e-5
"""Recomputation reruns the same fp32 ops on the same inputs: equal up to reduction-order ulps
(a recompute that routed by itself instead of replaying changes gradients by O(1))."""


def random_routes(*shape, seed=0):
    """[*shape, K] distinct valid experts per position and layer, uniformly drawn."""
    return torch.rand(*shape, E, generator=torch.Generator().manual_seed(seed)).argsort(-1)[..., :K]


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
    # context parallelism splits the routes with the tokens (tests/mcore/test_moe_context_parallel.py)
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


@contextlib.contextmanager
def forced_hf_routes(hf_model, routes_BSLK):
    """transformers' Qwen3-MoE routers choose ``routes_BSLK`` [B, S, L, K] instead of their own
    top-k; the gate weights are still their softmax at those experts, renormalised (HF's
    ``norm_topk_prob``): what Megatron's replay computes."""
    from stapo_megatron.rollout.hf_engine import _ROUTER

    gates = [(int(m.group(1)), mod) for name, mod in hf_model.named_modules() if (m := _ROUTER.search(name))]
    assert len(gates) == routes_BSLK.shape[2]

    def forced(gate, idx_NK):
        def forward(hidden):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            top = torch.softmax(logits.float(), -1).gather(1, idx_NK)
            if gate.norm_topk_prob:
                top = top / top.sum(-1, keepdim=True)
            return logits, top.to(logits.dtype), idx_NK
        return forward

    for layer, gate in gates:  # HF flattens [B, S] batch-major
        gate.forward = forced(gate, routes_BSLK[:, :, layer].reshape(-1, routes_BSLK.shape[-1]).long())
    try:
        yield
    finally:
        for _, gate in gates:
            del gate.forward


def _microbatch(tokens_BS, routes_BSLK=None):
    B, S = tokens_BS.shape
    return MicroBatch(tokens=tokens_BS, position_ids=torch.arange(S).expand(B, S).contiguous(),
                      labels=torch.cat([tokens_BS[:, 1:], torch.zeros(B, 1, dtype=torch.long)], 1),
                      response_mask=torch.ones(B, S, dtype=torch.bool).index_fill_(1, torch.tensor([S - 1]), False),
                      advantages=torch.ones(B, S), routes=routes_BSLK)


def replayed_pass(model, groups, tokens_BS, routes_BSLK, replay=True):
    """(log-probs [B, S - 1], routing maps {layer: [N, E]}) of a no-grad pass."""
    from stapo_megatron.mcore.schedule import PassContext, compute_logprob_entropy
    from stapo_megatron.trainer.routing import RouterCapture

    ctx = PassContext(model, tokens_BS.shape[1], 1.0, groups, model.qwen_spec.vocab_size, replay_routes=replay)
    with RouterCapture(model) as capture:
        out = compute_logprob_entropy(ctx, [_microbatch(tokens_BS, routes_BSLK)])
    logprob = out[0][0][:, :-1] if out else None
    return logprob, {layer: maps[0] for layer, maps in capture.maps.items()}


def expected_maps(routes_BSLK, tp_rank=0, tp_size=1, sequence_parallel=False):
    B, S = routes_BSLK.shape[:2]
    # the filler follows each position's index s B + b in the whole micro-batch, not in the TP slice
    index_N = local_routes((torch.arange(S)[None] * B + torch.arange(B)[:, None])[..., None, None],
                           tp_rank, tp_size, sequence_parallel).reshape(-1)
    filled_NLK = fill_missing(local_routes(routes_BSLK, tp_rank, tp_size, sequence_parallel), E, index_N)
    return torch.zeros(*filled_NLK.shape[:2], E, dtype=torch.bool).scatter_(-1, filled_NLK, True)


def build_replay_model(**overrides):
    from stapo_megatron.bridge import build_gpt_model

    return build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32, moe_enable_routing_replay=True,
                           calculate_per_token_loss=True, **overrides)


@pytest.fixture(scope="module")
def synced(parallel, tmp_path_factory):
    """A replay-enabled Megatron MoE with random O(1)-logit weights and an fp32 HF engine synced to them."""
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.hf_engine import HFEngine
    from stapo_megatron.rollout.weight_sync import sync_weights
    from tests.rollout.test_moe_weight_sync import randomize_experts

    hf_dir = str(tmp_path_factory.mktemp("moe") / "hf")
    save_tiny_hf_model(hf_dir, VARIANT, dtype=torch.float32, seed=0)
    model = build_replay_model()
    randomize_experts(model, seed=5)
    model.eval()
    engine = HFEngine(hf_dir, RolloutConfig(dtype="float32"))
    sync_weights(model, tiny_config(VARIANT), parallel, engine)
    return model, engine


def _hf_logprobs(engine, tokens_BS):
    with torch.no_grad():
        logits_BSV = engine.model(tokens_BS.to(engine.device)).logits.float().cpu()
    return torch.log_softmax(logits_BSV[:, :-1], -1).gather(-1, tokens_BS[:, 1:, None])[..., 0]


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


def _loss_and_grads(model, microbatches, seq, held=None):
    """Summed loss and parameter gradients of a replayed pass; ``held`` gets, per micro-batch,
    how many targets the first router's FIFO holds when its loss runs (after its forward)."""
    from stapo_megatron.mcore.router_replay import replay_routers
    from stapo_megatron.mcore.schedule import run_microbatches

    replay = replay_routers(model)[0][1]

    def loss_func(batch, logits):
        if held is not None:
            held.append(len(replay.replay_backward_list))
        logp = torch.log_softmax(logits.float(), -1).gather(-1, batch.labels[..., None])[..., 0]
        loss = -(logp * batch.response_mask).sum()
        return loss, batch.response_mask.sum().int(), {"loss": loss.detach()}

    model.zero_grad()
    out = run_microbatches(model, microbatches, seq, lambda b: (lambda logits: loss_func(b, logits)),
                           replay_routes=True)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return sum(float(o["loss"]) for o in out), grads


def test_full_recompute_replays_the_same_routes_in_backward(parallel):
    from stapo_megatron.mcore.router_replay import replay_routers
    from tests.rollout.test_moe_weight_sync import randomize_experts

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
    loss_plain, grads_plain = _loss_and_grads(plain, mbs, 12, held_plain)
    loss_recompute, grads_recompute = _loss_and_grads(recompute, mbs, 12, held_recompute)
    # the recomputation really reran the routers: once more per micro-batch, in backward
    assert calls[id(plain)] == 3 and calls[id(recompute)] == 6
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


def _layout_worker(hf_dir, tokens_BS, routes_BSLK, layout):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.hf_engine import HFEngine
    from stapo_megatron.rollout.weight_sync import sync_weights
    from stapo_megatron.mcore.parallel import init_parallel
    from tests.rollout.test_moe_weight_sync import randomize_experts
    from tests.rollout.test_vllm_engine import randomize

    tp2 = layout == "tp2-sp"
    groups = init_parallel(2, 1) if tp2 else init_parallel(1, 1, expert_model_parallel_size=2)
    model = build_replay_model(**(dict(sequence_parallel=True) if tp2 else {}))
    (randomize(model, seed=9) if tp2 else randomize_experts(model, seed=5))
    model.eval()
    engine = HFEngine(hf_dir, RolloutConfig(dtype="float32"))
    sync_weights(model, tiny_config(VARIANT), groups, engine)
    # EP: the ranks are data-parallel, each with its own sequences (rank r: row r)
    mine = slice(None) if tp2 else slice(dist.get_rank(), dist.get_rank() + 1)
    tokens, routes = tokens_BS[mine], routes_BSLK[mine]
    replayed, maps = replayed_pass(model, groups, tokens, routes)
    want = expected_maps(routes, ps.get_tensor_model_parallel_rank(), 2 if tp2 else 1, tp2)
    hf_routes = fill_missing(local_routes(routes), E).view(tokens.shape[1], tokens.shape[0], L, K).transpose(0, 1)
    with forced_hf_routes(engine.model, hf_routes):
        forced = _hf_logprobs(engine, tokens)
    return dict(maps_equal=all(torch.equal(maps[layer], want[:, layer]) for layer in range(L)),
                num_routed=maps[0].shape[0], diff=(replayed - forced).abs().max().item())


def _pp_recompute_worker(tokens_MS, routes_MSLK):
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.mcore.router_replay import replay_routers
    from tests.rollout.test_vllm_engine import randomize

    init_parallel(1, 2)
    plain = build_replay_model()
    randomize(plain, seed=3)
    recompute = build_replay_model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    recompute.load_state_dict(plain.state_dict())
    mbs = [_microbatch(tokens_MS[i:i + 1], routes_MSLK[i:i + 1]) for i in range(tokens_MS.shape[0])]
    out = {}
    for name, model in (("plain", plain), ("recompute", recompute)):
        model.train()
        out[name] = _loss_and_grads(model, mbs, tokens_MS.shape[1])
        out[name + "_fifo_empty"] = all(r.replay_backward_list == [] for _, r in replay_routers(model))
    return out


# ------------------------------------------------------------------------ slow: the real trainer


def _trainer_worker(run_dir, model_dir, packing, context_parallel_size=1):
    import stapo_megatron.mcore.schedule as schedule
    from stapo_megatron.recipes.tiny import tiny_moe_demo
    from stapo_megatron.trainer.loop import train

    replayed, cp_sizes = [], set()
    set_targets = schedule.set_replay_targets

    def counting(model, batch):  # every replayed micro-batch's real (routed) positions
        replayed.append(int((batch.routes[..., 0, 0] != NO_ROUTE).sum()))
        cp_sizes.add(batch.cp_size)
        set_targets(model, batch)

    schedule.set_replay_targets = counting
    cfg, warmstart = tiny_moe_demo(run_dir=run_dir)
    cfg = dataclasses.replace(
        cfg, steps=2, prompts_per_step=4, minibatch_prompts=4, micro_batch_size=2, packing=packing,
        eval=dataclasses.replace(cfg.eval, every=0),
        model=dataclasses.replace(cfg.model, hf_dir=model_dir, context_parallel_size=context_parallel_size),
        data=dataclasses.replace(cfg.data, num_train=16, num_eval=4),
        rollout=dataclasses.replace(cfg.rollout, routing_replay=True, group_size=4, max_response_len=24))
    rows = train(cfg, dataclasses.replace(warmstart, steps=2, prompts_per_step=4))
    return dict(rows=rows, replayed=replayed, passes=2 + (cfg.loss.tau_h_source == "exact"), cp_sizes=cp_sizes)


def _missing_routes_worker():
    from stapo_megatron.config import TrainerConfig
    from stapo_megatron.rollout.config import RolloutSampling
    from stapo_megatron.rollout.base import Sample
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.trainer.routing import RoutingMonitor

    import torch.distributed as dist

    init_parallel(1, 1)
    cfg = TrainerConfig(rollout=RolloutSampling(routing_replay=True, engine="hf", routing_every=0))
    monitor = RoutingMonitor(cfg.rollout, tiny_config(VARIANT), model=None)  # step_routes needs no model
    routed = random_routes(4, L).long()
    good = Sample(token_ids=[1, 2], logprobs=[0.0, 0.0], text="", finish_reason="stop", routed_experts=routed)
    out = {"enabled": monitor.enabled, "routes": len(monitor.step_routes(0, [[good, good]]))}
    # rank 1's engine lost the routes of one sample: both ranks stop, neither hangs
    bad = dataclasses.replace(good, routed_experts=None) if dist.get_rank() == 1 else good
    try:
        monitor.step_routes(1, [[good, bad]])
    except ValueError as error:
        out["error"] = str(error)
    return out


