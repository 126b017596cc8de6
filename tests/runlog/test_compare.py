"""The method comparison's summary: statistics over seeds from run directories' metrics.jsonl."""

import json
import math
import os

import numpy as np

import pytest

from stapo_megatron.runlog import compare


def _write_run(path, acc0, acc, entropy, silenced):
    path.mkdir(parents=True)
    rows = [dict(kind="eval", step=0, eval_accuracy=acc0)]
    for step in range(1, 7):
        rows.append(dict(kind="train", step=step, reward_mean=0.5, entropy_mean=entropy,
                         silenced_count=silenced, silenced_fraction=silenced / 1000))
    rows.append(dict(kind="eval", step=6, eval_accuracy=acc))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_statistics_and_plot(tmp_path):
    pytest.importorskip("scipy")
    from scipy import stats

    finals = {"stapo": [0.80, 0.82, 0.84, 0.79], "grpo": [0.70, 0.71, 0.75, 0.74], "random": [0.80, 0.81, 0.85, 0.78]}
    for method, accs in finals.items():
        for seed, acc in enumerate(accs):
            _write_run(tmp_path / f"{method}_seed{seed}", 0.3, acc, 0.2 if method == "stapo" else 0.1,
                       3 if method == "stapo" else 0)
    text = compare.summarize(str(tmp_path), seeds=[0, 1, 2, 3], methods=["stapo", "grpo", "random"])
    assert (tmp_path / "summary.md").read_text() == text
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    stapo_row = next(line for line in text.splitlines() if line.startswith("| stapo | dapo | 4 |"))
    # mean +- sample std of the final accuracies
    assert "{:.3f} +- {:.3f}".format(np.mean(finals["stapo"]), np.std(finals["stapo"], ddof=1)) in stapo_row
    assert "| 18.0 +- 0.0 |" in stapo_row  # 3 silenced tokens x 6 steps per run
    assert any(line.startswith("| none | grpo | 4 |") for line in text.splitlines())  # grpo: no mask, its objective
    row = next(line for line in text.splitlines() if line.startswith("| none | grpo | accuracy gain |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    diff, p, d_z, detectable = float(cells[4]), float(cells[5]), float(cells[6]), float(cells[7])
    d = np.array(finals["stapo"]) - np.array(finals["grpo"])
    assert diff == pytest.approx(d.mean(), abs=1e-3)
    assert p == pytest.approx(stats.ttest_rel(finals["stapo"], finals["grpo"]).pvalue, abs=1e-3) and p < 0.05
    assert d_z == pytest.approx(d.mean() / d.std(ddof=1), abs=1e-2)
    assert cells[8] == "stapo higher"
    # the detectable difference has 80% power: a two-sided paired t-test at 5% with 4 seeds
    crit, nc = stats.t.ppf(0.975, 3), detectable * 2 / d.std(ddof=1)
    assert stats.nct.sf(crit, 3, nc) + stats.nct.cdf(-crit, 3, nc) == pytest.approx(0.8, abs=0.01)
    random_row = next(line for line in text.splitlines() if line.startswith("| random | dapo | accuracy gain |"))
    assert random_row.endswith("| no difference detected |")


def test_paired_comparison_edge_cases():
    same = compare.paired_comparison([0.5, 0.6], [0.5, 0.6])
    assert (same["mean_diff"], same["p"]) == (0.0, 1.0)
    one = compare.paired_comparison([0.5], [0.4])
    assert one["n"] == 1 and math.isnan(one["p"]) and math.isnan(one["detectable"])


def test_each_run_is_launched_as_make_demo_is():
    from stapo_megatron.recipes.tiny import COMPARE_OVERRIDES, tiny_compare

    cmd = compare.launch_command("random", 3, "runs/compare/random_seed3")
    makefile = open(os.path.join(compare.ROOT, "Makefile")).read()
    assert "nemo-run launch/stapo_tiny.py $(ARGS) --yes" in makefile and cmd[1] == compare.LAUNCH_FILE
    assert os.path.basename(cmd[0]) == "nemo-run" and cmd[-1] == "--yes"
    assert {"method=random", "seed=3", "loss.seed=3", *(f"{k}={v}" for k, v in COMPARE_OVERRIDES.items())} <= set(cmd)
    # the launched config is the one tiny_compare documents
    from stapo_megatron.launch.entry import build_config

    args = dict(a.split("=", 1) for a in cmd[2:-1])
    cfg, ws = build_config("tiny", args.pop("method"), args.pop("output_dir"),
                           loss={"seed": int(args.pop("loss.seed"))}, **{k: int(v) for k, v in args.items()})
    ref, ref_ws = tiny_compare(run_dir=cfg.run_dir, method="random", seed=3)
    assert cfg == ref and ws == ref_ws


def test_s2t_on_an_objective_against_that_objective(tmp_path):
    """``--methods stapo justrl --objectives cispo``: runs ``stapo-cispo_seedS`` and
    ``justrl-cispo_seedS``, tables naming mask and objective, stapo paired with the unmasked CISPO."""
    pytest.importorskip("scipy")
    assert compare.arms(["stapo", "justrl"], ["cispo", "gspo"]) == [
        ("stapo", "cispo"), ("justrl", "cispo"), ("stapo", "gspo"), ("justrl", "gspo")]
    finals = {"stapo-cispo": [0.8, 0.9, 0.85], "justrl-cispo": [0.6, 0.65, 0.62]}
    for name, accs in finals.items():
        for seed, acc in enumerate(accs):
            _write_run(tmp_path / f"{name}_seed{seed}", 0.3, acc, 0.2, 2 if name.startswith("stapo") else 0)
    text = compare.summarize(str(tmp_path), seeds=[0, 1, 2], methods=["stapo", "justrl"], objectives=["cispo"])
    lines = text.splitlines()
    assert any(line.startswith("| stapo | cispo | 3 | 0.300 +- 0.000 | 0.850 +- 0.050 |") for line in lines)
    assert any(line.startswith("| none | cispo | 3 | 0.300 +- 0.000 | 0.623 +- 0.025 |") for line in lines)
    row = next(line for line in lines if line.startswith("| none | cispo | accuracy gain |"))
    assert "| 0.550 | 0.323 | +0.227 |" in row  # gains over the start, 0.3 and row.endswith("| stapo higher |")
    assert "| stapo | cispo | 1 | 0.300 | 0.900 |" in text  # per run: mask, objective, seed


def test_an_objective_run_is_launched_with_its_objective():
    from stapo_megatron.launch.entry import build_config
    from stapo_megatron.method.config import method_loss_config

    cmd = compare.launch_command("stapo", 2, "runs/compare/stapo-gspo_seed2", objective="gspo")
    assert {"method=stapo", "loss.objective=gspo", "loss.clip_ratio_low=0.0003", "loss.clip_ratio_high=0.0004"} <= set(cmd)
    args = dict(a.split("=", 1) for a in cmd[2:-1])
    loss = {k.split(".", 1)[1]: v for k, v in args.items() if k.startswith("loss.")}
    cfg, _ = build_config("tiny", args["method"], args["output_dir"],
                          loss={k: (v if k == "objective" else float(v) if "." in v else int(v)) for k, v in loss.items()})
    assert cfg.loss == method_loss_config("stapo", objective="gspo", seed=2, temperature=cfg.loss.temperature)
    assert compare.launch_command("stapo", 2, "x") == [a for a in compare.launch_command("stapo", 2, "x", objective=None)]
    with pytest.raises(ValueError, match=r"unknown methods or objectives \['cisp'\]"):
        compare.compare_tiny(str("unused"), methods=["stapo"], objectives=["cisp"])


def test_summary_without_runs_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no finished runs"):
        compare.summarize(str(tmp_path), seeds=[0])


def test_results_block_gets_the_summary_and_the_curves(tmp_path):
    out = tmp_path / "runs" / "compare"
    out.mkdir(parents=True)
    (out / "curves.png").write_bytes(b"\x89PNG fake")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "results.md"
    page.write_text("intro\n<!-- compare:begin -->\nold\n<!-- compare:end -->\nafter\n")
    compare._to_results(str(out), "# title\n\n| method | gain |\n| stapo | +0.1 |", root=str(tmp_path))
    text = page.read_text()
    assert "old" not in text and "| stapo | +0.1 |" in text and text.endswith("after\n")
    assert "at commit unknown" in text and "(runs/compare/summary.md)" in text
    assert "](figures/compare_curves.png)" in text  # relative to the page's folder
    assert (tmp_path / compare.RESULTS_FIGURE).read_bytes() == b"\x89PNG fake"

