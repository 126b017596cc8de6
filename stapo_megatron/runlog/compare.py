"""Method comparison at CPU scale: stapo against the baselines, several seeds each.

    nemo-run launch/compare_tiny.py --yes                                    # = make compare
    .venv/bin/python -m stapo_megatron.runlog.compare --out runs/compare            # the same driver, without NeMo-Run
    .venv/bin/python -m stapo_megatron.runlog.compare --out runs/compare --summarize-only
    .venv/bin/python -m stapo_megatron.runlog.compare --methods stapo justrl --objectives cispo --out runs/compare-cispo

A run is a mask (the method) on an objective: ``--objectives`` runs every method on each named
objective (``stapo_megatron.method.objectives``: ``loss.objective=O`` and the objective's recipe
values, `objective_overrides`), so "S2T on CISPO vs CISPO" is the last line above; without it
each method runs on its own objective. Runs are ``<method>_seed<S>`` or ``<method>-<objective>_seed<S>``.

Every run is launched exactly as ``make demo`` is (``nemo-run launch/stapo_tiny.py method=M
seed=S output_dir=OUT/M_seedS <COMPARE_OVERRIDES> --yes``: NeMo-Run, torchrun, 2 processes), so
a comparison run and the demo differ only in those overrides (``recipes.tiny.tiny_compare``
builds the same config in Python). All runs start RL from the demo's one warm-start, trained by
the first run and loaded from ``OUT/.warmstart-cache`` by the others (`warmstart_cache`), and
the seed pairs the methods: for a seed every method sees the same initial policy, prompt order
and sampler seeds until the policies diverge. A run whose metrics reach the last step is skipped,
so an interrupted comparison continues where it stopped.

``summarize`` writes ``<out>/summary.md``: per method, mean +- std over seeds of the held-out
accuracy at the start and end, its gain, the final entropy and the tokens silenced; per baseline,
the paired t-test of stapo's gain against it, the effect size (Cohen's d_z of the paired
differences) and the smallest difference the run could detect (80% power, two-sided 5%); and
``<out>/curves.png`` (accuracy gain, entropy and train reward per step, mean over seeds with a
min-max band).
"""


import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from stapo_megatron.method.objectives import OBJECTIVES, get_objective
from stapo_megatron.method.registry import METHODS, get_method
from stapo_megatron.recipes.tiny import COMPARE_OVERRIDES
from stapo_megatron.runlog.report import RESULTS_PAGE, fill_block, machine, runs_commit

DEFAULT_METHODS = ("stapo", "justrl", "entropy20", "random")
"""The paper's main comparison: STAPO, its JustRL baseline, 20-Entropy and the random control."""
DEFAULT_SEEDS = (1, 2, 3, 4, 5)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH_FILE = os.path.join(ROOT, "launch", "stapo_tiny.py")


def _read_rows(run_dir: str) -> List[Dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _finished(run_dir: str, steps: int) -> bool:
    return any(r.get("kind") == "eval" and r["step"] == steps for r in _read_rows(run_dir))


def _overrides(steps: Optional[int]) -> Dict[str, int]:
    return {**COMPARE_OVERRIDES, **({"steps": steps} if steps else {})}


Arm = Tuple[str, Optional[str]]
"""One compared configuration: (method, objective; None = the method's own)."""


def arms(methods: Sequence[str], objectives: Optional[Sequence[str]] = None) -> List[Arm]:
    """Every method on every objective (objective by objective), or on its own without ``objectives``."""
    return [(m, o) for o in (objectives or [None]) for m in methods]


def arm_name(arm: Arm) -> str:
    """The run directories' prefix: ``method`` or ``method-objective``."""
    return arm[0] if arm[1] is None else f"{arm[0]}-{arm[1]}"


def mask_name(method: str) -> str:
    """The mask a method applies: its name, or "none" for the methods that silence nothing."""
    return "none" if get_method(method).mask is METHODS["justrl"].mask else method


def objective_name(arm: Arm) -> str:
    return arm[1] if arm[1] is not None else get_method(arm[0]).objective


def objective_overrides(objective: Optional[str]) -> List[str]:
    """``loss.objective=O`` and the objective's recipe values (GSPO's clip range, ...) as overrides."""
    if objective is None:
        return []
    options = {k: v for k, v in get_objective(objective).loss_options.items() if v is not None}
    return [f"loss.objective={objective}", *(f"loss.{k}={v}" for k, v in options.items())]


def launch_command(method: str, seed: int, run_dir: str, steps: Optional[int] = None,
                   objective: Optional[str] = None) -> List[str]:
    """The ``nemo-run`` command of one comparison run: ``make demo`` with the comparison's overrides
    (and ``objective``'s, `objective_overrides`)."""
    nemo_run = os.path.join(os.path.dirname(sys.executable), "nemo-run")
    overrides = [f"{k}={v}" for k, v in _overrides(steps).items()]
    return [nemo_run, LAUNCH_FILE, f"method={method}", f"seed={seed}", f"loss.seed={seed}",
            f"output_dir={os.path.abspath(run_dir)}", *overrides, *objective_overrides(objective), "--yes"]


def _record_seconds(out: str, run: str, seconds: float) -> None:
    """Each run's wall time, kept in ``<out>/run_seconds.json`` for the summary."""
    path = os.path.join(out, "run_seconds.json")
    times = json.load(open(path)) if os.path.exists(path) else {}
    times[run] = round(seconds, 1)
    with open(path, "w") as f:
        json.dump(times, f, indent=1)


def run_comparison(out: str, seeds: Sequence[int], methods: Sequence[str], steps: Optional[int] = None,
                   objectives: Optional[Sequence[str]] = None) -> None:
    """Every (method, objective, seed) run (`arms`), one after another; finished runs are skipped."""
    if not os.path.isfile(LAUNCH_FILE):
        raise FileNotFoundError(f"{LAUNCH_FILE} not found: the comparison launches the demo's launch file "
                                "and needs the repository checkout (pip install -e .)")
    steps = _overrides(steps)["steps"]
    os.makedirs(out, exist_ok=True)
    t_start = time.time()
    jobs = [(a, s) for s in seeds for a in arms(methods, objectives)]
    for k, (arm, seed) in enumerate(jobs):
        method = arm_name(arm)
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
        with open(run_dir + ".log", "w") as log:
            proc = subprocess.run(launch_command(arm[0], seed, run_dir, steps, arm[1]), cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT)
        if proc.returncode != 0 or not _finished(run_dir, steps):
            raise RuntimeError(f"{method} seed {seed} failed (exit {proc.returncode}); log: {run_dir}.log")
        _record_seconds(out, f"{method}_seed{seed}", time.time() - t0)
        evals = [r["eval_accuracy"] for r in _read_rows(run_dir) if r.get("kind") == "eval"]
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


def paired_comparison(a: Sequence[float], b: Sequence[float], alpha: float = 0.05, power: float = 0.8) -> Dict[str, float]:
    """Paired comparison of a against b (one pair per seed).

    Returns n, the mean difference a - b and its sample std, the two-sided paired t-test p, the
    effect size d_z = mean / std of the differences, and ``detectable``: the smallest true mean
    difference this many seeds detect with probability ``power`` at level ``alpha``, given the
    observed std (noncentral t, solved by bisection). NaN where fewer than 2 pairs or no spread.
    """
    from scipy import stats

    diffs = [x - y for x, y in zip(a, b)]
    n = len(diffs)
    mean, std = _mean_std(diffs)
    out = dict(n=n, mean_diff=mean, std_diff=std, p=math.nan, d_z=math.nan, detectable=math.nan)
    if n < 2:
        return out
    if std == 0:
        out["p"] = 1.0 if mean == 0 else 0.0
        return out
    out["p"] = float(stats.ttest_rel(a, b).pvalue)
    out["d_z"] = mean / std
    df, crit = n - 1, stats.t.ppf(1 - alpha / 2, n - 1)

    def achieved(delta):
        nc = delta * math.sqrt(n) / std
        return stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc)

    lo, hi = 0.0, std
    while achieved(hi) < power:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if achieved(mid) < power else (lo, mid)
    out["detectable"] = hi
    return out


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


def summarize(out: str, seeds: Sequence[int], methods: Sequence[str] = tuple(METHODS),
              objectives: Optional[Sequence[str]] = None) -> str:
    """Write ``summary.md`` and ``curves.png`` from the finished runs of every method on every
    objective (`arms`); returns the markdown. Tables name each run's mask and objective; stapo
    is paired with the other masks on the same objective."""
    compared = arms(methods, objectives)
    labels = {arm_name(a): (mask_name(a[0]), objective_name(a)) for a in compared}
    runs = {}
    for m in labels:
        for s in seeds:
            rows = _read_rows(os.path.join(out, f"{m}_seed{s}"))
            if any(r.get("kind") == "eval" for r in rows) and any(r.get("kind") == "train" for r in rows):
                runs[m, s] = rows
    if not runs:
        raise FileNotFoundError(f"no finished runs under {out}")
    per = {(m, s): _run_summary(rows) for (m, s), rows in runs.items()}
    lines = [
        "# Method comparison (tiny Qwen3, reasoning-gym sums, CPU)", "",
        f"Seeds {list(seeds)}; every run starts RL from the same warm-start. Accuracy = held-out avg@k "
        "at the demo's evaluation settings; final = the last evaluation; entropy = mean token entropy "
        "of the last 5 steps; silenced = mean fraction of response tokens silenced per step. "
        "mean +- std over seeds.", "",
        "| mask | objective | runs | held-out acc. start | final held-out acc. | gain | final entropy | silenced fraction | silenced tokens per run | final train reward |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    fmt = lambda xs, d=3: "{:.{d}f} +- {:.{d}f}".format(*_mean_std(xs), d=d)  # noqa: E731
    for m, (mask, objective) in labels.items():
        vals = [per[m, s] for s in seeds if (m, s) in per]
        if not vals:
            continue
        col = lambda key: [v[key] for v in vals]  # noqa: E731
        lines.append(
            f"| {mask} | {objective} | {len(vals)} | {fmt(col('acc0'))} | {fmt(col('acc'))} | {fmt(col('gain'))} | "
            f"{fmt(col('entropy'))} | {fmt(col('silenced_fraction'), 5)} | {fmt(col('silenced_total'), 1)} | "
            f"{fmt(col('reward'))} |"
        )
    lines += ["", "stapo against each baseline mask on the same objective, paired by seed (two-sided paired t-test; "
              "d_z = mean / std of the paired differences; detectable = the smallest true difference these "
              "seeds detect with 80% power at the 5% level):", "",
              "| baseline | objective | metric | stapo | baseline | difference | paired p | d_z | detectable | reading |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm in compared:
        b, ref = arm_name(arm), arm_name(("stapo", arm[1]))
        common = [s for s in seeds if (ref, s) in per and (b, s) in per]
        if arm[0] == "stapo" or len(common) < 2:
            continue
        for key, name in (("gain", "accuracy gain"), ("entropy", "final entropy")):
            a_vals = [per[ref, s][key] for s in common]
            b_vals = [per[b, s][key] for s in common]
            st = paired_comparison(a_vals, b_vals)
            reading = ("no difference detected" if not st["p"] < 0.05
                       else f"stapo {'higher' if st['mean_diff'] > 0 else 'lower'}")
            lines.append(f"| {labels[b][0]} | {labels[b][1]} | {name} | {_mean_std(a_vals)[0]:.3f} | {_mean_std(b_vals)[0]:.3f} | "
                         f"{st['mean_diff']:+.3f} | {st['p']:.3f} | {st['d_z']:+.2f} | {st['detectable']:.3f} | {reading} |")
    times_path = os.path.join(out, "run_seconds.json")
    times = json.load(open(times_path)) if os.path.exists(times_path) else {}
    timed = [times[f"{m}_seed{s}"] for (m, s) in per if f"{m}_seed{s}" in times]
    if timed:
        lines += ["", f"Wall time: {sum(timed) / 60:.1f} min for {len(timed)} runs "
                      f"({min(timed) / 60:.1f} to {max(timed) / 60:.1f} min each, the first including the warm-start)."]
    lines += ["", "Per run:", "", "| mask | objective | seed | start acc. | final acc. | final entropy | silenced tokens | "
              "steps with silencing |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (m, s), v in sorted(per.items()):
        lines.append(f"| {' | '.join(labels[m])} | {s} | {v['acc0']:.3f} | {v['acc']:.3f} | {v['entropy']:.3f} | {v['silenced_total']} | "
                     f"{v['steps_with_silencing']} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    _plot(out, runs, list(labels), seeds)
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


def compare_tiny(output_dir: str = "runs/compare", seeds: List[int] = list(DEFAULT_SEEDS),  # noqa: B006
                 methods: List[str] = list(DEFAULT_METHODS), steps: int = 0, publish: bool = False,  # noqa: B006
                 objectives: List[str] = []) -> str:  # noqa: B006
    """The whole comparison (runs, then summary); the NeMo-Run task of ``launch/compare_tiny.py``.

    ``steps`` = 0 takes the comparison's (``recipes.tiny.COMPARE_OVERRIDES``); ``publish`` puts the
    summary into the ``compare`` block of ``docs/results.md``; ``objectives`` (empty: each method's own) runs
    every method on each (`arms`). Plain types only: NeMo-Run's CLI parses ``key=value`` by
    annotation and does not take Optional/Sequence.
    """
    bad = [m for m in methods if m not in METHODS] + [o for o in objectives if o not in OBJECTIVES]
    if bad:
        raise ValueError(f"unknown methods or objectives {bad}; choose methods from {tuple(METHODS)} and "
                         f"objectives from {tuple(OBJECTIVES)}")
    if len(set(seeds)) != len(seeds) or len(set(methods)) != len(methods) or len(set(objectives)) != len(objectives):
        raise ValueError(f"seeds {seeds}, methods {methods} and objectives {objectives} must not repeat")
    t0 = time.time()
    run_comparison(output_dir, list(seeds), list(methods), steps or None, list(objectives))
    text = summarize(output_dir, list(seeds), list(methods), list(objectives))
    print(text, flush=True)
    print(f"[compare] {time.time() - t0:.0f}s in all (finished runs skipped)", flush=True)
    if publish:
        _to_results(output_dir, text)
    return text


RESULTS_FIGURE = os.path.join("docs", "figures", "compare_curves.png")
"""Where ``--publish`` copies the comparison's curves (``OUT/curves.png``) for the results page."""


def _to_results(out: str, text: str, root: str = ROOT) -> None:
    """The summary, with the machine, date and the runs' commit, into the ``compare`` block of the
    results page (`report.RESULTS_PAGE`), and the curves into ``RESULTS_FIGURE``."""
    import datetime
    import shutil

    commit = runs_commit(sorted(os.path.join(out, d) for d in os.listdir(out)))
    body = text.split("\n", 2)[2]  # without the summary's own title
    figure = ""
    if os.path.exists(os.path.join(out, "curves.png")):
        os.makedirs(os.path.dirname(os.path.join(root, RESULTS_FIGURE)), exist_ok=True)
        shutil.copyfile(os.path.join(out, "curves.png"), os.path.join(root, RESULTS_FIGURE))
        link = os.path.relpath(RESULTS_FIGURE, os.path.dirname(RESULTS_PAGE))  # from the page's folder
        figure = f"\n\n![accuracy gain, entropy and reward per RL step, per method]({link})\n"
    fill_block(os.path.join(root, RESULTS_PAGE), "compare",
               f"Measured {datetime.date.today().isoformat()} on {machine()} at commit {commit} by "
               f"`make compare` ({os.path.relpath(out, root)}/summary.md):\n\n{body}{figure}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/compare", help="output folder (runs, summary.md, curves.png)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS))
    p.add_argument("--objectives", nargs="+", default=None, choices=list(OBJECTIVES),
                   help="run every method on each of these objectives (default: each method's own)")
    p.add_argument("--steps", type=int, default=0, help="RL steps per run (default: COMPARE_OVERRIDES')")
    p.add_argument("--summarize-only", action="store_true")
    p.add_argument("--publish", action="store_true", help="put the summary into docs/results.md's compare block")
    args = p.parse_args(argv)
    if not args.summarize_only:
        run_comparison(args.out, args.seeds, args.methods, args.steps or None, args.objectives)
    text = summarize(args.out, args.seeds, args.methods, args.objectives)
    print(text)
    if args.publish:
        _to_results(args.out, text)


if __name__ == "__main__":
    main()
