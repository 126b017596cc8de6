"""The Triton path of the op: its autograd function on CUDA tensors (or under Triton's
interpreter), around the kernels of ``triton_kernels`` (``logprob_entropy`` has the algorithm).

Forward reads each shard once and writes only [N] outputs: unsharded (TP = 1) the kernel finishes
the rows itself (log p, H, log Z and sum_v p_v^2, no partials and no extra launches); sharded, it
writes the partials that ``combine`` reduces over the TP group. Backward reads the logits once and
writes the gradient once (over the logits themselves with ``inplace_backward``), from the global
log Z: no collective. Only [N] statistics are kept for backward besides a reference to the logits
(no copy). The kernel module (and with it Triton) is imported when the path first runs, so that
importing the op needs no Triton.

Legend: N = flattened tokens, V = local vocabulary shard size.
"""

from __future__ import annotations

import torch

from stapo_megatron.ops.combine import NO_GRADS, autograd_outputs, normalise, reduce_stats


class LogprobEntropyTriton(torch.autograd.Function):
    """The Triton path: forward reads the shard once, backward reads it once and writes once."""

    @staticmethod
    def forward(
        ctx, logits_NV, target_N, vocab_start, num_real, inv_temp, tp_group, needs_grad, entropy_grad, inplace,
        with_collision,
    ):
        from stapo_megatron.ops import triton_kernels as kernels

        if tp_group is None:  # the kernel finishes the rows itself: no partials, no extra launches
            logprob_N, entropy_N, log_z_N, collision_N = kernels.shard_stats(
                logits_NV, target_N, vocab_start, num_real, inv_temp, finalize=True, with_grad=needs_grad
            )
        else:
            partials = kernels.shard_stats(
                logits_NV, target_N, vocab_start, num_real, inv_temp, finalize=False, with_grad=needs_grad
            )
            if not with_collision:  # the kernel wrote q anyway; it need not travel
                partials = partials[:4] + (None,)
            log_z_N, logprob_N, entropy_N, collision_N = normalise(*reduce_stats(*partials, tp_group))
        if needs_grad:
            ctx.save_for_backward(logits_NV, target_N, log_z_N, entropy_N)
        ctx.vocab_start, ctx.num_real, ctx.inv_temp = vocab_start, num_real, inv_temp
        ctx.entropy_grad, ctx.inplace = entropy_grad, inplace
        return autograd_outputs(ctx, logprob_N, entropy_N, collision_N if with_collision else None, entropy_grad)

    @staticmethod
    def backward(ctx, grad_logprob_N, grad_entropy_N, _grad_collision_N):
        from stapo_megatron.ops import triton_kernels as kernels

        logits_NV, target_N, log_z_N, entropy_N = ctx.saved_tensors
        grad_NV = kernels.logits_grad(
            logits_NV, target_N, ctx.vocab_start, ctx.num_real, ctx.inv_temp, log_z_N, grad_logprob_N,
            entropy_N if ctx.entropy_grad else None,
            grad_entropy_N if ctx.entropy_grad else None,
            out_NV=logits_NV.detach() if ctx.inplace else None,
        )
        return grad_NV, *NO_GRADS
