"""Mixture of experts with context parallelism: the tiny Qwen3-MoE (4 experts, top-2, aux-loss
coefficient c > 0) at CP=2 and at CP=2 x EP=2 against CP=1 (DP=2) on the same packed rows, on gloo.

The rows are the same in every layout ("fixed" packing, every sequence padded to a multiple of
4 as CP=2 needs, rows aligned to 16): megatron-core's load-balancing loss is a statistic of a
whole micro-batch, padding included (`stapo_megatron.mcore.moe`), so CP=1 must route the same
rows. CP=1 puts micro-batches 0-1 on DP rank 0 and 2-3 on rank 1; CP=2 (DP=1) gives each rank
its chunks of all four. In the same processes, per layout:

1. routing disagreement against random rollout routes (`trainer.routing.routing_counts`,
   world-summed): exact integer counts equal CP=1's;
2. an update whose STAPO loss is zero (all advantages 0: every policy-gradient term vanishes,
   the normaliser still counts the response tokens) so that only the aux loss moves the weights:
   weights after one SGD step equal CP=1's, and differ from the start (the aux gradient acts);
3. router replay of random routes: every router's map at CP=2 is the rollout's routes at this
   rank's positions, and the replayed pi_old log-probs (whole rows gathered over CP) and the
   weights after a replayed STAPO update equal CP=1's;
4. a STAPO update without replay: loss, counts, metrics (``moe/*`` included) and weights.

Tolerances (fp32, CPU), those of `tests/batch/test_context_parallel.py` for the same reason (the same
per-token terms summed over other ranks and in another order, measured ~1e-7): counts exact
(integers; expert loads are integer counts); losses and metrics 2e-5 relative; weights 1e-6
absolute after lr = 0.5 SGD steps; log-probs 1e-5 absolute.
"""

import dataclasses
import math
import re
import zlib

import pytest
import torch

from tests.helpers.dist_utils import run_distributed
from tests.batch.test_context_parallel import COUNTS, VALUES, _rollouts
from tests.helpers.router_replay_workers import E, L, random_routes

VOCAB = 300
COEFF = 0.05
"""The aux-loss coefficient c (the tiny config's 0.001 would move weights by ~1e-5 only)."""
METRIC_RTOL, WEIGHT_ATOL, LOGPROB_ATOL = 2e-5, 1e-6, 1e-5
LAYOUTS = ((1, 1), (2, 1), (2, 2))
"""(context_parallel_size, expert_model_parallel_size) on 2 ranks; the first is the reference."""


def seeded_weights(model):
    """O(1)-logit weights that depend only on a parameter's global name (expert j of EP rank e
    named by its global index), so every layout starts from the same model."""
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank()
    local = E // ps.get_expert_model_parallel_world_size()
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(global_name(name, ep_rank, local).encode()))
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))


def global_name(name, ep_rank, local):
    found = re.search(r"local_experts\.(\d+)\.", name)
    return name if found is None else name.replace(found.group(0), f"expert{ep_rank * local + int(found.group(1))}.")


def _weights(model):
    from megatron.core import parallel_state as ps

    ep_rank, local = ps.get_expert_model_parallel_rank(), E // ps.get_expert_model_parallel_world_size()
    return {global_name(n.removeprefix("module."), ep_rank, local): p.detach().clone()
            for n, p in model.named_parameters()}


def _rows(groups, mbs):
    """Each micro-batch's old log-probs over its whole packed row (gathered over CP)."""
    from stapo_megatron.batch.context_parallel import gather_row

    return [gather_row(mb.old_logprob, mb.cu_seqlens, groups.cp) for mb in mbs]


def _worker(layouts):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.bridge.tiny import tiny_config
    from stapo_megatron.method.config import LossConfig
    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.batch.minibatches import MicroBatchLayout, build_minibatches
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.batch.records import records_from_lists
    from stapo_megatron.mcore.router_replay import replay_indices
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
    from stapo_megatron.trainer.routing import RouterCapture, routing_counts

    prompts, responses, adv, lps = _rollouts(vocab=VOCAB)
    routes = [random_routes(len(p) + len(r) - 1, L, seed=i) for i, (p, r) in enumerate(zip(prompts, responses))]
    loss_config = LossConfig(method="stapo", tau_p=0.0015)
    out = {}
    for cp, ep in layouts:
        groups = init_parallel(1, 1, context_parallel_size=cp, expert_model_parallel_size=ep)
        model = build_gpt_model(tiny_config("qwen3-moe"), params_dtype=torch.float32, calculate_per_token_loss=True,
                                moe_aux_loss_coeff=COEFF, core_attention="sdpa", moe_enable_routing_replay=True)
        seeded_weights(model)
        model, optimizer = wrap_model_and_optimizer(
            model, OptimConfig(optimizer="sgd", lr=0.5, weight_decay=0.0, clip_grad=0.0))
        start = _weights(model)
        # "fixed": each DP rank trains its own contiguous share of the records
        records = records_from_lists(prompts, responses, adv, lps, routes=routes)
        share = len(records) // dist.get_world_size(groups.dp)
        rank = dist.get_rank(groups.dp)
        (mbs,), _ = build_minibatches(
            records[rank * share:(rank + 1) * share],
            MicroBatchLayout("fixed", micro_batch_size=4, seq_multiple=16, seq_align=4, cp_size=cp,
                        cp_rank=dist.get_rank(groups.cp)),
            microbatch_seed=lambda first, dp_rank: 3, dp_group=groups.dp)
        ctx = PassContext(model, max(mb.tokens.shape[1] for mb in mbs), groups=groups, vocab_size=VOCAB)
        res = dict(num_mbs=len(mbs), tokens=mbs[0].tokens.shape[1],
                   local_experts=sum(".0.mlp.experts.local_experts." in n and n.endswith("fc1.weight")
                                     for n, _ in model.named_parameters()))
        # 1. routing disagreement, world-summed
        counts = routing_counts(model, mbs, E)
        dist.all_reduce(counts)
        res["counts"] = counts
        # 2. the aux loss alone
        zero = [dataclasses.replace(mb, advantages=torch.zeros_like(mb.advantages)) for mb in mbs]
        old_policy_pass(ctx, [zero])
        res["aux_only"] = policy_update(ctx, optimizer, zero, loss_config).metrics
        res["kept_here"] = [int(mb.response_mask.sum()) for mb in zero]
        res["after_aux"], res["start"] = _weights(model), start
        # 3. router replay
        replay = dataclasses.replace(ctx, replay_routes=True)
        with RouterCapture(model) as capture:
            old_policy_pass(replay, [mbs])
        res["replayed_maps"] = all(
            torch.equal(maps[j], torch.zeros(maps[j].shape, dtype=torch.bool).scatter_(
                -1, replay_indices(mb, E, cp_rank=dist.get_rank(groups.cp))[:, layer], True))
            for layer, maps in capture.maps.items() for j, mb in enumerate(mbs))
        res["replayed_logprob"] = _rows(groups, mbs)
        res["replay"] = policy_update(replay, optimizer, mbs, loss_config).metrics
        res["after_replay"] = _weights(model)
        # 4. STAPO without replay
        old_policy_pass(ctx, [mbs])
        res["plain_logprob"] = _rows(groups, mbs)
        res["stapo"] = policy_update(ctx, optimizer, mbs, loss_config).metrics
        res["after_stapo"] = _weights(model)
        out[(cp, ep)] = res
        parallel_state.destroy_model_parallel()
    return out


def _merged(results, layout, key):
    """A layout's weights over both ranks (EP=2: each rank holds half of the experts)."""
    merged = {}
    for res in results:
        merged.update(res[layout][key])
    return merged


def _logprob_rows(results, layout, key):
    """Every micro-batch's whole-row log-probs in mini-batch order (CP=1: rank 0's, then rank 1's)."""
    if layout[0] == 1:
        return [row for res in results for row in res[layout][key]]
    return results[0][layout][key]


def _assert_same_weights(results, layout, ref, key):
    """``layout``'s weights (merged over the ranks) at ``key`` equal the reference layout's."""
    got, want = _merged(results, layout, key), _merged(results, ref, key)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, atol=WEIGHT_ATOL, rtol=0, msg=f"{layout} {name}")


def _check_metrics(got, want, layout, update):
    assert got.keys() == want.keys()
    for key, value in want.items():
        if key in COUNTS or key.endswith("_load"):  # integer counts
            assert got[key] == value, (layout, update, key)
        elif key in VALUES or key.startswith("moe/"):
            assert got[key] == pytest.approx(value, rel=METRIC_RTOL, abs=1e-7, nan_ok=True), (layout, update, key)


@pytest.fixture(scope="module")
def results():
    return run_distributed(2, _worker, LAYOUTS)


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
