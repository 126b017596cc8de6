"""Benchmark: what the collision sum sum_v p_v^2 (the per-token logit-gradient norm) costs
the fused log-prob/entropy op on the CPU.

Three implementations of ``vocab_parallel_logprob_entropy``'s forward+backward (sum of log p,
backward, input left intact; the loss's use) on the same logits, interleaved call by call in one
process so that the shared machine's load hits them alike:

    before      the op as it was at git revision ``--baseline`` (default: the commit before the
                collision sum), loaded from ``git show`` into a module of its own
    default     this tree's op without ``with_collision`` (schedule.py, sft.py, the reference pass)
    collision   this tree's op with ``with_collision=True`` (what loss_func calls)

Logits as in bench_logprob_entropy.py (N tokens x the Qwen vocabulary 151936, randn * 2, TP = 1;
N = 1024 by default to fit a shared machine's memory). Each round runs the three in a rotated
order; per round the ratios default/before, collision/before (the issue's goal: within 3% of the op
before the change) and collision/default (the marginal cost of the sum in this tree), each by the
wall clock and by the process's CPU time (suffix _cpu: blind to the time other jobs hold the
cores); reported: the median ratio over rounds, a distribution-free 95% interval of that median,
and the rounds' 10th-90th percentile spread, per dtype. Run under jemalloc, as `make bench` does:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \\
    MALLOC_CONF="retain:true,dirty_decay_ms:-1,muzzy_decay_ms:-1" \\
    .venv/bin/python benchmarks/bench_collision_cost.py [--rounds 15] [--tokens 1024] [--threads 1]

``--pieces`` also times the eager pieces of one chunk of the torch path (``chunk_pieces``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from malloc_check import check_jemalloc  # benchmarks/, the script's folder

VOCAB = 151936
BASELINE = "61dd801"
"""The last commit before the collision sum (branch gradnorm's base)."""


def _baseline_op(rev: str):
    """``vocab_parallel_logprob_entropy`` as it was at ``rev``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder in ("mcore", "train"):  # stapo_megatron/train was renamed mcore after the baseline
        shown = subprocess.run(["git", "show", f"{rev}:stapo_megatron/{folder}/ops.py"], cwd=root,
                               capture_output=True, text=True)
        if shown.returncode == 0:
            break
    else:
        raise ValueError(f"no stapo_megatron/{{mcore,train}}/ops.py at git revision {rev!r}: {shown.stderr.strip()}")
    source = shown.stdout
    path = os.path.join(tempfile.mkdtemp(), "ops_baseline.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("ops_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.vocab_parallel_logprob_entropy


def _timed(fn, logits, target, **kw):
    """(wall seconds, CPU seconds of this process) of one forward+backward."""
    x = logits.detach().requires_grad_()
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn(x, target, **kw)
    out[0].sum().backward()
    return time.perf_counter() - t0, time.process_time() - c0


def measure(dtype, num_tokens: int, rounds: int, baseline_rev: str):
    from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy as current

    before = _baseline_op(baseline_rev)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(num_tokens, VOCAB, generator=gen) * 2).to(dtype)
    target = torch.randint(0, VOCAB, (num_tokens,), generator=gen)
    runs = {"before": lambda: _timed(before, logits, target),
            "default": lambda: _timed(current, logits, target),
            "collision": lambda: _timed(current, logits, target, with_collision=True)}
    names = list(runs)
    for name in names:  # warm-up
        runs[name]()
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % 3:] + names[:r % 3]:  # rotate the order: no side is always first
            times[name].append(runs[name]())
    out = {"dtype": str(dtype).replace("torch.", ""), "tokens": num_tokens, "rounds": rounds}
    # Wall time, and the process's CPU time: on an oversubscribed machine the wall clock also counts
    # the time the scheduler gives to other jobs; CPU time does not (cache and memory contention stay).
    for clock, suffix in ((0, ""), (1, "_cpu")):
        for name in names:
            out[f"{name}_s_median{suffix}"] = statistics.median(t[clock] for t in times[name])
        out[f"collision_vs_default{suffix}"] = _ratio_stats(times["collision"], times["default"], clock)
        for name in ("default", "collision"):
            out[f"{name}_vs_before{suffix}"] = _ratio_stats(times[name], times["before"], clock)
    return out


def _ratio_stats(times, reference, clock):
    """Per-round ratios: median, a distribution-free 95% interval of the median, p10 and p90."""
    ratios = sorted(t[clock] / b[clock] for t, b in zip(times, reference))
    deciles = statistics.quantiles(ratios, n=10)
    # order statistics n/2 -+ 0.98 sqrt(n)
    k = max(0, int(len(ratios) / 2 - 0.98 * len(ratios) ** 0.5))
    return dict(median=statistics.median(ratios), median_ci95=[ratios[k], ratios[-1 - k]],
                p10=deciles[0], p90=deciles[-1])


def chunk_pieces(reps: int):
    """CPU microseconds of the eager pieces of one fp32 chunk of the torch path (``torch_path._local_stats``:
    rows_per_chunk rows of the vocabulary), interleaved rep by rep, median over reps: what the
    collision sum's extra reduction costs against the pass it rides on, and the alternatives."""
    from stapo_megatron.ops import torch_path

    rows = torch_path._rows_per_chunk(VOCAB, torch.device("cpu"))
    z = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    p, logp, scratch = torch.softmax(z, -1), torch.log_softmax(z, -1), torch.empty_like(z)
    pieces = {
        "exp (the chunk's exp before)": lambda: torch.exp(z, out=scratch),
        "softmax (the chunk's exp now)": lambda: torch.softmax(z, -1, out=scratch),
        "amax": lambda: z.amax(-1),
        "sub": lambda: torch.sub(z, z[:, :1], out=scratch),
        "vecdot(p, log p) (entropy)": lambda: torch.linalg.vecdot(p, logp),
        "vecdot(p, p) (collision)": lambda: torch.linalg.vecdot(p, p),
        "sum(p)": lambda: p.sum(-1),
        "vector_norm(p)": lambda: torch.linalg.vector_norm(p, dim=-1),
    }
    times = {name: [] for name in pieces}
    for _ in range(reps):
        for name, fn in pieces.items():
            t0 = time.thread_time()
            fn()
            times[name].append(time.thread_time() - t0)
    return {"chunk_rows": rows, **{f"{name}_us": round(1e6 * statistics.median(t), 1) for name, t in times.items()}}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the op before the change")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--pieces", action="store_true", help="also time the chunk body's eager pieces")
    args = parser.parse_args()
    if args.threads:  # on an oversubscribed machine one thread per call is the steadier measure
        torch.set_num_threads(args.threads)
    if args.rounds < 4:
        parser.error(f"--rounds must be >= 4 for a spread, got {args.rounds}")
    check_jemalloc()
    print(json.dumps({"threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                      "load_avg": os.getloadavg(), "python": sys.version.split()[0]}))
    if args.pieces:
        print(json.dumps(chunk_pieces(reps=20 * args.rounds)), flush=True)
    for name in filter(None, args.dtypes.split(",")):  # --dtypes "" with --pieces: the pieces only
        print(json.dumps(measure(getattr(torch, name), args.tokens, args.rounds, args.baseline)), flush=True)


if __name__ == "__main__":
    main()
