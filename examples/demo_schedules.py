"""The tiny demo in each rollout mode on one seed: the schedules table of docs/results.md and the
README's streaming line come from here.

    .venv/bin/python examples/demo_schedules.py                  # = make demo-schedules (~15 min on 2 cores)
    .venv/bin/python examples/demo_schedules.py --modes colocated streaming --no-publish

Each mode runs what its make target runs (NeMo-Run, torchrun, local processes), one after another,
into ``OUT/MODE``; a run that finished (its last evaluation logged) is not run again:

    colocated   nemo-run launch/stapo_tiny.py                   (make demo: 2 processes)
    separate    nemo-run launch/stapo_tiny_async.py             (make demo-async: k = 1, tis)
    streaming   nemo-run launch/stapo_tiny_async.py rollout.mode=streaming rollout.separate.max_staleness=2

Then it summarises each run's ``metrics.jsonl`` (``benchmarks/async_cpu.py``'s columns: held-out
accuracy at the first and last evaluation, tokens S2T silenced, the trainers' wait and the
engine's idle share, the oldest trained token) into docs/results.md between the
``demo-schedules`` markers and a line into README.md between the ``demo-stream`` markers, with the
machine and the commit the runs were made at.
"""

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import async_cpu  # noqa: E402  (benchmarks/: the runs' summary)
from demo_seeds import _finished, _rows, nemo_run  # noqa: E402

MODES = {
    "colocated": ["launch/stapo_tiny.py"],
    "separate": ["launch/stapo_tiny_async.py"],
    "streaming": ["launch/stapo_tiny_async.py", "rollout.mode=streaming", "rollout.separate.max_staleness=2"],
}
"""Each mode's launch file and overrides (the seed and the output folder are added)."""


def run_mode(mode: str, run_dir: str, seed: int, steps: int) -> None:
    """The mode's demo into ``run_dir`` (relative to the checkout), unless it finished there."""
    if _finished(os.path.join(ROOT, run_dir), steps):
        print(f"[demo-schedules] {mode}: {run_dir} finished, not run again", flush=True)
        return
    nemo_run([*MODES[mode], f"seed={seed}", f"output_dir={run_dir}"], f"demo-schedules {mode}")
    if not _finished(os.path.join(ROOT, run_dir), steps):
        raise RuntimeError(f"{mode}: {run_dir}/metrics.jsonl has no evaluation at step {steps}")


def oldest_token(run_dir: str) -> int:
    """The oldest trained token of the run, in policy versions (``token_age_max``, else ``staleness``)."""
    rows = [r for r in _rows(run_dir) if r["kind"] == "train"]
    return int(max(r.get("token_age_max", r.get("staleness", 0.0)) for r in rows))


def table(results) -> str:
    """One row per mode: ``results`` is [(mode, async_cpu.summarize(run), oldest token)]."""
    lines = ["| mode | held-out, RL step 0 | at the end | tokens silenced by S2T | trainers wait (median share "
             "of a step) | engine idle | oldest trained token (versions) | wall time |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode, s, oldest in results:
        lines.append(f"| {mode} | {s['first']:.3f} | {s['last']:.3f} | {s['silenced']} | "
                     f"{s['wait']:.0%} | {s['idle']:.0%} | {oldest} | {s['minutes']:.1f} min |")
    return "\n".join(lines)


def readme_line(results, stamp: str) -> str:
    """The README's streaming sentence: its held-out gain and silenced tokens against colocated."""
    by_mode = {mode: s for mode, s, _ in results}
    stream, colocated = by_mode["streaming"], by_mode.get("colocated")
    against = (f", against {colocated['first']:.3f} -> {colocated['last']:.3f} and {colocated['silenced']} "
               f"colocated on the same seed" if colocated else "")
    return (f"Streaming demo: held-out {stream['first']:.3f} -> {stream['last']:.3f}, "
            f"{stream['silenced']} tokens silenced{against}.\n{stamp} by `make demo-schedules`; all modes: "
            f"[docs/results.md](docs/results.md).")


def main():
    from stapo_megatron.recipes.tiny import tiny_demo
    from stapo_megatron.runlog.report import RESULTS_PAGE, fill_block, machine, runs_commit

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default="runs/demo-schedules")
    parser.add_argument("--no-publish", action="store_true", help="do not update docs/results.md and README.md")
    args = parser.parse_args()
    cfg, _ = tiny_demo()
    results = []
    for mode in args.modes:
        run_dir = os.path.join(args.out, mode)
        run_mode(mode, run_dir, args.seed, cfg.steps)
        path = os.path.join(ROOT, run_dir)
        results.append((mode, async_cpu.summarize(path), oldest_token(path)))
    commit = runs_commit(os.path.join(ROOT, args.out, mode) for mode in args.modes)
    stamp = f"Measured {datetime.date.today().isoformat()} on {machine()} at commit {commit}"
    text = (f"{stamp} by `examples/demo_schedules.py` (seed {args.seed}, {cfg.steps} RL steps; held-out "
            f"avg@{cfg.eval.samples} at T={cfg.eval.temperature:g}):\n\n{table(results)}\n")
    print(text)
    if not args.no_publish:
        fill_block(os.path.join(ROOT, RESULTS_PAGE), "demo-schedules", text)
        if "streaming" in args.modes:
            fill_block(os.path.join(ROOT, "README.md"), "demo-stream", readme_line(results, stamp))


if __name__ == "__main__":
    main()
