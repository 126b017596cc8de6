"""LoRA against full fine-tuning on the demo, seed by seed, from the same warm-started weights:
the demo-lora table of docs/results.md comes from here.

    .venv/bin/python examples/demo_lora_seeds.py                 # = make demo-lora-seeds (3 seeds)
    .venv/bin/python examples/demo_lora_seeds.py --seeds 1234 --no-publish

First the warm-started base, as ``make demo-lora``'s first command writes it
(``nemo-run launch/stapo_tiny.py steps=0 output_dir=OUT/demo-lora-base
warmstart.save_to=OUT/demo-lora-base/warm-start``; the warm-start is cached in
``OUT/.warmstart-cache``). Then for each seed, one after another, into ``OUT/full_S`` and
``OUT/lora_S``:

    full   nemo-run launch/stapo_tiny.py seed=S        (make demo: loads the cached warm-start)
    lora   nemo-run launch/stapo_tiny_lora.py seed=S   (make demo-lora: that warm-start as the frozen
                                                        base, only the adapters trained)

so both methods start RL from the same weights and differ only in what they train. A run that
finished (its last evaluation logged) is not run again. The table (held-out accuracy at RL step 0
and at the end, tokens S2T silenced, the engine/trainer log-prob agreement, the checkpoint's size
and the wall time of each run) goes into docs/results.md between the ``demo-lora`` markers, with
the machine and the commit the runs were made at.
"""

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from demo_seeds import _finished, _rows, nemo_run  # noqa: E402

DEFAULT_SEEDS = (1234, 1, 2)
METHODS = {"full": "launch/stapo_tiny.py", "lora": "launch/stapo_tiny_lora.py"}
"""Each method's launch file (the seed and the output folder are added)."""


def write_base(out: str) -> None:
    """The warm-started weights the LoRA runs freeze (`recipes.tiny.LORA_BASE` beside their
    folders), unless they are there."""
    from stapo_megatron.recipes.tiny import LORA_BASE

    base = os.path.join(out, LORA_BASE)
    if os.path.isdir(os.path.join(ROOT, base)):
        return
    nemo_run([METHODS["full"], "steps=0", f"output_dir={os.path.dirname(base)}", f"warmstart.save_to={base}"],
             "demo-lora-seeds base")


def run(method: str, seed: int, run_dir: str, steps: int) -> None:
    """One method's demo into ``run_dir``, unless it finished there; its wall time goes into
    ``run_dir/demo_run.json`` (the summary reads it back on a rerun)."""
    import json

    if _finished(os.path.join(ROOT, run_dir), steps):
        return
    seconds = nemo_run([METHODS[method], f"seed={seed}", f"output_dir={run_dir}"],
                       f"demo-lora-seeds {method} seed {seed}")
    if not _finished(os.path.join(ROOT, run_dir), steps):
        raise RuntimeError(f"{method} seed {seed}: {run_dir}/metrics.jsonl has no evaluation at step {steps}")
    with open(os.path.join(ROOT, run_dir, "demo_run.json"), "w") as f:
        json.dump(dict(seconds=seconds), f)


def checkpoint_bytes(run_dir: str) -> int:
    """Bytes of the run's newest checkpoint folder (``checkpoints/step_N``), 0 if it kept none."""
    folder = os.path.join(run_dir, "checkpoints")
    steps = [n for n in os.listdir(folder) if n.startswith("step_")] if os.path.isdir(folder) else []
    if not steps:
        return 0
    newest = os.path.join(folder, max(steps, key=lambda n: int(n.split("_")[1])))
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(newest) for n in names)


def summarise(run_dir: str) -> dict:
    """What the table shows of one run, from its ``metrics.jsonl`` and ``demo_run.json``."""
    import json

    rows = _rows(run_dir)
    evals = {r["step"]: r["eval_accuracy"] for r in rows if r.get("kind") == "eval"}
    train = [r for r in rows if r.get("kind") == "train"]
    timing = os.path.join(run_dir, "demo_run.json")
    return dict(start=evals[min(evals)], end=evals[max(evals)],
                silenced=sum(r["silenced_count"] for r in train),
                logprob_diff=max(r.get("rollout_train_logprob_diff", 0.0) for r in train),
                ckpt=checkpoint_bytes(run_dir),
                seconds=json.load(open(timing))["seconds"] if os.path.exists(timing) else 0.0)


def table(results) -> str:
    """One row per seed and method; ``results`` is [(seed, {method: summarise(...)})]."""
    lines = ["| seed | method | held-out, RL step 0 | at the end | gain | tokens silenced by S2T | "
             "max rollout/train log-prob diff | checkpoint | wall time |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for seed, by_method in results:
        for method, s in by_method.items():
            wall = f"{s['seconds'] / 60:.1f} min" if s["seconds"] else "not recorded"
            lines.append(f"| {seed} | {method} | {s['start']:.3f} | {s['end']:.3f} | {s['end'] - s['start']:+.3f} | "
                         f"{s['silenced']} | {s['logprob_diff']:.1e} | {s['ckpt'] / 1e6:.2f} MB | {wall} |")
    for method in METHODS:
        runs = [by_method[method] for _, by_method in results]
        gain = sum(s["end"] - s["start"] for s in runs) / len(runs)
        lines.append(f"| mean | {method} | {sum(s['start'] for s in runs) / len(runs):.3f} | "
                     f"{sum(s['end'] for s in runs) / len(runs):.3f} | {gain:+.3f} | "
                     f"{sum(s['silenced'] for s in runs) / len(runs):.1f} | | | |")
    return "\n".join(lines)


def verdict(results) -> str:
    """A sentence for under the table: on how many seeds LoRA learned (gain > 0) and how its
    gain compares with full fine-tuning's."""
    gains = [(seed, m["lora"]["end"] - m["lora"]["start"], m["full"]["end"] - m["full"]["start"])
             for seed, m in results]
    learned = [str(seed) for seed, lora, _ in gains if lora > 0]
    ahead = sum(lora >= full for _, lora, full in gains)
    return (f"LoRA's held-out accuracy rose on {len(learned)} of {len(gains)} seeds"
            + (f" ({', '.join(learned)})" if learned else "")
            + f"; its gain was at least full fine-tuning's on {ahead} of {len(gains)}.")


def main():
    from stapo_megatron.recipes.tiny import LORA_LR, tiny_demo
    from stapo_megatron.runlog.report import RESULTS_PAGE, fill_block, machine, runs_commit

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--out", default="runs/demo-lora-seeds")
    parser.add_argument("--no-publish", action="store_true", help="do not update docs/results.md")
    args = parser.parse_args()
    cfg, _ = tiny_demo()
    write_base(args.out)
    results = []
    for seed in args.seeds:
        by_method = {}
        for method in METHODS:
            run_dir = os.path.join(args.out, f"{method}_{seed}")
            run(method, seed, run_dir, cfg.steps)
            by_method[method] = summarise(os.path.join(ROOT, run_dir))
        results.append((seed, by_method))
    dirs = [os.path.join(ROOT, args.out, f"{m}_{s}") for s in args.seeds for m in METHODS]
    stamp = f"Measured {datetime.date.today().isoformat()} on {machine()} at commit {runs_commit(dirs)}"
    text = (f"{stamp} by `examples/demo_lora_seeds.py` ({cfg.steps} RL steps from the same warm-start; full "
            f"lr {cfg.optim.lr:g}, LoRA lr {LORA_LR:g}; held-out avg@{cfg.eval.samples} at "
            f"T={cfg.eval.temperature:g}):\n\n{table(results)}\n\n{verdict(results)}\n")
    print(text)
    if not args.no_publish:
        fill_block(os.path.join(ROOT, RESULTS_PAGE), "demo-lora", text)


if __name__ == "__main__":
    main()
