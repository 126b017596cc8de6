"""Tier c: what only a GPU can show (skipped on CPU machines)."""

import pytest
import torch

from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("vocab", [151936, 248320], ids=["qwen3", "qwen3.5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_op_matches_cpu(dtype, vocab):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, vocab, generator=gen) * 3).to(dtype)
    target = torch.randint(0, vocab, (64,), generator=gen)
    assert (torch.logsumexp(logits.double() / 0.7, -1) < 32).all()  # the gradient bound's log Z < 32, below
    cpu = logits.clone().requires_grad_()
    lp_cpu, h_cpu = vocab_parallel_logprob_entropy(cpu, target, temperature=0.7)
    lp_cpu.sum().backward()
    gpu = logits.cuda().requires_grad_()
    lp_gpu, h_gpu = vocab_parallel_logprob_entropy(gpu, target.cuda(), temperature=0.7)
    lp_gpu.sum().backward()
    # both accumulate in fp32; only the reduction order differs
    torch.testing.assert_close(lp_gpu.cpu(), lp_cpu.detach(), atol=1e-4, rtol=0)
    torch.testing.assert_close(h_gpu.cpu(), h_cpu, atol=1e-4, rtol=0)
    # fp32: entries (onehot - p) / T differ by <= p / T x 1.5 ulps of log Z < 32 (2^-19 each): half an ulp
    # the rounding of log Z in the Triton backward's exp(z - log Z); half both sides' exp (ex2.approx: 2 ulp)
    # and sums; half the "lane" Triton forward's sums (where a device runs it) taking each entry's exact
    # (x - x_max) log2(e) / T where the backward (and the CPU) take the rounded z = fl(x / T): its log Z moves by the p-weighted mean of those
    # roundings, at most half an ulp of z (log Z - a few < z <= log Z < 32); 0.47 ulp for these inputs
    # (float64 emulation of both forwards' sums)
    tol = 1.5 * 2**-19 / 0.7 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(gpu.grad.cpu().float(), cpu.grad.float(), atol=tol, rtol=0)


# --- the GPU path without transformer-engine, apex or vLLM ------------------------------------

import contextlib  # noqa: E402
import os  # noqa: E402

from tests.helpers.dist_utils import run_distributed  # noqa: E402

PROMPT, RESPONSE, MBS, VOCAB = 4, 12, 2, 300


@contextlib.contextmanager
def _cpu_only():
    """Processes spawned inside see no GPU: cpu_compat applies and Megatron runs on the CPU."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        os.environ.pop("CUDA_VISIBLE_DEVICES") if saved is None else os.environ.__setitem__("CUDA_VISIBLE_DEVICES", saved)


def _policy_update_worker(steps):
    """Two mini-batches per step of the STAPO update on the tiny Qwen3 (fp32), from fixed weights."""
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.bridge.tiny import tiny_config
    from stapo_megatron.method.config import LossConfig
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
    from stapo_megatron.recipes.synthetic import synthetic_rollouts
    from tests.helpers.engine_parity import randomize

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (the default; stated for the tolerance)
    groups = init_parallel(1, 1)
    model = build_gpt_model(tiny_config("qwen3"), calculate_per_token_loss=True)
    randomize(model, seed=5)  # CPU generators: the same weights on either device
    model, optimizer = wrap_model_and_optimizer(model, OptimConfig(optimizer="sgd", lr=0.05, weight_decay=0.0,
                                                                    clip_grad=0.0))
    seq, history = PROMPT + RESPONSE, []
    for step in range(steps):
        mbs, _ = synthetic_rollouts(4, 4, PROMPT, RESPONSE, VOCAB, seed=step, micro_batch_size=MBS)
        minis = [mbs[:4], mbs[4:]]
        ctx = PassContext(model, seq, groups=groups, vocab_size=VOCAB)
        old_policy_pass(ctx, minis)
        for mini in minis:
            m = policy_update(ctx, optimizer, mini, LossConfig(tau_p=0.02)).metrics
            history.append({k: v for k, v in m.items() if k != "silenced_tokens"})
    device = str(next(model.parameters()).device)
    return device, history, {n: p.detach().cpu() for n, p in model.module.named_parameters()}


def test_policy_update_on_cuda_equals_cpu():
    """fp32: the same two-step STAPO update (SDPA core attention on CUDA, the local one on CPU).
    Tolerance: 1e-4 relative on metrics and 1e-5 absolute on O(0.1-1) weights -- cuBLAS and
    MKL sum in different orders (~1e-6 per op); counts (kept, silenced, candidates) are exact."""
    (gpu_device, gpu_hist, gpu_params), = run_distributed(1, _policy_update_worker, 2)
    with _cpu_only():
        (cpu_device, cpu_hist, cpu_params), = run_distributed(1, _policy_update_worker, 2)
    assert gpu_device.startswith("cuda") and cpu_device == "cpu"
    assert sum(m["silenced_count"] for m in cpu_hist) > 0, "the S2T mask must be exercised"
    for got, want in zip(gpu_hist, cpu_hist):
        for key in ("num_kept", "num_response_tokens", "silenced_count", "candidate_count", "skipped"):
            assert got[key] == want[key], key
        for key in ("loss", "tau_h", "entropy_mean", "approx_kl", "grad_norm", "clip_fraction"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    for name, want in cpu_params.items():
        torch.testing.assert_close(gpu_params[name], want, atol=1e-5, rtol=0, msg=name)


def _attention_worker(dtype):
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.bridge.tiny import tiny_config
    from stapo_megatron.mcore.parallel import init_parallel
    from tests.helpers.engine_parity import randomize

    torch.backends.cuda.matmul.allow_tf32 = False
    init_parallel(1, 1)
    out = {}
    for variant in ("qwen3", "qwen2.5"):
        local = build_gpt_model(tiny_config(variant), params_dtype=dtype, bf16=dtype == torch.bfloat16,
                                core_attention="local")
        sdpa = build_gpt_model(tiny_config(variant), params_dtype=dtype, bf16=dtype == torch.bfloat16,
                               core_attention="sdpa")
        randomize(local, seed=3)
        sdpa.load_state_dict(local.state_dict())
        tokens = torch.randint(0, tiny_config(variant)["vocab_size"], (2, 256), generator=torch.Generator().manual_seed(0))
        tokens, pos = tokens.cuda(), torch.arange(256, device="cuda").expand(2, 256)
        logits = [m(tokens, pos, attention_mask=None) for m in (local, sdpa)]
        upstream = torch.randn(logits[0].shape, generator=torch.Generator().manual_seed(1)).to(logits[0])
        for lg in logits:
            lg.backward(upstream)
        grad_err = max(float((q.grad.float() - p.grad.float()).abs().max() / p.grad.float().abs().max())
                       for p, q in zip(local.parameters(), sdpa.parameters()))
        scale = float(logits[0].float().abs().max())
        out[variant] = (float((logits[1].float() - logits[0].float()).abs().max()) / scale, grad_err, scale)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_attention_equals_local_on_cuda(dtype):
    """fp32: 1e-5 of the largest logit and of each largest gradient (efficient-attention vs
    baddbmm+softmax, fp32 sums in different orders). bf16: 2e-2 -- flash attention keeps the
    probabilities in bf16 for P @ V where the local path rounds them the same way, but the two
    accumulate 256-term sums in different orders (a few bf16 ulps, 2^-8 each)."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    (result,) = run_distributed(1, _attention_worker, dtype)
    for variant, (logit_err, grad_err, scale) in result.items():
        print(f"\n{variant} {dtype}: max|dlogit|/max|logit| {logit_err:.2e} (max {scale:.2f}), grad {grad_err:.2e}")
        assert scale > 1.0
        assert logit_err <= tol and grad_err <= 5 * tol, variant


def test_stapo_convert_verify_on_cuda(tmp_path):
    """HF -> Megatron conversion, then `stapo-convert verify` (Megatron on CUDA, SDPA attention)."""
    from stapo_megatron.conversion.cli import main
    from stapo_megatron.bridge.tiny import save_tiny_hf_model

    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    save_tiny_hf_model(hf_dir, "qwen3", dtype=torch.float32, seed=0)
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", ckpt]) == 0
    assert main(["verify", "--hf-dir", hf_dir, "--ckpt", ckpt, "--tp", "1", "--pp", "1"]) == 0


def _packed_and_cp_attention_worker(dtype, device):
    """The packed (THD) and context-parallel attention paths of `SDPAttention` on ``device``
    against each sequence's causal SDPA alone: stapo-doctor's attention row
    (`stapo_megatron.doctor.kernels.attention_errors`), {path: (output error, gradient error)}."""
    from stapo_megatron.doctor.kernels import attention_errors
    from stapo_megatron.mcore.parallel import init_parallel

    init_parallel(1, 1)
    return attention_errors(dtype, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_and_context_parallel_attention_on_cuda(dtype):
    """The packed path (varlen flash attention in bf16, per-sequence SDPA in fp32) and the CP
    chunks (lower-right causal SDPA) equal each sequence's causal attention alone. Tolerances as
    the SDPA test above (fp32 1e-5; bf16 2e-2: the same products summed in other orders)."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    (errors,) = run_distributed(1, _packed_and_cp_attention_worker, dtype, "cuda")
    for name, (out_err, grad_err) in errors.items():
        print(f"\n{name} {dtype}: output {out_err:.2e}, grad {grad_err:.2e}")
        assert out_err <= tol and grad_err <= 5 * tol, name


def _router_replay_worker():
    """Router replay (R3) on this process's device, fp32: the replayed pass's log-probs and
    routing maps for random routes, and the loss/gradients of a replayed update with and without
    full recomputation (`tests/mcore/test_router_replay.py`'s checks, on one device), the routes
    each pass really took (`RouteRecorder`) and, per embedding row, the sum over the tokens that
    hit it of |d loss / d embedding output| (the row gradient's contributions)."""
    from stapo_megatron.mcore.parallel import init_parallel
    from tests.helpers.moe_sync_workers import randomize_experts
    from tests.helpers.route_recorder import RouteRecorder
    from tests.helpers.router_replay_workers import (E, L, _loss_and_grads, _microbatch, build_replay_model,
                                                    expected_maps, random_routes, replayed_pass)

    torch.backends.cuda.matmul.allow_tf32 = False
    groups = init_parallel(1, 1)
    plain = build_replay_model()
    randomize_experts(plain, seed=7)  # CPU generators: the same weights on either device
    recompute = build_replay_model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    recompute.load_state_dict(plain.state_dict())
    device = str(next(plain.parameters()).device)
    tokens_BS = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    routes_BSLK = random_routes(2, 16, L, seed=3)
    plain.eval()
    logprob, maps = replayed_pass(plain, groups, tokens_BS, routes_BSLK)
    want = expected_maps(routes_BSLK)
    maps_equal = all(torch.equal(maps[layer].cpu(), want[:, layer]) for layer in range(L))
    gen = torch.Generator().manual_seed(4)
    mbs = [_microbatch(torch.randint(0, 300, (2, 12), generator=gen), random_routes(2, 12, L, seed=10 + i))
           for i in range(3)]
    plain.train()
    recompute.train()
    table = plain.embedding.word_embeddings.weight
    abs_sum, hits = torch.zeros(table.shape, dtype=torch.float64), torch.zeros(table.shape[0], dtype=torch.float64)

    def keep_contributions(module, inputs, output):
        ids = inputs[0].detach().reshape(-1).cpu()
        hits.index_add_(0, ids, torch.ones(len(ids), dtype=torch.float64))

        def add(grad):  # returns None: the gradient flows on unchanged
            abs_sum.index_add_(0, ids, grad.detach().abs().reshape(len(ids), -1).double().cpu())

        output.register_hook(add)

    hook = plain.embedding.word_embeddings.register_forward_hook(keep_contributions)
    results, routes = [], []
    for model in (plain, recompute):
        with RouteRecorder(model) as recorder:
            results.append(_loss_and_grads(model, mbs, 12))
        routes.append(recorder.mismatches(mbs, E))
    hook.remove()
    return dict(device=device, logprob=logprob.cpu(), maps_equal=maps_equal, routes=routes,
                losses=[loss for loss, _ in results], embedding_abs_sum=abs_sum, embedding_hits=hits,
                grads=[{n: g.cpu() for n, g in grads.items()} for _, grads in results])


ROUNDING_CHAIN = 300 + 4 * (3 * 64 + 2 * 96 + 2 * 12)
"""fp32 roundings along one token's gradient path in the tiny Qwen3-MoE (`ROUTED_GRAD_BOUND`): the
output layer's backward sums V = 300 terms; each of its L = 4 layers sums over h = 64 (three
projections), over the MLP widths (at most the dense 96) and over the S = 12 positions twice."""


def test_router_replay_on_cuda_equals_cpu():
    """R3 on CUDA: every token goes to the replayed experts, the log-probs equal the CPU's (1e-4:
    fp32, cuBLAS vs MKL reduction orders, ~1e-6 per op) and a full recomputation replays the same
    routes in backward: `RouteRecorder` sees every forward and every recomputation of every layer
    take the micro-batch's own targets (0 mismatched tokens, on CUDA and on the CPU).

    The gradients of the recomputed and the unrecomputed pass then come from the same routes and
    differ only by rounding: on CUDA the recomputation's first forward runs without autograd and
    its kernels (SDPA/GEMM variants chosen by the autograd mode and alignment; index_add and
    scatter_add with atomics in the MoE permutation) may round differently, and each ulp moves
    every later layer's input. Bound, per element of a parameter gradient g = sum_t c_t over the
    tokens' contributions c_t: each c_t is a chain of at most n = `ROUNDING_CHAIN` fp32 roundings
    (dot products of length V, h, ffn, S; gamma_n = n u, u = 2^-24), so |c_t - c_t'| <= gamma_n
    |c_t|_abs, and the final sum over the n_v tokens of a row adds n_v u sum |c_t|; with |c_t|_abs
    (the chain in absolute values) taken as 2 |c_t| (an allowance for cancellation inside the
    chain, not derived): |g - g'| <= (2 gamma_n + n_v u) sum_t |c_t|. For the embedding rows the
    worker measures sum_t |c_t| (the gradient at each token's embedding output); the other
    parameters keep rtol 1e-5 / atol 1e-7 (the H200 of 2026-11-27 reported only the embedding,
    the first parameter checked: every parameter is now checked and all failures reported)."""
    (gpu,) = run_distributed(1, _router_replay_worker)
    with _cpu_only():
        (cpu,) = run_distributed(1, _router_replay_worker)
    assert gpu["device"].startswith("cuda") and cpu["device"] == "cpu"
    for side in (gpu, cpu):  # the routes really replayed, recomputation included (3 micro-batches x 4 layers)
        assert side["routes"] == [dict(forward=12, recompute=0, own=0, mismatched=0),
                                  dict(forward=12, recompute=12, own=0, mismatched=0)], side["routes"]
    assert gpu["maps_equal"] and cpu["maps_equal"]
    assert (gpu["logprob"] - cpu["logprob"]).abs().max().item() <= 1e-4
    plain, recompute = gpu["grads"]
    assert gpu["losses"][0] == pytest.approx(gpu["losses"][1], rel=1e-5)
    assert gpu["losses"][0] == pytest.approx(cpu["losses"][0], rel=1e-4)
    u = 2.0 ** -24
    failures = []
    for name, g in plain.items():
        diff = (recompute[name] - g).abs().double()
        if name == "embedding.word_embeddings.weight":
            bound = (2 * ROUNDING_CHAIN * u + gpu["embedding_hits"][:, None] * u) * gpu["embedding_abs_sum"]
            worst = float((diff / bound.clamp_min(1e-30)).max())
            print(f"\nembedding: max |dg| {float(diff.max()):.2e}, max |dg| / bound {worst:.3f}")
        else:
            worst = float((diff / (1e-7 + 1e-5 * g.abs().double())).max())
        if worst > 1:
            failures.append(f"{name}: max |dg| {float(diff.max()):.2e}, {worst:.2f} x its bound")
    assert not failures, "recomputed vs unrecomputed gradients on CUDA:\n" + "\n".join(failures)

