"""The chunked gated delta rule in torch, vectorised within a chunk: Qwen3.5's delta-net kernel on
the CPU (`stapo_megatron.mcore.cpu_compat` points megatron-core's GatedDeltaNet at it).

The recurrence, per batch row and head (state S: [K, V], a_t = exp(g_t)):

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,      o_t = S_t^T q_t / sqrt(K)

Chunked (C tokens a chunk, positions i, j inside it, G_i the cumulative log decay from the chunk's
start, Gam_ij = exp(G_i - G_j) for i >= j, else 0), the WY/UT form of fla's ``chunk_gated_delta_rule``
and megatron-core's ``torch_chunk_gated_delta_rule``:

    A = I + strictly_lower(beta_i k_i.k_j Gam_ij)          (unit lower triangular, C x C)
    U = A^-1 (beta v),   W = A^-1 (beta k exp(G))           (one triangular solve, not a loop)
    v_new = U - W S_0,   o = (q exp(G)) S_0 + lower(q_i.k_j Gam_ij) v_new
    S_C = exp(G_C) S_0 + (k exp(G_C - G))^T v_new

with S_0 the state entering the chunk. Only the state is carried from chunk to chunk (two matmuls
a chunk in the loop); everything else is computed for all chunks at once, the outputs after the
loop: o = P U + (q exp(G) - P W) S_0 with P = lower(q_i.k_j Gam_ij). Megatron-core's reference
instead inverts A by a Python loop over the chunk's C rows (C autograd nodes a chunk), which
dominates training time on the CPU. Gradients are torch autograd's through these few ops.

Shapes: inputs [batch, tokens, heads, dim] (q, k: K; v: V), g and beta [batch, tokens, heads];
with ``cu_seqlens`` (N + 1 offsets) batch is 1 and each of the N sequences starts from its own
state. Legend of the suffixes: B batch, H heads, N chunks, C positions in a chunk, K key dim,
V value dim.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = 64, initial_state: Optional[torch.Tensor] = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gated delta rule over whole sequences, as megatron-core's GatedDeltaNet calls it
    (megatron-core 0.16.1 ``ssm/gated_delta_net.py`` and 0.19.2 ``ssm/gated_delta_net/gdn.py``:
    keywords ``g``, ``beta``, ``initial_state``, ``output_final_state``,
    ``use_qk_l2norm_in_kernel``, ``cu_seqlens`` in 0.19) with ``torch_chunk_gated_delta_rule``'s
    positional ``chunk_size`` and fla's ``scale``.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g (log decay, <= 0), beta (write strength): [B, T, H].
        chunk_size: tokens a chunk (any length is padded to a multiple; the result does not depend on it).
        initial_state: [B, H, K, V] (with ``cu_seqlens``: [N, H, K, V]), or None for zeros.
        output_final_state: return the state after the last token of each sequence.
        use_qk_l2norm_in_kernel: L2-normalise q and k over their last dim first (eps 1e-6, as fla).
        cu_seqlens: [N + 1] offsets of N sequences packed into B = 1, or None.
        scale: q's scale, default 1 / sqrt(K).

    Returns:
        (o [B, T, H, V] in q's dtype, final state [B or N, H, K, V] in the compute dtype or None).
        The compute dtype is q's promoted to at least float32 (bf16 runs in fp32, float64 stays).
    """
    if not (q.shape == k.shape and v.shape[:3] == q.shape[:3] and g.shape == beta.shape == q.shape[:3]):
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
                         f"beta {tuple(beta.shape)}: want q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H]")
    in_dtype, dtype = q.dtype, torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        o, state = _chunked(q * scale, k, v, g, beta, chunk_size, initial_state)
    else:
        o, state = _varlen(q * scale, k, v, g, beta, chunk_size, initial_state, cu_seqlens)
    return o.to(in_dtype), (state if output_final_state else None)


def _varlen(q, k, v, g, beta, chunk_size, initial_state, cu_seqlens):
    """N packed sequences of a [1, T, ...] row: each right-padded with zeros to the longest (a
    zero token, g = 0 and beta = 0, leaves the state unchanged and comes after the sequence), run
    as a batch of N, then unpadded."""
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens packs sequences into a batch of 1, got batch {q.shape[0]}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != q.shape[1] or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds} must rise from 0 to the {q.shape[1]} tokens")
    spans = list(zip(bounds, bounds[1:]))
    padded = [torch.nn.utils.rnn.pad_sequence([x[0, a:b] for a, b in spans], batch_first=True)
              for x in (q, k, v, g, beta)]
    o, state = _chunked(*padded, chunk_size, initial_state)
    return torch.cat([o[i, : b - a] for i, (a, b) in enumerate(spans)])[None], state


def _chunked(q, k, v, g, beta, chunk_size, initial_state):
    """The rule on a [B, T, H, .] batch (q already scaled); returns (o [B, T, H, V], state [B, H, K, V])."""
    num_tokens = q.shape[1]
    pad = -num_tokens % chunk_size
    # [B, T, H, D] -> [B, H, N, C, D]; the padding's zeros (g = 0, beta = 0) change nothing
    q_BHNCK, k_BHNCK, v_BHNCV = (_to_chunks(F.pad(x, (0, 0, 0, 0, 0, pad)), chunk_size) for x in (q, k, v))
    g_BHNC, beta_BHNC = (_to_chunks(F.pad(x, (0, 0, 0, pad))[..., None], chunk_size)[..., 0] for x in (g, beta))
    num_batch, num_heads, num_chunks, _, dim_k = q_BHNCK.shape
    dim_v = v_BHNCV.shape[-1]

    cum_BHNC = g_BHNC.cumsum(-1)
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) on and below the diagonal; above it -inf first, so no overflow reaches exp
    gamma_BHNCC = (cum_BHNC[..., :, None] - cum_BHNC[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kk_BHNCC = (k_BHNCK @ k_BHNCK.transpose(-1, -2)) * gamma_BHNCC
    a_BHNCC = (beta_BHNC[..., None] * kk_BHNCC).tril(-1) + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    rhs = torch.cat([v_BHNCV, k_BHNCK * cum_BHNC.exp()[..., None]], dim=-1) * beta_BHNC[..., None]
    uw = torch.linalg.solve_triangular(a_BHNCC, rhs, upper=False, unitriangular=True)
    u_BHNCV, w_BHNCK = uw[..., :dim_v], uw[..., dim_v:]

    p_BHNCC = (q_BHNCK @ k_BHNCK.transpose(-1, -2)) * gamma_BHNCC  # gamma is 0 above the diagonal
    q_state_BHNCK = q_BHNCK * cum_BHNC.exp()[..., None] - p_BHNCC @ w_BHNCK
    last_BHN = cum_BHNC[..., -1]
    k_out_BHNCK = k_BHNCK * (last_BHN[..., None] - cum_BHNC).exp()[..., None]
    state = (torch.zeros(num_batch, num_heads, dim_k, dim_v, dtype=q.dtype, device=q.device)
             if initial_state is None else initial_state.to(q.dtype))
    if state.shape != (num_batch, num_heads, dim_k, dim_v):
        raise ValueError(f"initial_state {tuple(state.shape)}, want {(num_batch, num_heads, dim_k, dim_v)}")
    # the only sequential part, two matmuls a chunk; unbind, not indexing, so that the backward
    # adds each chunk's gradient into one stacked tensor rather than into a zeroed copy per chunk
    entering = []
    decay_BHN11, k_out_BHNKC = last_BHN.exp()[..., None, None], k_out_BHNCK.transpose(-1, -2)
    for u_BHCV, w_BHCK, decay_BH11, k_out_BHKC in zip(u_BHNCV.unbind(2), w_BHNCK.unbind(2), decay_BHN11.unbind(2),
                                                      k_out_BHNKC.unbind(2)):
        entering.append(state)
        state = decay_BH11 * state + k_out_BHKC @ (u_BHCV - w_BHCK @ state)
    s_BHNKV = torch.stack(entering, dim=2)
    o_BHNCV = p_BHNCC @ u_BHNCV + q_state_BHNCK @ s_BHNKV
    o = o_BHNCV.reshape(num_batch, num_heads, num_chunks * chunk_size, dim_v)[:, :, :num_tokens]
    return o.transpose(1, 2), state


def _to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, T, H, D] (T a multiple of chunk_size) -> [B, H, N, C, D]."""
    b, t, h, d = x.shape
    return x.transpose(1, 2).reshape(b, h, t // chunk_size, chunk_size, d)
