"""Tier a: ``stapo-plot`` overlays runs' metrics.jsonl curves; the run's own plot follows evals."""

import json

import pytest

from stapo_megatron.runlog.metrics import RunLogger
from stapo_megatron.runlog.plots import main, plot_runs


def _run(path, rewards, accuracies):
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for step, reward in enumerate(rewards, 1):
            f.write(json.dumps({"kind": "train", "step": step, "reward_mean": reward}) + "\n")
        for step, acc in accuracies:
            f.write(json.dumps({"kind": "eval", "step": step, "eval_accuracy": acc}) + "\n")
    return str(path)


def _lines(png_path, monkeypatch):
    """The (label, xs, ys) of every line of each panel ``plot_runs`` draws, captured at savefig."""
    import matplotlib.figure

    drawn = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, out, **kw: drawn.append(
        [[(line.get_label(), list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines] for ax in fig.axes]))
    return drawn


def test_overlay_has_a_line_per_run_per_metric(tmp_path, monkeypatch):
    a = _run(tmp_path / "stapo", [0.1, 0.3], [(0, 0.5), (2, 0.7)])
    b = _run(tmp_path / "grpo", [0.2, 0.2, 0.4], [(0, 0.5)])
    drawn = _lines(tmp_path / "x.png", monkeypatch)
    plot_runs([a, b], str(tmp_path / "out" / "x.png"), keys=("reward_mean", "eval_accuracy"))
    assert drawn == [[
        [("stapo", [1, 2], [0.1, 0.3]), ("grpo", [1, 2, 3], [0.2, 0.2, 0.4])],
        [("stapo", [0, 2], [0.5, 0.7]), ("grpo", [0], [0.5])],
    ]]


def test_command_writes_the_png_and_names_bad_input(tmp_path, capsys):
    a = _run(tmp_path / "a", [0.1, 0.3], [(2, 0.7)])
    b = _run(tmp_path / "b", [0.2], [])
    out = tmp_path / "curves.png"
    main([a, b, "--out", str(out), "--labels", "stapo,grpo"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for argv, message in (
        ([a, str(tmp_path / "nope"), "--out", str(out)], "no metrics.jsonl in " + str(tmp_path / "nope")),
        ([a, b, "--out", str(out), "--keys", "reward_men"], "no run has values for ['reward_men']; metrics "
                                                            "available: eval_accuracy, reward_mean"),
        ([a, b, "--out", str(out), "--labels", "x"], "--labels has 1 names for 2 runs"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err


def test_run_plot_is_redrawn_at_every_eval(tmp_path):
    logger = RunLogger(str(tmp_path), tensorboard=False, plot_every_eval=True)
    logger.log({"kind": "train", "step": 1, "reward_mean": 0.1})
    assert not (tmp_path / "metrics.png").exists()  # train rows do not draw
    logger.log({"kind": "eval", "step": 1, "eval_accuracy": 0.5})
    first = (tmp_path / "metrics.png").read_bytes()
    logger.log({"kind": "train", "step": 2, "reward_mean": 0.4})
    logger.log({"kind": "eval", "step": 2, "eval_accuracy": 0.6})
    assert (tmp_path / "metrics.png").read_bytes() != first
