"""The op's Triton path (its kernels) equals its torch path (tiers a and b, and c on a GPU).

On a CPU machine the kernels run in Triton's interpreter, inside spawned processes that set
TRITON_INTERPRET=1 before triton is imported (Triton reads the flag when a kernel is decorated;
a separate process keeps it out of the rest of the test session). On a CUDA machine the same
checks also run natively in this process (marked gpu). Kernel blocks are set to 64 entries so
that rows of 300 span several blocks and end in a ragged one.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

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
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
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


def _kernels(device):
    """The kernel module, after checking it runs the way this test means it to."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported in this process
    from triton.runtime.interpreter import InterpretedFunction

    from stapo_megatron.ops import triton_kernels as kernels

    assert isinstance(kernels._shard_stats_kernel, InterpretedFunction) == (device == "cpu")
    kernels.FORCED_SHAPE = (BLOCK_V, 4)
    return kernels


@pytest.fixture(scope="module")
def interpreter():
    """One spawned worker for the interpreted checks; its TRITON_INTERPRET never reaches this process."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def _run(device, interpreter, check, *args):
    if device == "cpu":
        return interpreter.submit(check, device, *args).result()
    from stapo_megatron.ops import triton_kernels as kernels

    try:
        return check(device, *args)
    finally:  # the native module is shared with the rest of the session
        kernels.FORCED_SHAPE = None


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


def check_matches_torch_path(device, dtype, temperature, vocab_size, entropy_grad, inplace):
    _kernels(device)
    logits, target, upstream = _inputs(dtype, 300, vocab_size)
    logits, target, upstream = logits.to(device), target.to(device), upstream.to(device)
    kw = dict(temperature=temperature, vocab_size=vocab_size)
    lp, h, grad, reused = _fwd_bwd(logits, target, upstream, "triton", entropy_grad, inplace, **kw)
    lp_t, h_t, grad_t, _ = _fwd_bwd(logits, target, upstream, "torch", entropy_grad, inplace, **kw)
    assert reused == inplace
    assert lp.dtype == h.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(lp, lp_t, atol=VALUE_TOL, rtol=0)
    torch.testing.assert_close(h, h_t, atol=VALUE_TOL, rtol=0)
    torch.testing.assert_close(grad.float(), grad_t.float(), atol=PATH_GRAD_ATOL[dtype], rtol=0)
    x, ref_lp, ref_h = _reference(logits, target, temperature, vocab_size)
    torch.testing.assert_close(lp.cpu().double(), ref_lp, atol=VALUE_TOL, rtol=0)
    torch.testing.assert_close(h.cpu().double(), ref_h, atol=VALUE_TOL, rtol=0)
    upstream = upstream.cpu().double()
    ((ref_lp * upstream[0]).sum() + (ref_h * upstream[1]).sum() * entropy_grad).backward()
    assert not grad[:, vocab_size:].any(), "padded entries get no gradient"
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(
        grad.cpu().double()[:, :vocab_size], x.grad[:, :vocab_size], atol=GRAD_ATOL, rtol=GRAD_RTOL[dtype]
    )


CASES = [  # temperature, vocab_size (of a 300-entry shard), entropy_grad, inplace
    (1.0, 300, False, False),
    (0.7, 257, False, True),
    (1.3, 300, True, False),
    (0.7, 257, True, True),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature,vocab_size,entropy_grad,inplace", CASES)
def test_kernels_match_torch_path(interpreter, device, dtype, temperature, vocab_size, entropy_grad, inplace):
    _run(device, interpreter, check_matches_torch_path, dtype, temperature, vocab_size, entropy_grad, inplace)


def check_collision_matches_torch_path(device, dtype, temperature, vocab_size):
    """sum_v p_v^2 (TP = 1: the kernel finishes the row) equals the torch path's, and asking for it
    changes neither log p, H nor the gradient."""
    _kernels(device)
    logits, target, upstream = _inputs(dtype, 300, vocab_size)
    logits, target, upstream = logits.to(device), target.to(device), upstream.to(device)
    outs = {}
    for impl in ("triton", "torch"):
        x = logits.clone().requires_grad_()
        lp, h, collision = vocab_parallel_logprob_entropy(
            x, target, impl=impl, temperature=temperature, vocab_size=vocab_size, with_collision=True)
        (lp * upstream[0]).sum().backward()
        outs[impl] = lp.detach(), h, collision, x.grad
    lp, h, grad, _ = _fwd_bwd(logits, target, upstream, "triton", False, False, temperature=temperature,
                              vocab_size=vocab_size)
    assert torch.equal(lp, outs["triton"][0]) and torch.equal(h, outs["triton"][1])
    assert torch.equal(grad, outs["triton"][3])
    torch.testing.assert_close(outs["triton"][2], outs["torch"][2], atol=VALUE_TOL, rtol=0)
    probs = torch.softmax(logits[:, :vocab_size].cpu().double() / temperature, -1)
    torch.testing.assert_close(outs["triton"][2].cpu().double(), probs.square().sum(-1), atol=VALUE_TOL, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("temperature,vocab_size", [(1.0, 300), (0.7, 257)])
def test_collision_matches_torch_path(interpreter, device, dtype, temperature, vocab_size):
    _run(device, interpreter, check_collision_matches_torch_path, dtype, temperature, vocab_size)


def check_no_grad_and_edge_shapes(device):
    _kernels(device)
    logits, target, _ = _inputs(torch.bfloat16, 300, 300, num_rows=5)
    logits, target = logits.to(device), target.to(device)
    with torch.no_grad():
        lp, h = vocab_parallel_logprob_entropy(logits.requires_grad_(), target, impl="triton")
        lp_t, h_t = vocab_parallel_logprob_entropy(logits, target, impl="torch")
    torch.testing.assert_close(lp, lp_t, atol=VALUE_TOL, rtol=0)
    torch.testing.assert_close(h, h_t, atol=VALUE_TOL, rtol=0)
    # leading dims, a single row, no rows, a vocabulary smaller than one block, non-contiguous rows
    for x, t in [
        (logits.view(5, 1, 300), target.view(5, 1)),
        (logits[:1], target[:1]),
        (logits[:0], target[:0]),
        (logits[:, :10], target % 10),
        (logits.t().contiguous().t(), target),
    ]:
        out = vocab_parallel_logprob_entropy(x.detach(), t, impl="triton")
        ref = vocab_parallel_logprob_entropy(x.detach(), t, impl="torch")
        for a, b in zip(out, ref):
            assert a.shape == t.shape
            torch.testing.assert_close(a, b, atol=VALUE_TOL, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_and_edge_shapes(interpreter, device):
    _run(device, interpreter, check_no_grad_and_edge_shapes)


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


def test_triton_impl_refuses_cpu_tensors_outside_the_interpreter():
    """In this (non-interpreted) process, impl='triton' on CPU tensors is a clear error."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this session runs Triton interpreted")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        vocab_parallel_logprob_entropy(torch.randn(2, 8), torch.zeros(2, dtype=torch.long), impl="triton")
