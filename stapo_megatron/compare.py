"""Method comparison at CPU scale: stapo vs the other methods of `methods.METHODS`, several seeds each.

    nemo-run launch/compare_tiny.py --yes                                    # = make compare
    .venv/bin/python -m stapo_megatron.compare --out runs/compare            # the same, without NeMo-Run
    .venv/bin/python -m stapo_megatron.compare --out runs/compare --summarize-only

For every seed, one supervised warm-start (``tiny_compare``'s WarmStartConfig) is trained once and
saved; the methods then start RL from the same warm-started weights with the same seed, so a
seed pairs the methods (same initial policy, same prompt order, same sampler seeds until the
policies diverge). Every run is its own ``torchrun`` job (2 processes, DP=2) and leaves a run
directory ``<out>/<method>_seed<k>/`` with the trainer's usual outputs; a run whose metrics
already reach the last step is skipped, so an interrupted comparison continues where it stopped.

``summarize`` writes ``<out>/summary.md`` (mean +- std over seeds of the final held-out accuracy,
the accuracy gain over the warm-start, the final entropy, the silenced fraction; Welch and paired
t-tests of stapo against each baseline) and ``<out>/curves.png`` (held-out accuracy gain over
each seed's warm-start, entropy and train reward per step, mean over seeds with a min-max band
per method).
"""


import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Sequence

from stapo_megatron.methods import METHODS


# -- the worker (one torchrun job) --------------------------------------------------------------


def _worker(args) -> None:
    """Inside torchrun: a warm-start job (``--warm-start``) or one RL run."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from stapo_megatron.recipes.tiny import tiny_compare
    from stapo_megatron.trainer import train

    cfg, warmstart = tiny_compare(run_dir=args.run_dir, method=args.method, seed=args.seed, steps=args.steps)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_dir=args.model_dir))
    if args.warm_start:
        # warm-start only: no RL steps, no eval, no checkpoint; the weights go to --init
        cfg = dataclasses.replace(cfg, steps=0, eval_every=0, save_every=0)
        train(cfg, dataclasses.replace(warmstart, save_to=args.init))
    else:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, megatron_ckpt=args.init))
        train(cfg, None)


# -- the driver ---------------------------------------------------------------------------------


def _read_rows(run_dir: str) -> List[Dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _finished(run_dir: str, steps: int) -> bool:
    return any(r.get("kind") == "eval" and r["step"] == steps for r in _read_rows(run_dir))


def _torchrun(nproc: int, worker_args: Sequence[str], log_path: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "stapo_megatron.compare", "--worker", *worker_args]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    with open(log_path, "a") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"job failed (exit {proc.returncode}): {' '.join(worker_args)}; log: {log_path}")


def run_comparison(out: str, seeds: Sequence[int], methods: Sequence[str], steps: int, nproc: int = 2) -> None:
    """Warm-start once per seed, then every (method, seed) RL run; skips finished work."""
    from stapo_megatron.recipes.tiny import prepare_tiny_model

    os.makedirs(out, exist_ok=True)
    model_dir = os.path.join(out, "model")
    prepare_tiny_model(model_dir)
    t_start = time.time()
    jobs = [(m, s) for s in seeds for m in methods]
    for seed in seeds:
        init = os.path.join(out, f"warmstart_seed{seed}")
        if os.path.exists(init):
            continue
        print(f"[compare] warm-start seed {seed}", flush=True)
        t0 = time.time()
        _torchrun(nproc, ["--warm-start", "--seed", str(seed), "--init", init, "--model-dir", model_dir,
                          "--run-dir", os.path.join(out, f".warmstart_seed{seed}_run"), "--steps", str(steps)],
                  os.path.join(out, f"warmstart_seed{seed}.log"))
        print(f"[compare] warm-start seed {seed} done in {time.time() - t0:.0f}s", flush=True)
    for k, (method, seed) in enumerate(jobs):
        run_dir = os.path.join(out, f"{method}_seed{seed}")
        if _finished(run_dir, steps):
            print(f"[compare] {method} seed {seed}: finished earlier, skipped", flush=True)
            continue
        if os.path.exists(run_dir):
            # an interrupted run (no checkpoints) restarts from scratch: its metrics.jsonl would
            # otherwise collect the rows of both attempts
            print(f"[compare] {method} seed {seed}: unfinished run from earlier, restarting", flush=True)
            shutil.rmtree(run_dir)
        t0 = time.time()
        print(f"[compare] run {k + 1}/{len(jobs)}: {method} seed {seed}", flush=True)
        _torchrun(nproc, ["--method", method, "--seed", str(seed), "--init", os.path.join(out, f"warmstart_seed{seed}"),
                          "--model-dir", model_dir, "--run-dir", run_dir, "--steps", str(steps)],
                  os.path.join(run_dir + ".log"))
        rows = _read_rows(run_dir)
        evals = [r["eval_accuracy"] for r in rows if r.get("kind") == "eval"]
        print(f"[compare] {method} seed {seed}: held-out accuracy {evals[0]:.3f} -> {evals[-1]:.3f} "
              f"({time.time() - t0:.0f}s; {time.time() - t_start:.0f}s so far)", flush=True)


# -- statistics and the summary -----------------------------------------------------------------


def _mean_std(xs: Sequence[float]):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return mean, std


def _tests(a: Sequence[float], b: Sequence[float]):
    """(Welch t-test p, paired t-test p) of a vs b, two-sided; NaN where undefined."""
    from scipy import stats

    welch = stats.ttest_ind(a, b, equal_var=False).pvalue if len(a) > 1 and len(b) > 1 else math.nan
    paired = stats.ttest_rel(a, b).pvalue if len(a) == len(b) and len(a) > 1 else math.nan
    return float(welch), float(paired)


def _run_summary(rows: List[Dict]) -> Dict[str, float]:
    evals = [r for r in rows if r.get("kind") == "eval"]
    train = [r for r in rows if r.get("kind") == "train"]
    tail = train[-5:]
    silenced = sum(r["silenced_count"] for r in train)
    return dict(
        acc0=evals[0]["eval_accuracy"], acc=evals[-1]["eval_accuracy"],
        gain=evals[-1]["eval_accuracy"] - evals[0]["eval_accuracy"],
        entropy=sum(r["entropy_mean"] for r in tail) / len(tail),
        silenced_fraction=sum(r["silenced_fraction"] for r in train) / len(train),
        silenced_total=silenced, steps_with_silencing=sum(r["silenced_count"] > 0 for r in train),
        reward=sum(r["reward_mean"] for r in tail) / len(tail),
    )


def summarize(out: str, seeds: Sequence[int], methods: Sequence[str] = tuple(METHODS)) -> str:
    """Write ``summary.md`` and ``curves.png`` from the finished runs; returns the markdown."""
    runs = {}
    for m in methods:
        for s in seeds:
            rows = _read_rows(os.path.join(out, f"{m}_seed{s}"))
            if any(r.get("kind") == "eval" for r in rows) and any(r.get("kind") == "train" for r in rows):
                runs[m, s] = rows
    if not runs:
        raise FileNotFoundError(f"no finished runs under {out}")
    per = {(m, s): _run_summary(rows) for (m, s), rows in runs.items()}
    lines = [
        "# Method comparison (tiny Qwen3, reasoning-gym sums, CPU)", "",
        f"Seeds {list(seeds)}; each seed's four runs start from the same warm-start. Final = the last "
        "held-out evaluation (greedy, 100 prompts); entropy = mean token entropy of the last 5 steps; "
        "silenced = mean fraction of response tokens silenced per step. mean +- std over seeds.", "",
        "| method | runs | held-out acc. start | final held-out acc. | gain | final entropy | silenced fraction | silenced tokens per run | final train reward |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    fmt = lambda xs, d=3: "{:.{d}f} +- {:.{d}f}".format(*_mean_std(xs), d=d)  # noqa: E731
    for m in methods:
        vals = [per[m, s] for s in seeds if (m, s) in per]
        if not vals:
            continue
        col = lambda key: [v[key] for v in vals]  # noqa: E731
        lines.append(
            f"| {m} | {len(vals)} | {fmt(col('acc0'))} | {fmt(col('acc'))} | {fmt(col('gain'))} | "
            f"{fmt(col('entropy'))} | {fmt(col('silenced_fraction'), 5)} | {fmt(col('silenced_total'), 1)} | "
            f"{fmt(col('reward'))} |"
        )
    lines += ["", "Significance of stapo vs each baseline (two-sided; Welch = unpaired, paired = by seed):", "",
              "| baseline | metric | stapo mean | baseline mean | difference | Welch p | paired p |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for b in [m for m in methods if m != "stapo"]:
        common = [s for s in seeds if ("stapo", s) in per and (b, s) in per]
        for key, name in (("acc", "final accuracy"), ("entropy", "final entropy")):
            a_vals = [per["stapo", s][key] for s in common]
            b_vals = [per[b, s][key] for s in common]
            if len(common) < 2:
                continue
            welch, paired = _tests(a_vals, b_vals)
            ma, mb = _mean_std(a_vals)[0], _mean_std(b_vals)[0]
            lines.append(f"| {b} | {name} | {ma:.3f} | {mb:.3f} | {ma - mb:+.3f} | {welch:.3f} | {paired:.3f} |")
    lines += ["", "Per run:", "", "| method | seed | start acc. | final acc. | final entropy | silenced tokens | steps with silencing |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for (m, s), v in sorted(per.items()):
        lines.append(f"| {m} | {s} | {v['acc0']:.3f} | {v['acc']:.3f} | {v['entropy']:.3f} | {v['silenced_total']} | "
                     f"{v['steps_with_silencing']} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    _plot(out, runs, methods, seeds)
    return text


def _plot(out: str, runs, methods, seeds) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    # accuracy as the gain over each seed's own warm-start: the warm-starts differ more between
    # seeds than the methods do, and a band of raw accuracies would only show that
    panels = (("eval", "eval_accuracy", "held-out acc. gain over step 0"),
              ("train", "entropy_mean", "token entropy"), ("train", "reward_mean", "train reward"))
    styles = ("-", "--", "-.", ":")
    for ax, (kind, key, title) in zip(axes, panels):
        for style, m in zip(styles * len(methods), methods):
            curves = [[(r["step"], r[key]) for r in runs[m, s] if r.get("kind") == kind]
                      for s in seeds if (m, s) in runs]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            steps = np.array([p[0] for p in curves[0][:n]])
            ys = np.array([[p[1] for p in c[:n]] for c in curves], dtype=float)
            if kind == "eval":
                ys = ys - ys[:, :1]
            line, = ax.plot(steps, ys.mean(0), style, lw=1.8, label=f"{m} (n={len(curves)})")
            ax.fill_between(steps, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2)
        ax.set_title(f"{title}\n(mean over seeds, band = min-max)", fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "curves.png"), dpi=110)
    plt.close(fig)


def compare_tiny(output_dir: str = "runs/compare", seeds: List[int] = [0, 1, 2],  # noqa: B006
                 methods: List[str] = list(METHODS), steps: int = 0, nproc: int = 2) -> str:  # noqa: B006
    """The whole comparison (runs, then summary); the NeMo-Run task of ``launch/compare_tiny.py``.

    ``steps`` = 0 takes the recipe's (``tiny_compare``). Plain types only: NeMo-Run's CLI
    parses ``key=value`` by annotation and does not take Optional/Sequence.
    """
    from stapo_megatron.recipes.tiny import tiny_compare

    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ValueError(f"unknown methods {bad}; choose from {tuple(METHODS)}")
    steps = steps or tiny_compare()[0].steps
    run_comparison(output_dir, list(seeds), list(methods), steps, nproc)
    text = summarize(output_dir, list(seeds), list(methods))
    print(text, flush=True)
    return text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/compare", help="output folder (runs, summary.md, curves.png)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the recipe's)")
    p.add_argument("--nproc", type=int, default=2, help="processes per run (DP)")
    p.add_argument("--summarize-only", action="store_true")
    # worker mode (inside torchrun)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--warm-start", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", default="stapo", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--init", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps is None:
        from stapo_megatron.recipes.tiny import tiny_compare

        args.steps = tiny_compare()[0].steps
    if args.worker:
        return _worker(args)
    if not args.summarize_only:
        run_comparison(args.out, args.seeds, args.methods, args.steps, args.nproc)
    print(summarize(args.out, args.seeds, args.methods))


if __name__ == "__main__":
    main()
