"""The doctor's kernel rows: the fused log-prob/entropy op against its torch path, packed and
context-parallel attention against each sequence's causal SDPA, the delta-net kernels (Qwen3.5)
against the gated delta rule token by token, and the transformer-engine layer spec against the
local spec on the same converted weights.

Each runs on this process's device (CUDA when there is one) inside a one-rank Megatron parallel
state the caller has formed (`stapo_megatron.mcore.parallel.init_parallel`). On a CPU machine the
op's Triton kernels run in Triton's interpreter in a spawned process (``TRITON_INTERPRET=1`` must
be set before triton is first imported), at a small shape.
"""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from typing import Dict, Tuple

import torch

from stapo_megatron.doctor.report import Check, failed, passed, skipped

OP_SHAPES = {"cuda": (4096, 151936, torch.bfloat16), "cpu": (64, 300, torch.float32)}
"""(tokens, vocabulary, logits dtype) of the op check: Qwen3's vocabulary at a micro-batch's
tokens on a GPU; a size Triton's interpreter runs in seconds on a CPU."""

OP_VALUE_TOL = 1e-4
"""|log p| and |H| difference, Triton vs torch: both accumulate in fp32, in other orders over up
to 151,936 terms (tests/ops/test_triton_path.py holds 2e-5 over 300 terms)."""

OP_GRAD_ULPS = {torch.float32: 16, torch.bfloat16: 4}
"""Gradient difference in ulps of the logits' dtype at the largest gradient entry: in bf16 the torch
path rounds up to three times (tests/ops/test_triton_path.py's PATH_GRAD_ATOL, 4 ulps); in fp32 the two
log Z differ by a few ulps and so does every probability (that file's 1e-5 at |grad| <= 8)."""

ATTENTION_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
"""Max error over max reference value (outputs; gradients get 5x): fp32 sums in other orders;
bf16 flash attention's P @ V in bf16 (tests/gpu/test_gpu.py's attention tolerances)."""

DELTA_RULE_TOL = 1e-4
"""Max error over max reference value of the chunked gated delta rule against the token-by-token
recurrence, both fp32: the chunked form solves each 64-token chunk's triangular system and sums in
another order (measured ~1e-6 on the CPU at the check's shape)."""

TE_LOGIT_TOL = 1e-3
"""TE spec vs local spec, fp32 weights, relative to the largest logit: TE's fused LayerNorm-linear
and cuDNN attention against the local spec's separate ops (TF32 off; tests/conversion/test_verify.py)."""


def _op_errors(device: str, num_tokens: int, vocab: int, dtype: torch.dtype) -> Dict[str, float]:
    """Triton vs torch path of `vocab_parallel_logprob_entropy`: max |dlog p|, |dH|, and the gradient
    difference over the largest gradient entry's ulp."""
    from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy

    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(num_tokens, vocab, generator=gen)).to(device, dtype)
    target = torch.randint(0, vocab, (num_tokens,), generator=gen).to(device)
    weight = torch.randn(num_tokens, generator=gen).to(device)
    out = {}
    for impl in ("torch", "triton"):
        x = logits.clone().requires_grad_()
        lp, h = vocab_parallel_logprob_entropy(x, target, temperature=0.7, impl=impl)
        (lp * weight).sum().backward()
        out[impl] = (lp.detach().float(), h.float(), x.grad.float())
    (lp_t, h_t, g_t), (lp_k, h_k, g_k) = out["torch"], out["triton"]
    ulp = torch.finfo(dtype).eps * float(g_t.abs().max())
    return dict(logprob_max_diff=float((lp_k - lp_t).abs().max()), entropy_max_diff=float((h_k - h_t).abs().max()),
                grad_max_diff_ulps=float((g_k - g_t).abs().max()) / ulp)


def _interpreted_op_errors(num_tokens: int, vocab: int) -> Dict[str, float]:
    """`_op_errors` on the CPU with the kernels interpreted (in a process whose TRITON_INTERPRET is 1)."""
    from triton.runtime.interpreter import InterpretedFunction

    from stapo_megatron.ops import triton_kernels as kernels

    if not isinstance(kernels._shard_stats_kernel, InterpretedFunction):
        raise RuntimeError("Triton's interpreter did not take the kernels (TRITON_INTERPRET set too late)")
    kernels.FORCED_SHAPE = (64, 4)  # several blocks per row, the last one ragged
    return _op_errors("cpu", num_tokens, vocab, torch.float32)


def _set_env(env: Dict[str, str]) -> None:
    os.environ.update(env)


def check_logprob_op() -> Check:
    """The fused log-prob/entropy op (Triton) against its torch path, values and gradient."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return skipped("logprob_op", "triton is not installed: the op runs its torch path only")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    num_tokens, vocab, dtype = OP_SHAPES[device]
    if device == "cuda":
        errors = _op_errors(device, num_tokens, vocab, dtype)
    else:
        import multiprocessing

        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_set_env,
                                 initargs=({"TRITON_INTERPRET": "1"},)) as pool:
            errors = pool.submit(_interpreted_op_errors, num_tokens, vocab).result()
    where = f"{device}{' (Triton interpreter)' if device == 'cpu' else ''}, {num_tokens} x {vocab} {dtype}"
    detail = (f"{where}: max |dlog p| {errors['logprob_max_diff']:.1e}, |dH| {errors['entropy_max_diff']:.1e} "
              f"(bound {OP_VALUE_TOL:.0e}), grad {errors['grad_max_diff_ulps']:.2f} ulp (bound {OP_GRAD_ULPS[dtype]})")
    ok = (max(errors["logprob_max_diff"], errors["entropy_max_diff"]) <= OP_VALUE_TOL
          and errors["grad_max_diff_ulps"] <= OP_GRAD_ULPS[dtype])
    return (passed if ok else failed)("logprob_op", detail, **errors)


def attention_errors(dtype: torch.dtype, device: str) -> Dict[str, Tuple[float, float]]:
    """The packed (THD) path of `SDPAttention` and its context-parallel chunks (CP = 2, each rank's
    chunks against the whole K/V, what the all-gather gives) against each sequence's causal SDPA
    alone: {path: (output error, q/k/v gradient error)}, each max |difference| / max |reference|."""
    import torch.nn.functional as F
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from stapo_megatron.bridge.attention import SDPAttention, chunk_attention
    from stapo_megatron.batch.context_parallel import local_positions
    from stapo_megatron.recipes.synthetic import tiny_gpt_config

    config = tiny_gpt_config(1)
    attn = SDPAttention(config, 1, AttnMaskType.causal, "self")
    heads, groups, dim = config.num_attention_heads, config.num_query_groups, config.kv_channels
    cu = torch.tensor([0, 512, 640, 1536], dtype=torch.int32, device=device)  # multiples of 2 x CP (4)
    T, gen = int(cu[-1]), torch.Generator().manual_seed(0)
    qkv = [torch.randn(T, h, dim, generator=gen).to(device, dtype) for h in (heads, groups, groups)]
    upstream = torch.randn(T, heads * dim, generator=gen).to(device, dtype)

    def run(fn, rows=None):
        inputs = [t.clone().requires_grad_() for t in qkv]
        out = fn(*inputs)
        out.backward(upstream if rows is None else upstream[rows])
        return out.float(), [t.grad.float() for t in inputs]

    def error(got, want):
        return float((got - want).abs().max() / want.abs().max())

    bounds = cu.tolist()
    want, want_grads = run(lambda q, k, v: torch.cat([F.scaled_dot_product_attention(
        *(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, enable_gqa=True)[0]
        for a, b in zip(bounds, bounds[1:])], dim=1).transpose(0, 1).reshape(T, -1))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=896, max_seqlen_kv=896)
    got, grads = run(lambda q, k, v: attn(q, k, v, None, packed_seq_params=params))
    errors = {"packed": (error(got, want), max(error(g, w) for g, w in zip(grads, want_grads)))}
    for rank in (0, 1):
        idx = local_positions(cu.cpu(), 2, rank).to(device)
        got, grads = run(lambda q, k, v: chunk_attention(attn._sdpa, q[idx], k, v, cu, 2, rank), rows=idx)
        # K/V gradients of one rank's chunks are partial (the other rank's queries add the rest)
        errors[f"cp2_rank{rank}"] = (error(got, want[idx]), error(grads[0][idx], want_grads[0][idx]))
    return errors


def check_attention() -> Check:
    """Packed varlen and CP chunk attention against per-sequence causal SDPA (bf16 on a GPU, where
    the packed path is varlen flash attention; fp32 on the CPU, its per-sequence reference path)."""
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    errors = attention_errors(dtype, device)
    tol = ATTENTION_TOL[dtype]
    worst = {path: e for path, e in errors.items() if e[0] > tol or e[1] > 5 * tol}
    detail = f"{device} {dtype}: " + ", ".join(f"{p} {o:.1e}/{g:.1e}" for p, (o, g) in errors.items()) + \
        f" (output/grad error, bound {tol:.0e}/{5 * tol:.0e})"
    values = {p: dict(output=o, grad=g) for p, (o, g) in errors.items()}
    return (failed if worst else passed)("attention", detail, **values)


def check_te_spec(variant: str = "qwen3") -> Check:
    """The transformer-engine spec against the local spec: one tiny HF model converted by
    `stapo-convert hf-to-mcore`, loaded into both (`bridge.load_checkpoint`), logits compared."""
    import importlib.util

    if not torch.cuda.is_available():
        return skipped(f"te_spec_{variant}", "needs CUDA (the transformer-engine layer spec)")
    if importlib.util.find_spec("transformer_engine") is None:
        return skipped(f"te_spec_{variant}", "transformer-engine is not installed")
    from stapo_megatron.bridge import build_gpt_model, load_checkpoint
    from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
    from stapo_megatron.conversion.hf_to_mcore import convert_hf_to_mcore
    from stapo_megatron.conversion.verify import _megatron_forward, fixed_prompts

    torch.backends.cuda.matmul.allow_tf32 = False
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_hf_model(os.path.join(tmp, "hf"), variant, dtype=torch.float32)
        convert_hf_to_mcore(os.path.join(tmp, "hf"), os.path.join(tmp, "ckpt"))
        tokens_BS = fixed_prompts(tiny_config(variant)["vocab_size"])
        logits = {}
        for use_te in (False, True):
            model = build_gpt_model(tiny_config(variant), params_dtype=torch.float32, parallel_output=False,
                                    use_te=use_te)
            load_checkpoint(model, os.path.join(tmp, "ckpt"))
            model.eval()
            with torch.no_grad():
                logits[use_te] = _megatron_forward(model, tokens_BS)
    local, te = logits[False], logits[True]
    scale = float(local.abs().max())
    diff, top1 = float((te - local).abs().max()), float((te.argmax(-1) == local.argmax(-1)).float().mean())
    detail = f"max |dlogit| {diff:.1e} of max |logit| {scale:.2f} (bound {TE_LOGIT_TOL:.0e} relative), top-1 {top1:.1%}"
    ok = diff <= TE_LOGIT_TOL * scale and top1 == 1.0
    return (passed if ok else failed)(f"te_spec_{variant}", detail, max_abs_diff=diff, logit_scale=scale, top1=top1)


def recurrent_delta_rule(q, k, v, g, beta, initial_state=None, return_state=False):
    """The gated delta rule token by token (at least fp32, float64 stays; [batch, tokens, heads,
    dim] inputs, ``g`` the log decay and ``beta`` the write strength per token and head): S_t =
    a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T with a_t = exp(g_t), o_t = S_t^T q_t /
    sqrt(dim_k), from ``initial_state`` S_0 ([batch, heads, dim_k, dim_v], default zeros). Returns
    o, or (o, S_T) with ``return_state``."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    q = q / q.shape[-1] ** 0.5
    state = (torch.zeros(q.shape[0], q.shape[2], k.shape[-1], v.shape[-1], dtype=dtype, device=q.device)
             if initial_state is None else initial_state.to(dtype))
    out = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t][..., None]
        state = state + k[:, t][..., None] * delta[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    out = torch.stack(out, dim=1)
    return (out, state) if return_state else out


def delta_rule_error(device: str) -> Tuple[str, float]:
    """(which kernel, max error / max reference) of the chunked gated delta rule megatron-core's
    GatedDeltaNet calls in this process (fla's Triton kernel on CUDA; on the CPU the torch chunked
    kernel `stapo_megatron.mcore.delta_rule` that `stapo_megatron.mcore.cpu_compat` installs)
    against `recurrent_delta_rule`, fp32, over
    150 tokens (two whole chunks and a ragged one) of 4 heads of 32."""
    import torch.nn.functional as F

    from stapo_megatron.mcore.mcore_versions import delta_net_modules

    kernel = delta_net_modules()[0].chunk_gated_delta_rule  # the name GatedDeltaNet's own module binds
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 150, 4, 32, generator=gen) for _ in range(3))
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)  # the layer l2-normalises q and k first
    g = -F.softplus(torch.randn(1, 150, 4, generator=gen))  # log decays < 0
    beta = torch.sigmoid(torch.randn(1, 150, 4, generator=gen))
    want = recurrent_delta_rule(q, k, v, g, beta)
    got, _ = kernel(*(x.to(device) for x in (q, k, v, g, beta)), initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False)
    name = f"{kernel.__module__}.{kernel.__name__}"
    return name, float((got.float().cpu() - want).abs().max() / want.abs().max())


def check_delta_net() -> Check:
    """Qwen3.5's delta-net kernels: on CUDA fla must import with a working Triton driver (its
    chunked kernel is the fast path); on the CPU the torch kernel the CPU shim installs
    (`stapo_megatron.mcore.delta_rule`) runs instead. Either is compared with the token-by-token
    gated delta rule; the row names the kernel that ran."""
    import importlib.util

    from stapo_megatron.mcore import cpu_compat

    cuda = torch.cuda.is_available()
    if cuda and importlib.util.find_spec("fla") is None:
        return failed("delta_net", "CUDA without flash-linear-attention: Qwen3.5's delta-net layers need fla "
                                   "(pip install '.[gpu]', fla-core==0.6.0)")
    if cuda:
        try:
            import fla.ops.gated_delta_rule  # noqa: F401
        except Exception as error:  # e.g. a triton fla does not support: the row names the error
            return failed("delta_net", f"fla does not import: {type(error).__name__}: {error}")
    else:
        cpu_compat.apply()  # the torch kernel megatron-core's GatedDeltaNet runs on the CPU
    name, error = delta_rule_error("cuda" if cuda else "cpu")
    detail = (f"{'cuda' if cuda else 'cpu'} fp32, {name}: max error {error:.1e} of the recurrence's max "
              f"(bound {DELTA_RULE_TOL:.0e})")
    return (passed if error <= DELTA_RULE_TOL else failed)("delta_net", detail, kernel=name, error=error)
