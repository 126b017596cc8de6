"""Benchmark: fused vocab-parallel log-prob + entropy vs Megatron-Core's vocab_parallel_cross_entropy.

Two suites. ``--device cpu`` (the default, `make bench`) is described first; ``--device cuda`` at
the end.

Forward+backward time and peak extra memory of ``stapo_megatron.ops.logprob_entropy.vocab_parallel_logprob_entropy``
(log-prob AND entropy, input left intact) against Megatron-Core's ``vocab_parallel_cross_entropy``
(log-prob only; overwrites its input in place) on the same logits: N=2048 tokens, Qwen vocabulary
151936, fp32 and bf16, TP=1 and TP=2 (gloo, one process per rank).

Timing: both sides interleaved in one process, medians of per-pair ratios. Run under jemalloc so
that both sides are timed on compute, not on first-touch page faults (as a GPU caching allocator
would); `make bench` does this:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \
    MALLOC_CONF="retain:true,dirty_decay_ms:-1,muzzy_decay_ms:-1" \
    .venv/bin/python benchmarks/bench_logprob_entropy.py

Memory: each side runs once in a fresh subprocess; with jemalloc's retain the process high-water
mark (ru_maxrss) minus the resident logits, target and returned gradient is the extra memory the
op needed, reported as a fraction of the logits shard.

``--device cuda`` (one GPU, TP=1, bf16 logits [N, 151936], N = 4096 and 16384): forward+backward
of sum(w * logprob) and the no-grad forward of

    op triton / op triton in-place   this op's Triton kernels (``inplace_backward=True``: the
                                     gradient is written over the logits)
    op torch                         this op's torch path
    Megatron CE                      megatron.core vocab_parallel_cross_entropy (log-prob only)
    Megatron CE + entropy            the same plus a no-grad torch entropy (what a caller needing H
                                     would add)
    torch log_softmax                log_softmax(x.float()) and gather
    Liger CE                         liger_kernel's Triton cross entropy, reduction="sum" (log-prob
                                     only, unweighted: its per-token weights would cost an extra
                                     pass); benchmark-only, skipped when liger_kernel is absent
    HBM copy                         a device-to-device copy of the logits (1 read + 1 write),
                                     measured in the same run: the bound is 1.5x its time for
                                     forward+backward (forward read, backward read + write) and
                                     0.5x for the no-grad forward (one read)

Times are medians of CUDA-event timings (2 warm-up calls first: Triton compiles on the first).
Every call gets a fresh copy of the logits made outside the timed region (Megatron, Liger and the
in-place backward write into their input). Extra peak memory = torch.cuda.max_memory_allocated
during the call minus what was allocated before it (logits and target), as a fraction of the
logits, once including the returned gradient and once without it when it is a separate buffer.
``--tune`` also sweeps the kernels' block size and warps at the first N. ``--smoke`` runs the cuda
suite on the CPU at tiny sizes to check its code (set TRITON_INTERPRET=1 to include the Triton
rows); its timings mean nothing.

    source .whl/gpu-env.sh && python3 benchmarks/bench_logprob_entropy.py --device cuda [--tune]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from malloc_check import check_jemalloc  # benchmarks/, the script's folder

N_TOKENS, VOCAB = 2048, 151936


def _setup(tp_size: int):
    from megatron.core import parallel_state

    from stapo_megatron.mcore import cpu_compat

    cpu_compat.apply()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    return parallel_state.get_tensor_model_parallel_group()


def _inputs(dtype, tp_size, rank):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(N_TOKENS, VOCAB, generator=gen) * 2).to(dtype)
    target = torch.randint(0, VOCAB, (N_TOKENS,), generator=gen)
    shard = VOCAB // tp_size
    return logits[:, rank * shard : (rank + 1) * shard].contiguous(), target


def _run_ours(logits, target, group):
    from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy

    x = logits.detach().requires_grad_()
    logprob, entropy = vocab_parallel_logprob_entropy(x, target, tp_group=group)
    logprob.sum().backward()
    return x.grad


def _run_megatron(logits, target, group):
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    # Megatron overwrites its input; it is given a fresh buffer each call (copied outside the
    # timed region) so both sides see identical logits.
    x = logits.requires_grad_()
    loss = vocab_parallel_cross_entropy(x, target)  # uses parallel_state's TP group
    loss.sum().backward()
    return x.grad


def time_pairs(dtype, tp_size, reps):
    group = _setup(tp_size)
    rank = dist.get_rank()
    logits, target = _inputs(dtype, tp_size, rank)
    scratch = torch.empty_like(logits)
    ours_s, meg_s = [], []
    for i in range(reps + 1):  # first pair is warm-up
        dist.barrier()
        t0 = time.perf_counter()
        _run_ours(logits, target, group)
        t1 = time.perf_counter()
        scratch.copy_(logits)
        dist.barrier()
        t2 = time.perf_counter()
        _run_megatron(scratch.detach(), target, group)
        t3 = time.perf_counter()
        if i:
            ours_s.append(t1 - t0)
            meg_s.append(t3 - t2)
    ratios = [o / m for o, m in zip(ours_s, meg_s)]
    return dict(
        ours_s=statistics.median(ours_s),
        megatron_s=statistics.median(meg_s),
        ratio=statistics.median(ratios),
    )


def peak_memory(impl, dtype, tp_size):
    group = _setup(tp_size)
    rank = dist.get_rank()
    logits, target = _inputs(dtype, tp_size, rank)
    grad = torch.empty_like(logits)  # touch what the returned gradient will occupy
    grad.fill_(0)
    del grad
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Warm the allocator with a small call so library setup does not count.
    fn = _run_ours if impl == "ours" else _run_megatron
    fn(logits[:8].clone(), target[:8], group)
    base_kb = max(base_kb, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    # Megatron overwrites its input: that is its normal use, so no copy is charged to it.
    fn(logits, target, group)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    shard_bytes = logits.numel() * logits.element_size()
    return dict(extra_fraction=(peak_kb - base_kb) * 1024 / shard_bytes)


def _worker_main(args):
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.tp))
    if args.what == "time":
        out = time_pairs(dtype, args.tp, args.reps)
    else:
        out = peak_memory(args.impl, dtype, args.tp)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def _launch(what, dtype, tp, reps=5, impl="ours"):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={tp}",
        "--master-port", str(29600 + tp), __file__, "--worker", what,
        "--dtype", dtype, "--tp", str(tp), "--reps", str(reps), "--impl", impl,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"benchmark worker failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")


# ---- the --device cuda suite ------------------------------------------------------------------

GPU_TOKENS = (4096, 16384)
TUNE_SHAPES = [  # (block, warps) for forward and backward alike
    (1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 8), (8192, 16), (16384, 16), (16384, 32),
]


def _gpu_setup(device):
    """One rank; Megatron CE needs its parallel_state (TP=1) initialised."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        from megatron.core import parallel_state
    except ImportError:
        return False
    if device.type != "cuda":
        from stapo_megatron.mcore import cpu_compat

        cpu_compat.apply()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    return True


def _gpu_methods(has_megatron, with_triton):
    from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy

    def ours(impl, inplace=False):
        def run(x, target, w, grad):
            logprob, _ = vocab_parallel_logprob_entropy(x, target, impl=impl, inplace_backward=inplace)
            if grad:
                (logprob * w).sum().backward()

        return run

    def megatron_ce(with_entropy):
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

        def run(x, target, w, grad):
            if with_entropy:  # before the CE: Megatron overwrites fp32 inputs
                with torch.no_grad():
                    logp = torch.log_softmax(x.float(), dim=-1)
                    (logp.exp() * logp).sum(-1)
                    del logp
            loss = vocab_parallel_cross_entropy(x, target)
            if grad:
                (loss * w).sum().backward()

        return run

    def torch_log_softmax(x, target, w, grad):
        logprob = torch.log_softmax(x.float(), dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
        if grad:
            (logprob * w).sum().backward()

    methods = {}
    if with_triton:
        methods["op triton"] = ours("triton")
        methods["op triton in-place"] = ours("triton", inplace=True)
    methods["op torch"] = ours("torch")
    if has_megatron:
        methods["Megatron CE"] = megatron_ce(False)
        methods["Megatron CE + entropy"] = megatron_ce(True)
    methods["torch log_softmax"] = torch_log_softmax
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
    except ImportError:
        print("liger_kernel not installed: no Liger row")
    else:
        def liger(x, target, w, grad):
            loss = liger_cross_entropy(x, target, reduction="sum")
            if grad:
                loss.backward()

        if with_triton:
            methods["Liger CE"] = liger
    return methods


def _elapsed_ms(device, fn):
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _measure(method, logits, target, w, grad, reps):
    """(median ms, extra peak / logits incl. the gradient, same without a separate gradient)."""
    device = logits.device
    times = []
    for i in range(reps + 2):  # two warm-ups: Triton compiles on the first call
        x = logits.clone().requires_grad_(grad)  # fresh: several methods write into their input
        with torch.set_grad_enabled(grad):
            ms = _elapsed_ms(device, lambda: method(x, target, w, grad))
        if i >= 2:
            times.append(ms)
        del x
    x = logits.clone().requires_grad_(grad)
    if device.type != "cuda":
        with torch.set_grad_enabled(grad):
            method(x, target, w, grad)
        return statistics.median(times), float("nan"), float("nan")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.set_grad_enabled(grad):
        method(x, target, w, grad)
    torch.cuda.synchronize(device)
    extra = torch.cuda.max_memory_allocated(device) - base
    grad_bytes = 0
    if x.grad is not None and x.grad.data_ptr() != x.data_ptr():
        grad_bytes = x.grad.numel() * x.grad.element_size()
    logits_bytes = logits.numel() * logits.element_size()
    return statistics.median(times), extra / logits_bytes, (extra - grad_bytes) / logits_bytes


def _copy_ms(logits, reps):
    out = torch.empty_like(logits)
    times = [_elapsed_ms(logits.device, lambda: out.copy_(logits)) for _ in range(reps + 2)][2:]
    return statistics.median(times)


def _gpu_inputs(num_tokens, vocab, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(num_tokens, vocab, generator=gen, device=device, dtype=dtype).mul_(2)
    target = torch.randint(0, vocab, (num_tokens,), generator=gen, device=device)
    w = torch.randn(num_tokens, generator=gen, device=device)
    return logits, target, w


def gpu_suite(device, tokens, vocab, dtype, reps, tune):
    has_megatron = _gpu_setup(device)
    with_triton = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    methods = _gpu_methods(has_megatron, with_triton)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run)"
    print(f"device: {name}; date: {time.strftime('%Y-%m-%d')}; torch {torch.__version__}; {dtype}; V = {vocab}")
    print(
        "| N | method | fwd+bwd (ms) | / bound | extra peak / logits | without the gradient "
        "| no-grad fwd (ms) | / bound | no-grad extra peak / logits |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for num_tokens in tokens:
        logits, target, w = _gpu_inputs(num_tokens, vocab, dtype, device)
        copy_ms = _copy_ms(logits, reps)
        gbps = 2 * logits.numel() * logits.element_size() / copy_ms / 1e6
        print(
            f"| {num_tokens} | HBM copy ({gbps:.0f} GB/s) | bound {1.5 * copy_ms:.2f} | 1.00 | 0 | 0 "
            f"| bound {0.5 * copy_ms:.2f} | 1.00 | 0 |",
            flush=True,
        )
        for label, method in methods.items():
            t, mem, mem_no_grad = _measure(method, logits, target, w, True, reps)
            t0, mem0, _ = _measure(method, logits, target, w, False, reps)
            print(
                f"| {num_tokens} | {label} | {t:.2f} | {t / (1.5 * copy_ms):.2f} | {mem:.3f} | {mem_no_grad:.3f} "
                f"| {t0:.2f} | {t0 / (0.5 * copy_ms):.2f} | {mem0:.3f} |",
                flush=True,
            )
        if tune and with_triton and num_tokens == tokens[0]:
            _tune(logits, target, w, reps, methods["op triton"], copy_ms)
        del logits, target, w
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _tune(logits, target, w, reps, method, copy_ms):
    from stapo_megatron.ops import triton_kernels as kernels

    name = torch.cuda.get_device_name(logits.device) if logits.is_cuda else ""
    print(f"the table's shapes for {name!r} (with a gradient, without): {kernels.launch_shapes(name)}")
    print(f"tuning at N = {logits.shape[0]}: | forward | block | warps | no-grad fwd (ms) | / bound | fwd+bwd (ms) "
          "| / bound |")
    for forward in kernels.FORWARD_VARIANTS:  # both statistics kernels (triton_kernels' docstring)
        kernels.FORCED_FORWARD = forward
        for block, warps in TUNE_SHAPES:
            kernels.FORCED_SHAPE = block, warps
            t0 = _measure(method, logits, target, w, False, reps)[0]
            t = _measure(method, logits, target, w, True, reps)[0]
            print(
                f"| {forward} | {block} | {warps} | {t0:.2f} | {t0 / (0.5 * copy_ms):.2f} | {t:.2f} "
                f"| {t / (1.5 * copy_ms):.2f} |",
                flush=True,
            )
    kernels.FORCED_SHAPE = kernels.FORCED_FORWARD = None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--smoke", action="store_true", help="the cuda suite on the CPU at tiny sizes (code check)")
    parser.add_argument("--tune", action="store_true", help="cuda suite: also sweep the kernels' block/warps")
    parser.add_argument("--tokens", type=int, nargs="+", help="cuda suite: N values (default 4096 16384)")
    parser.add_argument("--worker", choices=["time", "mem"])
    parser.add_argument("--dtype", default=None, help="cpu suite: worker dtype; cuda suite: logits dtype (bfloat16)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (cpu 7, cuda 10)")
    parser.add_argument("--impl", default="ours")
    args = parser.parse_args()
    if args.device == "cuda" or args.smoke:
        device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
        tokens = args.tokens or ((64, 96) if args.smoke else GPU_TOKENS)
        vocab = 1000 if args.smoke else VOCAB
        dtype = getattr(torch, args.dtype or "bfloat16")
        gpu_suite(device, tokens, vocab, dtype, args.reps or (2 if args.smoke else 10), args.tune)
        dist.destroy_process_group()
        return
    args.dtype = args.dtype or "float32"
    args.reps = args.reps or 7
    if args.worker:
        args.what = args.worker
        return _worker_main(args)
    check_jemalloc()  # the workers inherit this process's environment
    rows = []
    for tp in (1, 2):
        for dtype in ("float32", "bfloat16"):
            t = _launch("time", dtype, tp, reps=args.reps)
            m_ours = _launch("mem", dtype, tp, impl="ours")
            m_meg = _launch("mem", dtype, tp, impl="megatron")
            row = (
                f"| {tp} | {dtype} | {t['ours_s']:.3f} | {t['megatron_s']:.3f} | {t['ratio']:.2f}x "
                f"| {m_ours['extra_fraction']:.3f} | {m_meg['extra_fraction']:.3f} |"
            )
            print(row, flush=True)
            rows.append(row)
    header = (
        "| TP | dtype | ours fwd+bwd (s) | Megatron CE fwd+bwd (s) | time ratio (median of pairs) "
        "| ours extra peak / shard | Megatron extra peak / shard |\n"
        "| --- | --- | --- | --- | --- | --- | --- |"
    )
    print(header)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
