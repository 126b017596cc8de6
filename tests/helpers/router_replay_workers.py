"""Router replay (R3) on the tiny Qwen3-MoE, as its tests share it: random routes, transformers'
routers forced to given routes, a replayed no-grad pass and its expected routing maps, a replayed
loss-and-gradients pass, and the gloo workers (EP=2 / TP=2 layouts, PP=2 with full recompute, the
real trainer, a rank that lost its routes)."""

import contextlib
import dataclasses

import torch

from stapo_megatron.bridge.tiny import tiny_config
from stapo_megatron.batch.microbatch import NO_ROUTE, MicroBatch
from stapo_megatron.mcore.router_replay import fill_missing, local_routes

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


def _hf_logprobs(engine, tokens_BS):
    with torch.no_grad():
        logits_BSV = engine.model(tokens_BS.to(engine.device)).logits.float().cpu()
    return torch.log_softmax(logits_BSV[:, :-1], -1).gather(-1, tokens_BS[:, 1:, None])[..., 0]


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


def _layout_worker(hf_dir, tokens_BS, routes_BSLK, layout):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.hf_engine import HFEngine
    from stapo_megatron.rollout.weight_sync import sync_weights
    from stapo_megatron.mcore.parallel import init_parallel
    from tests.helpers.moe_sync_workers import randomize_experts
    from tests.helpers.engine_parity import randomize

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
    from tests.helpers.engine_parity import randomize

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
    from stapo_megatron.batch.step_rollout import StepRollout

    import torch.distributed as dist

    init_parallel(1, 1)
    cfg = TrainerConfig(rollout=RolloutSampling(routing_replay=True, engine="hf", routing_every=0))
    monitor = RoutingMonitor(cfg.rollout, tiny_config(VARIANT), model=None)  # step_routes needs no model
    routed = random_routes(4, L).long()
    good = Sample(token_ids=[1, 2], logprobs=[0.0, 0.0], text="", finish_reason="stop", routed_experts=routed)
    def rollout(step, samples):  # one prompt's group, as the schedule would record it
        return StepRollout.of_groups(step, [(0, [5, 6, 7])], lambda i: "", [samples], len(samples), version=step)

    out = {"enabled": monitor.enabled, "routes": monitor.step_routes(rollout(0, [good, good]))}
    # rank 1's engine lost the routes of one sample: both ranks stop, neither hangs
    bad = dataclasses.replace(good, routed_experts=None) if dist.get_rank() == 1 else good
    try:
        monitor.step_routes(rollout(1, [good, bad]))
    except ValueError as error:
        out["error"] = str(error)
    return out
