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
from tests.helpers.triton_parity import (DEVICES, GRAD_ATOL, GRAD_RTOL, PATH_GRAD_ATOL, VALUE_TOL, _fwd_bwd, _inputs,
                                         _kernels, _reference)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


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
        kernels.FORCED_FORWARD = None


def check_matches_torch_path(device, dtype, temperature, vocab_size, entropy_grad, inplace, forward=None):
    _kernels(device, forward)
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


def check_lane_maxima(device, forward):
    """What an online maximum (per block, or per lane: ``forward``) must get right, against float64 with rows of
    1,000 entries in blocks of 64 (16 blocks): every entry a new lane maximum (ascending), none
    after the first block (descending), one lane -inf in every block (masked), a lane whose
    entries are all -inf but one late finite entry, all entries equal, and logits of 40 at
    T = 0.5 (z up to ~200: the tolerance adds 4 ulps of fp32 at 256, the rounding of z itself).
    Sharded (partials), each row split in two shards of 500 combined by ``combine``."""
    _kernels(device, forward)
    vocab = 1000
    ramp = torch.linspace(-6.0, 6.0, vocab)
    gen = torch.Generator().manual_seed(3)
    rows = [ramp, ramp.flip(0), torch.randn(vocab, generator=gen) * 3, torch.full((vocab,), 1.5),
            torch.randn(vocab, generator=gen) * 40]
    masked = torch.randn(vocab, generator=gen) * 3
    masked[5::64] = float("-inf")  # one lane of every block
    late = torch.randn(vocab, generator=gen) * 3
    late[7::64] = float("-inf")
    late[7 + 64 * 14] = 9.0  # that lane's only finite entry, and the row's maximum, in block 14
    logits = torch.stack(rows + [masked, late])
    target = torch.tensor([vocab - 1, 0, 17, 3, 500, 6, 7 + 64 * 14])
    tol = VALUE_TOL + 4 * 2**-24 * 256
    x = logits.double() / 0.5
    logp_all = torch.log_softmax(x, -1)
    p_all = logp_all.exp()
    ref = (logp_all.gather(-1, target[:, None])[:, 0], -(p_all * logp_all.nan_to_num(0.0, 0.0, 0.0)).sum(-1),
           p_all.square().sum(-1))
    lp, h, collision = vocab_parallel_logprob_entropy(logits.to(device), target.to(device), impl="triton",
                                                      temperature=0.5, with_collision=True)
    for got, want in zip((lp, h, collision), ref):
        torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=0)
    from stapo_megatron.ops import combine
    from stapo_megatron.ops import triton_kernels as kernels

    shards = [kernels.shard_stats(logits[:, r * 500:(r + 1) * 500].contiguous().to(device), target.to(device),
                                  r * 500, 500, 1 / 0.5, finalize=False, with_grad=False) for r in (0, 1)]
    global_m = torch.maximum(shards[0][0], shards[1][0])
    packed = sum(combine.packed_partials(m, global_m, s_, w, z, q) for m, s_, w, z, q in shards)
    _, lp2, h2, collision2 = combine.normalise(global_m, packed[0], packed[1], packed[2], packed[3])
    for got, want in zip((lp2, h2, collision2), ref):
        torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("forward", ["block", "lane"])
def test_online_maxima(interpreter, device, forward):
    _run(device, interpreter, check_lane_maxima, forward)


def check_lane_forward_matches_torch_path(device, dtype, temperature, vocab_size):
    """The "lane" forward (no device runs it by default yet) against the torch path, as the default."""
    check_matches_torch_path(device, dtype, temperature, vocab_size, True, False, forward="lane")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lane_forward_matches_torch_path(interpreter, device, dtype):
    _run(device, interpreter, check_lane_forward_matches_torch_path, dtype, 0.7, 257)


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


def test_triton_impl_refuses_cpu_tensors_outside_the_interpreter():
    """In this (non-interpreted) process, impl='triton' on CPU tensors is a clear error."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this session runs Triton interpreted")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        vocab_parallel_logprob_entropy(torch.randn(2, 8), torch.zeros(2, dtype=torch.long), impl="triton")
