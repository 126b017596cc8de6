"""The Triton-path tests' shared parts: the devices they run on, the tolerances with their reasons,
the kernel module set up for interpreted (CPU) or native (CUDA) runs with 64-entry kernel blocks,
the inputs (one row with p -> 1, one with masked vocabulary), a float64 full-vocabulary reference,
one forward and backward through either path, and the TP = 2 gloo worker that counts the op's
collectives. Used by ``tests/ops/test_triton_path.py`` and ``tests/integration/test_triton_path_tp.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy  # imports no triton: the workers choose the mode

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),
]
BLOCK_V = 64

# log p and H: both paths accumulate in fp32 over <= 300 terms, in different orders.
VALUE_TOL = 2e-5
# Kernel gradient vs the float64 reference: computed in fp32 and rounded once to the logits'
# dtype, so half an ulp of that dtype (relative) plus fp32 noise (absolute); for bf16 a whole ulp,
# because Triton's interpreter (3.9, cast_impl) truncates fp32 -> bf16 where a GPU rounds.
GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-11}
GRAD_ATOL = 1e-6
# Kernel vs torch-path gradient: in fp32 the two log Z differ by a few ulps (summation order)
# and so does every p; in bf16/fp16 the torch path rounds up to three times (numerator, row
# factor, product), so four ulps of the largest entry (|grad| <= |g| / T < 8 here).
PATH_GRAD_ATOL = {torch.float32: 1e-5, torch.bfloat16: 4 * 2**-8 * 8, torch.float16: 4 * 2**-11 * 8}


def _kernels(device, forward=None):
    """The kernel module, after checking it runs the way this test means it to; ``forward``: the
    statistics kernel to force (`triton_kernels.FORCED_FORWARD`; None: the device's own)."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported in this process
    from triton.runtime.interpreter import InterpretedFunction

    from stapo_megatron.ops import triton_kernels as kernels

    assert isinstance(kernels._shard_stats_kernel, InterpretedFunction) == (device == "cpu")
    kernels.FORCED_SHAPE = (BLOCK_V, 4)
    kernels.FORCED_FORWARD = forward
    return kernels


def _reference(logits, target, temperature, vocab_size):
    """Float64 full-vocabulary log p and H (masked -inf entries are 0 log 0 = 0), with the leaf."""
    x = logits.detach().cpu().double().requires_grad_()
    logp_all = torch.log_softmax(x[:, :vocab_size] / temperature, dim=-1)
    finite = torch.isfinite(logp_all)
    safe_logp = torch.where(finite, logp_all, 0.0)
    entropy = -(safe_logp.exp() * safe_logp * finite).sum(-1)
    return x, logp_all.gather(-1, target.cpu().unsqueeze(-1)).squeeze(-1), entropy


def _inputs(dtype, vocab_local, vocab_size, num_rows=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_rows, vocab_local, generator=gen) * 3).to(dtype)
    target = torch.randint(0, vocab_size, (num_rows,), generator=gen)
    target[0] = logits[0, :vocab_size].float().argmax()  # p -> 1: where the gradient could cancel
    logits[1, 7:120] = float("-inf")  # masked vocabulary
    target[1] = 3
    upstream = torch.randn(2, num_rows, generator=gen)
    return logits, target, upstream


def _fwd_bwd(logits, target, upstream, impl, entropy_grad, inplace, **kw):
    x = logits.clone().requires_grad_()
    lp, h = vocab_parallel_logprob_entropy(
        x, target, impl=impl, entropy_grad=entropy_grad, inplace_backward=inplace, **kw
    )
    loss = (lp * upstream[0]).sum() + ((h * upstream[1]).sum() if entropy_grad else 0)
    loss.backward()
    if not inplace:
        assert torch.equal(x.detach(), logits), f"{impl}: the input must be left intact"
    return lp.detach(), h.detach(), x.grad, x.grad.data_ptr() == x.data_ptr()


def _tp_worker(device, dtype, entropy_grad):
    """One TP rank: the kernels and the torch path on this rank's shard, collectives counted."""
    import torch.distributed as dist

    _kernels(device)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab_local, vocab_size = 150, 290  # rank 1 holds 140 real entries and 10 of padding
    logits, target, upstream = _inputs(dtype, vocab_local * world, vocab_size, seed=1)
    logits[2, vocab_local:] = float("-inf")  # row 2: rank 1's whole shard masked
    target[2] = 5
    shard = logits[:, rank * vocab_local : (rank + 1) * vocab_local].to(device)
    calls = []
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(k.get("op")) or all_reduce(*a, **k)
    out = {}
    for impl in ("triton", "torch"):
        calls.clear()
        lp, h, grad, _ = _fwd_bwd(
            shard, target.to(device), upstream.to(device), impl, entropy_grad, False,
            tp_group=dist.group.WORLD, vocab_size=vocab_size,
        )
        out[impl] = (lp.cpu(), h.cpu(), grad.cpu(), len(calls))
        calls.clear()
        with torch.no_grad():  # the collision sum rides the same two collectives
            *_, collision = vocab_parallel_logprob_entropy(
                shard, target.to(device), tp_group=dist.group.WORLD, vocab_size=vocab_size, impl=impl,
                with_collision=True)
        out[impl] += (collision.cpu(), len(calls))
    dist.all_reduce = all_reduce
    return out, logits, target, upstream
