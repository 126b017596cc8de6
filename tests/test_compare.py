"""The method comparison's summary: statistics over seeds from run directories' metrics.jsonl."""

import json
import re

import pytest

from stapo_megatron import compare


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
    finals = {"stapo": [0.80, 0.82, 0.84], "grpo": [0.70, 0.71, 0.75]}
    for method, accs in finals.items():
        for seed, acc in enumerate(accs):
            _write_run(tmp_path / f"{method}_seed{seed}", 0.3, acc, 0.2 if method == "stapo" else 0.1,
                       3 if method == "stapo" else 0)
    text = compare.summarize(str(tmp_path), seeds=[0, 1, 2], methods=["stapo", "grpo"])
    assert (tmp_path / "summary.md").read_text() == text
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    stapo_row = next(line for line in text.splitlines() if line.startswith("| stapo | 3 |"))
    # mean +- sample std of the final accuracies 0.80, 0.82, 0.84
    assert "0.820 +- 0.020" in stapo_row
    assert "| 18.0 +- 0.0 |" in stapo_row  # 3 silenced tokens x 6 steps per run
    row = next(line for line in text.splitlines() if line.startswith("| grpo | final accuracy |"))
    welch, paired = (float(x) for x in re.findall(r"\| (0\.\d{3}) \| (0\.\d{3}) \|$", row)[0])
    from scipy import stats

    assert welch == pytest.approx(stats.ttest_ind(finals["stapo"], finals["grpo"], equal_var=False).pvalue, abs=1e-3)
    assert paired == pytest.approx(stats.ttest_rel(finals["stapo"], finals["grpo"]).pvalue, abs=1e-3)
    assert welch < 0.05


def test_summary_without_runs_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no finished runs"):
        compare.summarize(str(tmp_path), seeds=[0])
