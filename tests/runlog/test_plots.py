"""Tier a: ``stapo-plot`` overlays runs' metrics.jsonl curves; the run's own plot follows evals."""

import json
import math

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


def _grad_norm_run(path):
    """One train step with a gradient grid (two occupied cells) and two silenced tokens."""
    from stapo_megatron.ops import logit_grad

    num_h = logit_grad.GRID_ENTROPY[2]
    sums, counts = [0.0] * logit_grad.GRID_CELLS, [0.0] * logit_grad.GRID_CELLS
    sums[0 * num_h + 1], counts[0 * num_h + 1] = 8.0, 2.0  # log10 p < -4.5, H in [0.5, 1): RMS 2
    sums[9 * num_h + 1], counts[9 * num_h + 1] = 0.01, 4.0  # log10 p > -0.5, same H: RMS 0.05
    path.mkdir()
    row = dict(kind="train", step=3, silenced_fraction=0.01, grad_share_silenced=0.5,
               grad_norm_grid_sq_sum=sums, grad_norm_grid_count=counts)
    (path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    logger = RunLogger(str(path), tensorboard=False)
    logger.log_silenced(3, [(7, -9.0, 0.7, 1.0, float("nan"), 0.0, 2.5), (8, -8.0, 0.6, 1.0, float("nan"), 0.0, 1.5)],
                        str)
    return str(path)


def test_grad_norm_figure_draws_the_grid_marginals_and_the_silenced_tokens(tmp_path, monkeypatch):
    import matplotlib.figure

    run = _grad_norm_run(tmp_path / "run")
    drawn = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, out, **kw: drawn.append(
        [([list(line.get_ydata()) for line in ax.lines], [c.get_offsets().tolist() for c in ax.collections[:1]])
         for ax in fig.axes]))
    main([run, "--grad-norm", "3", "--out", str(tmp_path / "g.png")])
    (_, _), (p_lines, p_points), (h_lines, h_points) = drawn[0][:3]
    p_rms = p_lines[0]
    assert p_rms[0] == pytest.approx(2.0) and p_rms[-1] == pytest.approx(0.05)
    assert all(v != v for v in p_rms[1:-1]), "empty probability bins are NaN, not 0"
    assert h_lines[0][1] == pytest.approx((8.01 / 6) ** 0.5)  # both cells share the H bin
    assert [v for pt in sorted(p_points[0]) for v in pt] == pytest.approx(
        [-9.0 / math.log(10), 2.5, -8.0 / math.log(10), 1.5])
    assert sorted(h_points[0]) == [[0.6, 1.5], [0.7, 2.5]]


def test_grad_norm_figure_refuses_runs_without_the_grid(tmp_path, capsys):
    run = _run(tmp_path / "old", [0.1], [])
    with pytest.raises(SystemExit):
        main([run, "--grad-norm", "last", "--out", str(tmp_path / "g.png")])
    assert "no train row with grad_norm_grid_count" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([run, "--grad-norm", "x", "--out", str(tmp_path / "g.png")])
