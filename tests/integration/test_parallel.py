"""Tier b: sharded computations equal the unsharded reference (gloo, real megatron-core)."""

import math

import pytest
import torch

from tests.helpers.dist_utils import run_distributed

pytestmark = pytest.mark.slow

V, N = 1000, 24  # vocabulary divisible by TP = 1, 2, 4
REAL_V = V - 37  # the last shard carries padded rows, as Megatron's padded output layer does


def _full_inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(N, V, generator=gen) * 3).to(dtype)
    target = torch.randint(0, REAL_V, (N,), generator=gen)
    upstream = torch.randn(N, generator=gen)
    return logits, target, upstream


def _op_worker(dtype):
    import torch.distributed as dist

    from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logits, target, upstream = _full_inputs(dtype)
    shard = logits[:, rank * V // world : (rank + 1) * V // world].clone().requires_grad_()
    calls = []
    orig = dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(k.get("op")), orig(*a, **k))[1]
    try:
        logprob, entropy = vocab_parallel_logprob_entropy(
            shard, target, tp_group=dist.group.WORLD, temperature=0.8, vocab_size=REAL_V
        )
        logprob.backward(upstream)
    finally:
        dist.all_reduce = orig
    return logprob.detach(), entropy, shard.grad, len(calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tp_shards_equal_unsharded(dtype):
    from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy

    logits, target, upstream = _full_inputs(dtype)
    x = logits.clone().requires_grad_()
    ref_lp, ref_h = vocab_parallel_logprob_entropy(x[:, :REAL_V], target, temperature=0.8)
    ref_lp.backward(upstream)
    for tp in (2, 4):
        results = run_distributed(tp, _op_worker, dtype)
        for lp, h, _, num_collectives in results:
            # only the order of fp32 sums changes across shards
            torch.testing.assert_close(lp, ref_lp.detach(), atol=2e-6, rtol=0)
            torch.testing.assert_close(h, ref_h, atol=2e-6, rtol=0)
            assert num_collectives == 2, "exactly one MAX and one packed SUM all-reduce per call"
        grad = torch.cat([g for _, _, g, _ in results], dim=-1)
        assert not grad[:, REAL_V:].any(), "padded vocabulary rows get no gradient"
        grad = grad[:, :REAL_V]
        tol = 2e-6 if dtype == torch.float32 else 1e-2  # fp32: reduction order; bf16 gradient: one ulp
        torch.testing.assert_close(grad.float(), x.grad[:, :REAL_V].float(), atol=tol, rtol=0)


def _quantile_data(rank):
    gen = torch.Generator().manual_seed(100 + rank)
    n = 50 + 17 * rank  # unequal per-rank sizes
    logprob = torch.log(torch.rand(n, generator=gen) * 0.004)
    entropy = torch.rand(n, generator=gen) * 3
    adv = torch.randn(n, generator=gen)
    mask = torch.rand(n, generator=gen) > 0.1
    return logprob, entropy, adv, mask


def _quantile_worker():
    import torch.distributed as dist

    from stapo_megatron.method import masks

    dist.init_process_group("gloo")
    logprob, entropy, adv, mask = _quantile_data(dist.get_rank())
    cand = masks.s2t_candidates(logprob, adv, mask)
    tau, count = masks.s2t_threshold(entropy, cand, 0.75, dp_group=dist.group.WORLD)
    silenced = masks.s2t_mask(logprob, entropy, adv, mask, dp_group=dist.group.WORLD)
    e20 = masks.entropy20_threshold(entropy, mask, dp_group=dist.group.WORLD)
    return tau.item(), count, silenced, e20.item()


def test_dp_quantile_equals_concatenated():
    from stapo_megatron.method import masks

    results = run_distributed(2, _quantile_worker)
    data = [_quantile_data(r) for r in range(2)]
    logprob, entropy, adv, mask = (torch.cat(t) for t in zip(*data))
    cand = masks.s2t_candidates(logprob, adv, mask)
    ref_tau = torch.quantile(entropy[cand], 0.75).item()
    ref_silenced = masks.s2t_mask(logprob, entropy, adv, mask)
    for tau, count, _, e20 in results:
        assert tau == pytest.approx(ref_tau, abs=1e-6) and count == int(cand.sum())
        assert e20 == pytest.approx(torch.quantile(entropy[mask], 0.8).item(), abs=1e-6)
    assert torch.equal(torch.cat([r[2] for r in results]), ref_silenced)
    assert ref_silenced.any()


# --- a tiny GPTModel trained with the STAPO loss: TP=2, PP=2, DP=2 against TP=PP=DP=1 --------

VOCAB, PROMPT, RESPONSE, MBS = 512, 4, 12, 2


def _train_worker(tp, pp, steps, method, init_ckpt, objective=None):
    from megatron.core import dist_checkpointing

    from stapo_megatron.method.config import LossConfig
    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
    from stapo_megatron.recipes.synthetic import build_tiny_gpt, synthetic_rollouts, tiny_gpt_config

    groups = init_parallel(tp, pp)
    dp_size = torch.distributed.get_world_size(groups.dp)
    dp_rank = torch.distributed.get_rank(groups.dp)
    model = build_tiny_gpt(tiny_gpt_config(tp, pp), VOCAB, PROMPT + RESPONSE)
    # Every layout starts from the same weights: the single-process run saves its initial model
    # as a torch_dist checkpoint and the TP/PP runs load it resharded (random init differs
    # across PP layouts: each stage starts its own RNG stream).
    if tp * pp * dp_size == 1:
        dist_checkpointing.save(model.sharded_state_dict(), init_ckpt)
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), init_ckpt))
    # SGD: Adam's 1/sqrt(v) would amplify fp32 reduction-order noise on near-zero gradients
    optim = OptimConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0)
    model, optimizer = wrap_model_and_optimizer(model, optim)
    # Clip-Cov: about 10 eligible tokens per micro-batch here (cov > 0.05), one drawn; every TP rank must draw the same
    loss_config = LossConfig(method=method, tau_p=0.0015, objective=objective, clip_cov_ratio=0.05, clip_cov_lower=0.05)
    history = []
    for step in range(steps):
        mbs, _ = synthetic_rollouts(4, 4, PROMPT, RESPONSE, VOCAB, seed=step, micro_batch_size=MBS)
        # 8 micro-batches, 2 mini-batches of 4; each DP rank takes its contiguous share
        minis = []
        for mini in (mbs[:4], mbs[4:]):
            share = len(mini) // dp_size
            minis.append(mini[dp_rank * share : (dp_rank + 1) * share])
        # pi_old pass over the whole step's batch before any update (as the trainer does), so
        # the second mini-batch is off-policy: ratios != 1 and clipping is exercised
        ctx = PassContext(model, PROMPT + RESPONSE, groups=groups)
        old_policy_pass(ctx, minis)
        for mine in minis:
            history.append(policy_update(ctx, optimizer, mine, loss_config).metrics)
    return history


@pytest.fixture(scope="module")
def init_ckpt(tmp_path_factory):
    return str(tmp_path_factory.mktemp("init_ckpt"))


@pytest.fixture(scope="module")
def reference_run(init_ckpt):
    return run_distributed(1, _train_worker, 1, 1, 3, "stapo", init_ckpt)[0]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (1, 1)])
def test_parallel_training_matches_single_process(reference_run, init_ckpt, tp, pp):
    """TP=2, PP=2 and DP=2 (world 2 with tp=pp=1) reproduce the single-process run."""
    results = run_distributed(2, _train_worker, tp, pp, 3, "stapo", init_ckpt)
    ref = reference_run
    assert sum(m["silenced_count"] for m in ref) > 0, "the test must exercise the S2T mask"
    assert any(m["clip_fraction"] > 0 for m in ref), f"and pi_theta != pi_old: {ref}"
    for rank_history in results:  # metrics are available on every rank
        for got, want in zip(rank_history, ref):
            # counts are exact; fp32 values differ only by reduction order across shards
            for key in ("num_kept", "num_response_tokens", "silenced_count", "candidate_count"):
                assert got[key] == want[key], key
            # measured <= 5e-6 relative over 6 updates (fp32 reduction order across shards)
            for key in ("loss", "tau_h", "entropy_mean", "approx_kl", "grad_norm", "clip_fraction"):
                assert got[key] == pytest.approx(want[key], rel=2e-5, abs=1e-6), key


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_s2t_on_clip_cov_matches_single_process(init_ckpt, tp, pp):
    """S2T on Clip-Cov (random draws, micro-batch covariance statistics) at TP=2 and PP=2: the
    draws are seeded per micro-batch, so the TP ranks agree and the run equals TP=PP=1."""
    ref = run_distributed(1, _train_worker, 1, 1, 3, "stapo", init_ckpt, "clip_cov")[0]
    results = run_distributed(2, _train_worker, tp, pp, 3, "stapo", init_ckpt, "clip_cov")
    assert sum(m["silenced_count"] for m in ref) > 0
    for rank_history in results:
        for got, want in zip(rank_history, ref):
            for key in ("num_kept", "silenced_count"):
                assert got[key] == want[key], key
            for key in ("loss", "grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=2e-5, abs=1e-6), key


def _manual_grad_norm_worker(init_ckpt):
    """First mini-batch gradient norm with plain autograd: sum of loss sums / total kept."""
    from megatron.core import dist_checkpointing

    from stapo_megatron.method.config import LossConfig
    from stapo_megatron.mcore.loss import loss_func, minibatch_threshold
    from stapo_megatron.mcore.schedule import PassContext, compute_logprob_entropy
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.recipes.synthetic import build_tiny_gpt, synthetic_rollouts, tiny_gpt_config

    init_parallel(1, 1)
    model = build_tiny_gpt(tiny_gpt_config(), VOCAB, PROMPT + RESPONSE)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), init_ckpt))
    mbs = synthetic_rollouts(4, 4, PROMPT, RESPONSE, VOCAB, seed=0, micro_batch_size=MBS)[0][:4]
    stats = compute_logprob_entropy(PassContext(model, PROMPT + RESPONSE), mbs)
    for mb, (lp, _) in zip(mbs, stats):
        mb.old_logprob = lp
    config = LossConfig(tau_p=0.0015)
    cat = lambda xs: torch.cat([x.reshape(-1) for x in xs])  # noqa: E731
    threshold = minibatch_threshold(
        config, cat([s[0] for s in stats]), cat([s[1] for s in stats]),
        cat([mb.advantages for mb in mbs]), cat([mb.response_mask for mb in mbs]),
    )
    total_loss, total_kept, kept_per_mb = 0.0, 0, []
    for mb in mbs:
        logits = model(mb.tokens, mb.position_ids, attention_mask=None)
        loss_sum, num_kept, _ = loss_func(config, mb, threshold, None, None, logits)
        total_loss, total_kept = total_loss + loss_sum, total_kept + int(num_kept)
        kept_per_mb.append(int(num_kept))
    (total_loss / total_kept).backward()
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
    return norm, kept_per_mb


def test_denominator_is_total_kept_tokens_over_microbatches_and_dp(reference_run, init_ckpt):
    """2 micro-batches x 2 DP ranks: Megatron's reduction divides by the mini-batch's kept count."""
    norm, kept_per_mb = run_distributed(1, _manual_grad_norm_worker, init_ckpt)[0]
    dp2 = run_distributed(2, _train_worker, 1, 1, 1, "stapo", init_ckpt)
    assert len(set(kept_per_mb)) > 1, "micro-batches should keep different token counts"
    for history in dp2:
        assert history[0]["num_kept"] == sum(kept_per_mb)
        assert history[0]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert reference_run[0]["grad_norm"] == pytest.approx(norm, rel=1e-5)


# --- data-parallel replicas start and stay identical (issue 12's seeding bug) -----------------


def _replica_worker(tp, pp, steps):
    """Build the trainer's model with no checkpoint (random init, fresh seeding), wrap it,
    train a few SGD steps; return this rank's (dp rank, TP/PP coordinates, params per stage)."""
    from megatron.core import parallel_state as ps

    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.bridge.tiny import tiny_config
    from stapo_megatron.method.config import LossConfig
    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
    from stapo_megatron.recipes.synthetic import synthetic_rollouts

    groups = init_parallel(tp, pp)
    model = build_gpt_model(tiny_config("qwen3"), calculate_per_token_loss=True)
    built = {n: p.detach().clone() for n, p in model.named_parameters()}
    model, optimizer = wrap_model_and_optimizer(
        model, OptimConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, clip_grad=1.0))
    dp_size, dp_rank = torch.distributed.get_world_size(groups.dp), torch.distributed.get_rank(groups.dp)
    seq = PROMPT + RESPONSE
    for step in range(steps):
        # each DP rank trains on different data: only the gradient all-reduce keeps them equal
        mbs, _ = synthetic_rollouts(2, 4, PROMPT, RESPONSE, 300, seed=10 * step + dp_rank, micro_batch_size=MBS)
        ctx = PassContext(model, seq, groups=groups, vocab_size=300)
        old_policy_pass(ctx, [mbs])
        policy_update(ctx, optimizer, mbs, LossConfig(method="justrl"))
    trained = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    coords = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    return dp_rank, dp_size, coords, built, trained


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_data_parallel_replicas_hold_identical_parameters(tp, pp):
    """World 4 = TP x PP x DP: every DP replica of each (TP, PP) shard has bit-identical
    parameters right after building (seeded init, no checkpoint) and after 3 Adam steps."""
    results = run_distributed(4, _replica_worker, tp, pp, 3)
    by_shard = {}
    for dp_rank, dp_size, coords, built, trained in results:
        assert dp_size == 4 // (tp * pp)
        by_shard.setdefault(coords, []).append((dp_rank, built, trained))
    assert len(by_shard) == tp * pp
    for coords, replicas in by_shard.items():
        (_, built0, trained0), *others = sorted(replicas, key=lambda r: r[0])
        assert any(not torch.equal(built0[n], trained0[n]) for n in built0), "the steps must change weights"
        for dp_rank, built, trained in others:
            for name in built0:
                assert torch.equal(built[name], built0[name]), f"{coords} DP rank {dp_rank}: {name} at build"
                assert torch.equal(trained[name], trained0[name]), f"{coords} DP rank {dp_rank}: {name} trained"


# --- sequence parallelism on the local spec (no transformer-engine): bridge/norm.py -------------

SP_PROMPT, SP_RESPONSE = 4, 12


def _sequence_parallel_worker(sequence_parallel):
    """Two STAPO updates of the tiny Qwen3 (local spec, TP=2) with or without sequence parallelism."""
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.bridge.tiny import tiny_config
    from stapo_megatron.method.config import LossConfig
    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
    from stapo_megatron.recipes.synthetic import synthetic_rollouts
    from tests.helpers.engine_parity import randomize

    groups = init_parallel(2, 1)
    config = tiny_config("qwen3")
    model = build_gpt_model(config, use_te=False, calculate_per_token_loss=True, sequence_parallel=sequence_parallel)
    norms = [p for n, p in model.named_parameters() if "layernorm" in n]
    assert norms and all(getattr(p, "sequence_parallel", None) is sequence_parallel for p in norms)
    randomize(model, seed=5)
    model, optimizer = wrap_model_and_optimizer(model, OptimConfig(optimizer="sgd", lr=0.05, weight_decay=0.0,
                                                                    clip_grad=0.0))
    ctx = PassContext(model, SP_PROMPT + SP_RESPONSE, groups=groups, vocab_size=config["vocab_size"])
    history = []
    for step in range(2):
        mbs, _ = synthetic_rollouts(4, 2, SP_PROMPT, SP_RESPONSE, config["vocab_size"], seed=step, micro_batch_size=2)
        old_policy_pass(ctx, [mbs])
        m = policy_update(ctx, optimizer, mbs, LossConfig(tau_p=0.05)).metrics
        history.append(m)
    return history, {n: p.detach().clone() for n, p in model.module.named_parameters()}


def test_sequence_parallel_without_transformer_engine_equals_tp():
    """TP=2 with sequence parallelism on the local spec (torch norms) trains exactly as TP=2
    without it: the same metrics and, after two updates, the same weights on every rank -- norm
    weights included, which see only their rank's half of the sequence and are right only
    because their gradients are summed over TP (the `sequence_parallel` mark of `TorchNorm`).
    Tolerance: fp32, 1e-5 relative on metrics and 1e-6 absolute on O(1) weights (the
    reduce-scatter and all-gather sum the same terms in another order)."""
    with_sp = run_distributed(2, _sequence_parallel_worker, True)
    without = run_distributed(2, _sequence_parallel_worker, False)
    assert sum(m["silenced_count"] for m in without[0][0]) > 0, "the S2T mask must be exercised"
    for (hist_sp, params_sp), (hist, params) in zip(with_sp, without):
        for got, want in zip(hist_sp, hist):
            for key in ("num_kept", "silenced_count", "candidate_count"):
                assert got[key] == want[key], key
            for key in ("loss", "tau_h", "entropy_mean", "grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        for name, want in params.items():
            torch.testing.assert_close(params_sp[name], want, atol=1e-6, rtol=0, msg=name)
    # the replicated norm weights stay identical across the two TP ranks
    for name in with_sp[0][1]:
        if "layernorm" in name:
            torch.testing.assert_close(with_sp[0][1][name], with_sp[1][1][name], atol=0, rtol=0, msg=name)


# --- gradient-reduce overlap: config.no_sync_func wired by wrap_ddp ------------------------------


def _overlap_worker(overlap_grad_reduce):
    """Two steps (two mini-batches of two micro-batches per DP rank each) of the tiny GPT at
    DP=2, with or without Megatron DDP's overlap_grad_reduce."""
    from stapo_megatron.method.config import LossConfig
    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
    from stapo_megatron.recipes.synthetic import build_tiny_gpt, synthetic_rollouts, tiny_gpt_config

    groups = init_parallel(1, 1, seed=11)  # both runs build the same weights
    dp_rank = torch.distributed.get_rank(groups.dp)
    model = build_tiny_gpt(tiny_gpt_config(1, 1), VOCAB, PROMPT + RESPONSE)
    model, optimizer = wrap_model_and_optimizer(model, OptimConfig(optimizer="sgd", lr=1.0, weight_decay=0.0,
                                                                    clip_grad=0.0,
                                                                    overlap_grad_reduce=overlap_grad_reduce))
    assert (model.config.no_sync_func is not None) == overlap_grad_reduce
    ctx = PassContext(model, PROMPT + RESPONSE, groups=groups)
    history = []
    for step in range(2):
        mbs, _ = synthetic_rollouts(4, 4, PROMPT, RESPONSE, VOCAB, seed=step, micro_batch_size=MBS)
        minis = [mini[dp_rank * 2:(dp_rank + 1) * 2] for mini in (mbs[:4], mbs[4:])]
        old_policy_pass(ctx, minis)
        for mine in minis:
            m = policy_update(ctx, optimizer, mine, LossConfig(tau_p=0.0015)).metrics
            history.append({k: m[k] for k in ("loss", "grad_norm", "num_kept")})
    return history, {n: p.detach().clone() for n, p in model.module.named_parameters()}


def test_overlap_grad_reduce_trains_as_without():
    """DP=2 on gloo: with overlap_grad_reduce (bucket reductions launched asynchronously from
    the backward hooks of the last micro-batch, held back by config.no_sync_func before it) the
    metrics and the weights after four updates are exactly those without overlap: the same
    fp32 buffer is all-reduced once per mini-batch either way (one bucket), only earlier.
    (megatron-core 0.16 learns per-parameter ready counts on the first mini-batch, which reduces
    synchronously; the three after it launch the reduction from the hooks.)"""
    overlapped = run_distributed(2, _overlap_worker, True)
    plain = run_distributed(2, _overlap_worker, False)
    for (hist_o, params_o), (hist, params) in zip(overlapped, plain):
        assert hist_o == hist
        for name, value in params.items():
            assert torch.equal(params_o[name], value), name
