"""Benchmark: fused vocab-parallel log-prob + entropy vs Megatron-Core's vocab_parallel_cross_entropy.

Forward+backward time and peak extra memory of ``stapo_megatron.ops.vocab_parallel_logprob_entropy``
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

N_TOKENS, VOCAB = 2048, 151936


def _setup(tp_size: int):
    from megatron.core import parallel_state

    from stapo_megatron import cpu_compat

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
    from stapo_megatron.ops import vocab_parallel_logprob_entropy

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=["time", "mem"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--impl", default="ours")
    args = parser.parse_args()
    if args.worker:
        args.what = args.worker
        return _worker_main(args)
    if "jemalloc" not in os.environ.get("LD_PRELOAD", ""):
        print("warning: not running under jemalloc; timings will be dominated by page faults")
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
