"""Tier a: scripts/prepare_data.py on small files in the downloaded layouts (issue 27)."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from stapo_megatron.data.examples import load_examples
from stapo_megatron.eval.scoring import load_benchmark
from tests.helpers import REPO_DIR

SCRIPT = os.path.join(REPO_DIR, "scripts", "prepare_data.py")


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300)


def test_dapo_parquet_is_deduplicated_into_training_rows(tmp_path):
    """DAPO-Math-17k's parquet: chat-message prompts, reward_model.ground_truth, repeated problems."""
    rows = [{"prompt": [{"role": "user", "content": f"Solve {q}."}], "reward_model": {"ground_truth": a, "style": "rule"},
             "extra_info": {"index": str(i)}} for i, (q, a) in enumerate([("1+1", "2"), ("2+2", "4"), ("1+1", "2")])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo.parquet")
    out = tmp_path / "data" / "dapo_math_17k.jsonl"
    proc = _run("dapo", str(tmp_path / "dapo.parquet"), str(out))
    assert proc.returncode == 0, proc.stderr
    assert "wrote 2 problems" in proc.stdout
    kept = load_examples(str(out))
    assert [(e.prompt, e.answer) for e in kept] == [("Solve 1+1.", "2"), ("Solve 2+2.", "4")]


def test_benchmarks_in_their_own_layouts(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "aime.jsonl").write_text(json.dumps({"id": 60, "problem": "p1", "answer": "204"}) + "\n")
    (src / "olympiad.jsonl").write_text(json.dumps({"question": "q", "final_answer": ["3", "4"]}) + "\n")
    (src / "math.jsonl").write_text(json.dumps({"problem": "m", "solution": r"so \boxed{7}", "unique_id": "t/1"}) + "\n")
    for name, file in [("aime24", "aime.jsonl"), ("olympiadbench", "olympiad.jsonl"), ("math500", "math.jsonl")]:
        proc = _run("bench", name, str(src / file), str(tmp_path / "bench"))
        assert proc.returncode == 0, proc.stderr
    read = {n: load_benchmark(str(tmp_path / "bench" / f"{n}.jsonl")) for n in ("aime24", "olympiadbench", "math500")}
    assert [(e.id, e.prompt, e.answer) for e in read["aime24"]] == [("60", "p1", "204")]
    assert read["olympiadbench"][0].answer == "3, 4"
    assert (read["math500"][0].id, read["math500"][0].answer) == ("t/1", "7")


def test_a_file_without_the_fields_is_an_error(tmp_path):
    (tmp_path / "x.jsonl").write_text(json.dumps({"text": "t"}) + "\n")
    proc = _run("bench", "amc23", str(tmp_path / "x.jsonl"), str(tmp_path / "bench"))
    assert proc.returncode == 2 and "x.jsonl" in proc.stderr
    assert not (tmp_path / "bench").exists()


def _aime_part(path, first_id, num=15):
    path.write_text("".join(json.dumps({"id": i, "problem": f"{path.stem} problem {i}", "answer": str(i)}) + "\n"
                            for i in range(first_id, first_id + num)))


def test_aime25_takes_both_published_files(tmp_path):
    """AIME 2025 I and II: both files in one call give the 30 problems; one file is refused."""
    _aime_part(tmp_path / "aime2025-I.jsonl", 0)
    _aime_part(tmp_path / "aime2025-II.jsonl", 0)  # both number their problems from 0
    proc = _run("bench", "aime25", str(tmp_path / "aime2025-I.jsonl"), str(tmp_path / "bench"))
    assert proc.returncode == 2 and "two files (I and II)" in proc.stderr and "15" in proc.stderr
    assert not (tmp_path / "bench" / "aime25.jsonl").exists()
    proc = _run("bench", "aime25", str(tmp_path / "aime2025-I.jsonl"), str(tmp_path / "aime2025-II.jsonl"),
                str(tmp_path / "bench"))
    assert proc.returncode == 0, proc.stderr
    read = load_benchmark(str(tmp_path / "bench" / "aime25.jsonl"))
    assert len(read) == 30 and len({e.id for e in read}) == 30
    assert (read[0].id, read[15].id, read[15].prompt) == ("aime2025-I-0", "aime2025-II-0", "aime2025-II problem 0")


def test_refuses_to_write_over_its_input(tmp_path):
    src = tmp_path / "amc23.jsonl"
    src.write_text(json.dumps({"problem": "p", "answer": 12.0}) + "\n")
    before = src.read_text()
    proc = _run("bench", "amc23", str(src), str(tmp_path))
    assert proc.returncode == 2 and "is the input" in proc.stderr
    assert src.read_text() == before
    proc = _run("dapo", str(src), str(src))
    assert proc.returncode == 2 and "is the input" in proc.stderr
    assert src.read_text() == before


def test_answers_are_written_in_boxed_form(tmp_path):
    """amc23's float answers and OlympiadBench's $-wrapped answer lists, as published."""
    (tmp_path / "amc.jsonl").write_text(json.dumps({"question": "q", "answer": 12.0}) + "\n"
                                        + json.dumps({"question": "r", "answer": 0.5}) + "\n")
    (tmp_path / "oly.jsonl").write_text(json.dumps({"question": "q", "final_answer": ["$2$", "$-2$"]}) + "\n")
    for name, file in [("amc23", "amc.jsonl"), ("olympiadbench", "oly.jsonl")]:
        assert _run("bench", name, str(tmp_path / file), str(tmp_path / "bench")).returncode == 0
    assert [e.answer for e in load_benchmark(str(tmp_path / "bench" / "amc23.jsonl"))] == ["12", "0.5"]
    assert load_benchmark(str(tmp_path / "bench" / "olympiadbench.jsonl"))[0].answer == "2, -2"


def test_paper_recipe_takes_the_prepared_benchmarks(tmp_path):
    """The folder prepare_data writes becomes a paper recipe's eval_sets (issue 36, item 8)."""
    import pytest

    from stapo_megatron.recipes.paper import qwen3_1p7b, with_paper_benchmarks

    (tmp_path / "m.jsonl").write_text(json.dumps({"problem": "m", "solution": r"so \boxed{7}"}) + "\n")
    _aime_part(tmp_path / "I.jsonl", 0)
    _aime_part(tmp_path / "II.jsonl", 15)
    bench = tmp_path / "bench"
    assert _run("bench", "math500", str(tmp_path / "m.jsonl"), str(bench)).returncode == 0
    assert _run("bench", "aime25", str(tmp_path / "I.jsonl"), str(tmp_path / "II.jsonl"), str(bench)).returncode == 0
    cfg = with_paper_benchmarks(qwen3_1p7b(), str(bench))
    assert [(s.name, s.k, s.path) for s in cfg.eval.sets] == [("aime25", 32, str(bench / "aime25.jsonl")),
                                                              ("math500", 4, str(bench / "math500.jsonl"))]
    assert cfg.eval.sets[0].decodings == ("T1.0_p1.0", "T0.7_p0.9")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has none of aime24.jsonl"):
        with_paper_benchmarks(qwen3_1p7b(), str(tmp_path / "empty"))


def test_eval_sets_stand_in_for_the_held_out_file(tmp_path):
    """A paper recipe with the benchmarks as eval.sets needs no data.eval_path (issue 36, item 8):
    the paper check names it only when neither is given, and the trainer loads no held-out split."""
    import pytest
    from transformers import AutoTokenizer

    from stapo_megatron.bridge.tiny import save_tiny_hf_model
    from stapo_megatron.recipes.paper import check_paper_config, qwen3_1p7b, with_paper_benchmarks
    from stapo_megatron.trainer.prompts import load_prompts

    (tmp_path / "m.jsonl").write_text(json.dumps({"problem": "m", "solution": r"so \boxed{7}"}) + "\n")
    bench = tmp_path / "bench"
    assert _run("bench", "math500", str(tmp_path / "m.jsonl"), str(bench)).returncode == 0
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(4)))
    cfg = qwen3_1p7b()
    cfg.model.hf_dir, cfg.model.megatron_ckpt, cfg.data.train_path = "/m", "/c", str(train)
    with pytest.raises(ValueError, match="data.eval_path is not set"):
        check_paper_config("qwen3_1p7b", cfg)
    cfg = with_paper_benchmarks(cfg, str(bench))
    check_paper_config("qwen3_1p7b", cfg)  # complete: the benchmarks are the evaluation
    hf = tmp_path / "hf"
    save_tiny_hf_model(str(hf), "qwen3")
    cfg.data.use_chat_template = False  # the tiny tokenizer has none
    tokenizer = AutoTokenizer.from_pretrained(hf)
    (train_ids, train_examples), (held_ids, held_examples) = load_prompts(cfg.data, tokenizer, cfg.seed,
                                                                          bool(cfg.eval.sets))
    assert len(train_ids) == 4 and held_ids == [] and held_examples == []
    cfg.eval.sets = []
    with pytest.raises(ValueError, match="or name the evaluation sets in eval.sets"):
        load_prompts(cfg.data, tokenizer, cfg.seed, bool(cfg.eval.sets))
