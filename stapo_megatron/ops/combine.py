"""Steps 2-4 of the op, shared by the torch and the Triton path: the TP combination and the
normalisation (``logprob_entropy`` has the whole algorithm).

Each TP rank r brings per row its partials relative to a reference m_r >= max z of its shard:
s_r = sum exp(z - m_r), w_r = sum exp(z - m_r) (z - m_r), the target logit z_y (0 where another
rank owns the target) and optionally q_r = sum exp(2 (z - m_r)). Then

    step 2  all-reduce MAX of m_r                                  -> global reference M
    step 3  rescale to M and all-reduce SUM of the packed (s, w, z_y[, q]):
                S = sum_r exp(m_r - M) s_r
                W = sum_r exp(m_r - M) (w_r + (m_r - M) s_r)
                Q = sum_r exp(2 (m_r - M)) q_r
    step 4  log Z = M + log S, log p = z_y - log Z, H = log S - W / S, sum_v p_v^2 = Q / S^2

Exactly two collectives, whatever is asked for: q is one more row of the same SUM. Without a TP
group (TP = 1) both reductions are the identity. A shard whose entries are all -inf has
m_r = -inf and s_r = w_r = q_r = 0: its shift is clamped to the most negative finite float, so it
contributes 0 rather than NaN.

Legend: N = flattened tokens, K = packed rows of the SUM (3, or 4 with q).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

NEG_MAX = torch.finfo(torch.float32).min
"""The most negative finite fp32: 0 * it is 0 where 0 * -inf would be NaN."""

NO_GRADS = (None,) * 9
"""The gradients of the autograd functions' non-tensor (and integer) inputs."""


def packed_partials(m_N, global_m_N, s_N, w_N, z_target_N, q_N=None):
    """Step 3 before its SUM: this rank's partials rescaled to the global reference, [K, N]."""
    shift_N = (m_N - global_m_N).clamp(min=NEG_MAX)  # <= 0; finite when this shard is all -inf
    scale_N = shift_N.exp()
    rows = [s_N * scale_N, scale_N * (w_N + shift_N * s_N), z_target_N]
    if q_N is not None:  # exp(2 shift) = scale^2
        rows.append(q_N * scale_N.square())
    return torch.stack(rows)


def reduce_stats(m_N, s_N, w_N, z_target_N, q_N, tp_group):
    """Steps 2-3: MAX then one packed SUM over ``tp_group`` (None: no collective); returns the
    global (M, S, W, z_y, Q), Q None when ``q_N`` is (no collision sum asked for)."""
    global_m_N = m_N.clone()
    if tp_group is not None:
        dist.all_reduce(global_m_N, op=dist.ReduceOp.MAX, group=tp_group)
    packed_KN = packed_partials(m_N, global_m_N, s_N, w_N, z_target_N, q_N)
    if tp_group is not None:
        dist.all_reduce(packed_KN, op=dist.ReduceOp.SUM, group=tp_group)
    return global_m_N, packed_KN[0], packed_KN[1], packed_KN[2], None if q_N is None else packed_KN[3]


def normalise(global_m_N, sum_exp_N, sum_w_N, z_y_N, sum_q_N=None):
    """Step 4: (log Z, log p, H, sum_v p_v^2 or None) from the global statistics."""
    log_sum_exp_N = sum_exp_N.log()
    log_z_N = global_m_N + log_sum_exp_N
    collision_N = None if sum_q_N is None else sum_q_N / sum_exp_N.square()
    return log_z_N, z_y_N - log_z_N, log_sum_exp_N - sum_w_N / sum_exp_N, collision_N


def autograd_outputs(ctx, logprob_N, entropy_N, collision_N, entropy_grad):
    """The autograd functions' outputs: the collision sum (a placeholder when not asked for) and,
    unless ``entropy_grad``, the entropy are constants."""
    collision_N = logprob_N.new_empty(0) if collision_N is None else collision_N
    ctx.mark_non_differentiable(collision_N, *(() if entropy_grad else (entropy_N,)))
    return logprob_N, entropy_N, collision_N
