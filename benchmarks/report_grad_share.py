"""The paper's gradient claim on a real run: per RL step, the share of the squared logit-gradient norm
that the S2T-silenced tokens carried before silencing, beside the fraction of tokens silenced
(the metrics are ``stapo_megatron.ops.logit_grad``'s, logged in every train row).

Reads a finished run folder, writes the table between the ``grad-share`` markers of
benchmarks/RESULTS.md and the figure of one step (``stapo-plot --grad-norm``) to docs/figures/:

    PATH=.venv/bin:$PATH .venv/bin/python launch/stapo_tiny.py steps=20 eval.every=20 save_every=0 \\
        output_dir=runs/gradnorm-demo --yes
    .venv/bin/python benchmarks/report_grad_share.py runs/gradnorm-demo --command "<the line above>"
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess

from stapo_megatron.runlog.plots import plot_grad_norm, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- grad-share:begin -->", "<!-- grad-share:end -->"
COLUMNS = ("step", "silenced", "silenced fraction", "candidates", "share of |grad|^2: candidates",
           "share: silenced", "median norm silenced", "median norm kept", "ratio")


def _fmt(value, spec):
    return "n/a" if value is None else format(value, spec)


def table(rows) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join([
            str(r["step"]), str(r["silenced_count"]), _fmt(r["silenced_fraction"], ".3%"), str(r["candidate_count"]),
            _fmt(r.get("grad_share_candidates"), ".2%"), _fmt(r.get("grad_share_silenced"), ".2%"),
            _fmt(r.get("grad_norm_median_silenced"), ".3g"), _fmt(r.get("grad_norm_median_kept"), ".3g"),
            _fmt(r.get("grad_norm_median_ratio"), ".0f") + "x",
        ]) + " |")
    return "\n".join(lines)


def summary(rows) -> str:
    med = lambda key: statistics.median(r[key] for r in rows if r.get(key) is not None)  # noqa: E731
    return (f"Median over the {len(rows)} steps: {med('silenced_fraction'):.3%} of response tokens silenced, "
            f"carrying {med('grad_share_silenced'):.2%} of the step's squared logit-gradient norm before "
            f"silencing (the candidates: {med('grad_share_candidates'):.2%}); a silenced token's median norm is "
            f"{med('grad_norm_median_ratio'):.0f}x a kept token's.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a finished run folder (metrics.jsonl with the gradient metrics)")
    p.add_argument("--command", required=True, help="the command that produced the run (quoted in RESULTS.md)")
    p.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "RESULTS.md"))
    p.add_argument("--figure", default=os.path.join(ROOT, "docs", "figures", "grad_norm_step.png"))
    p.add_argument("--figure-step", default="last")
    args = p.parse_args()
    rows = [r for r in read_metrics(args.run) if r.get("kind") == "train" and "grad_share_silenced" in r]
    if not rows:
        p.error(f"{args.run}: no train row with grad_share_silenced")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    plot_grad_norm(args.run, args.figure, args.figure_step)
    block = "\n".join([
        BEGIN,
        f"Measured {datetime.date.today()} on {platform.machine()}, {os.cpu_count()} cores (shared with other jobs) "
        f"at commit {commit} by `benchmarks/report_grad_share.py` from the run of",
        "", f"    {args.command}", "",
        table(rows), "", summary(rows),
        "", f"![logit-gradient norm vs p and H]({os.path.relpath(args.figure, os.path.dirname(args.results))})",
        END,
    ])
    with open(args.results) as f:
        text = f.read()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{args.results} has no {BEGIN} ... {END} section")
    with open(args.results, "w") as f:
        f.write(pattern.sub(lambda _: block, text))
    print(block)


if __name__ == "__main__":
    main()
