"""Tier a: stapo-eval's command line: defaults in --help, a folder without a tokenizer, the
engine's context length from the prompts, --dtype auto as the folder's dtype."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from stapo_megatron.eval import cli as eval_cli
from stapo_megatron.bridge.tiny import save_tiny_hf_model
from stapo_megatron.data.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("src") / "hf")
    save_tiny_hf_model(path, "qwen3")
    build_char_tokenizer(path)
    return path


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        eval_cli._parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 20480)" in text and "(default: 1024)" in text and "(default: auto)" in text
    assert "(k=32)" in text
    # one default per option, none for the required --out or unset options
    assert "(default: None)" not in text and "(default: [])" not in text
    assert "(default: T1.0_p1.0+T0.7_p0.9)" not in text  # not twice for --decodings
    assert "(default: the paper's two, T1.0_p1.0+T0.7_p0.9)" in text


def test_folder_without_tokenizer_is_named(tmp_path, tiny_hf):
    folder = str(tmp_path / "weights_only")
    shutil.copytree(tiny_hf, folder)
    for name in eval_cli.TOKENIZER_FILES + ("special_tokens_map.json", "merges.txt"):
        if os.path.exists(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))
    with pytest.raises(ValueError, match=rf"{folder} has no tokenizer .*--hf-config"):
        eval_cli.check_tokenizer(folder)
    eval_cli.check_tokenizer(tiny_hf)


def test_chat_template_hint_names_the_flag():
    from stapo_megatron.data.examples import format_prompt

    class NoTemplate:
        chat_template = None
        name_or_path = "base"

    with pytest.raises(ValueError, match="--no-chat-template with stapo-eval"):
        format_prompt(NoTemplate(), "1+1")


def test_model_len_from_the_prompts(tiny_hf):
    limit = json.load(open(os.path.join(tiny_hf, "config.json")))["max_position_embeddings"]
    assert eval_cli.model_len_for([30, 41], 100, tiny_hf) == 144  # 41 + 100, rounded up to 8
    with pytest.raises(ValueError, match=rf"max_position_embeddings={limit}: lower --max-tokens to at most {limit - 41}"):
        eval_cli.model_len_for([30, 41], limit, tiny_hf)


def test_dtype_auto_is_the_folders(tmp_path, tiny_hf):
    folder = str(tmp_path / "fp32")
    shutil.copytree(tiny_hf, folder)
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "float32"
    json.dump(cfg, open(path, "w"))
    assert eval_cli.resolve_dtype(folder, "auto") == "float32"
    assert eval_cli.resolve_dtype(folder, "bfloat16") == "bfloat16"


# ---- progress, saved generations, lengths and truncation, vLLM's logs off stdout ----

def _problems(tmp_path, n=6):
    path = tmp_path / "bench.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"{i}+{i}=", "answer": str(2 * i)}) + "\n"
                            for i in range(n)))
    return str(path)


def test_stapo_eval_shows_progress_and_writes_generations(tmp_path, tiny_hf, capsys, monkeypatch):
    """The real HF engine on the tiny model: progress per chunk of prompts on stderr, only the table
    on stdout, every sample in generations.jsonl, lengths / truncation / timing in eval.json."""
    from stapo_megatron.eval import generate as evaluation

    monkeypatch.setattr(evaluation, "PROGRESS_SEQUENCES", 2)  # one prompt per chunk (k=2)
    out = tmp_path / "out"
    max_tokens = 6
    assert eval_cli.main([tiny_hf, "--out", str(out), "--set", f"name=bench,path={_problems(tmp_path)},k=2,"
                          "decodings=T1.0_p1.0", "--engine", "hf", "--max-tokens", str(max_tokens),
                          "--no-chat-template", "--dtype", "float32", "--reward-workers", "1"]) == 0
    captured = capsys.readouterr()
    table = (out / "eval.md").read_text()
    assert captured.out == table
    assert "stapo-eval: bench T1.0_p1.0: generating 6 prompts x 2 samples" in captured.err
    for done in range(1, 7):
        assert re.search(rf"stapo-eval: bench T1.0_p1.0: {done}/6 prompts generated \(\d+\.\d+ prompts/s, \d+ s\)",
                         captured.err), captured.err
    assert re.search(r"bench T1.0_p1.0: 12 responses scored in \d+\.\d s", captured.err)

    records = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert not (out / "generations.jsonl.partial").exists()
    assert [(r["id"], r["sample"]) for r in records] == [(f"p{i}", j) for i in range(6) for j in range(2)]
    assert {r["set"] for r in records} == {"bench"} and records[3]["prompt"] == "1+1="
    assert all(1 <= r["response_length"] <= max_tokens and r["reward"] in (0.0, 1.0, -1.0) for r in records)
    assert all(r["truncated"] == (r["response_length"] == max_tokens) for r in records)  # no EOS at the limit

    result = json.load(open(out / "eval.json"))["sets"]["bench"]["T1.0_p1.0"]
    lengths = [r["response_length"] for r in records]
    assert result["response_length"] == {"mean": sum(lengths) / 12, "min": min(lengths), "max": max(lengths)}
    assert result["truncation_rate"] == sum(r["truncated"] for r in records) / 12
    assert result["generation_s"] >= 0 and result["scoring_s"] >= 0

    # chunked for progress, the samples are those of one call (chunk c seeded seed + c k)
    from transformers import AutoTokenizer

    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.registry import build_engine

    engine = build_engine("hf", tiny_hf, RolloutConfig(max_model_len=64, seed=0, dtype="float32"))
    try:
        whole = evaluation.engine_generate_fn(engine, AutoTokenizer.from_pretrained(tiny_hf), max_tokens, False, 0)
        responses = whole([f"{i}+{i}=" for i in range(6)], 2, 1.0, 1.0)
    finally:
        engine.shutdown()
    assert [str(r) for group in responses for r in group] == [r["response"] for r in records]


def test_vllm_log_lines_go_to_stderr(tmp_path):
    """stapo-eval points vLLM's logging at stderr before vLLM is imported (its default: stdout)."""
    pytest.importorskip("vllm")
    code = ("import sys; from stapo_megatron.eval import cli as eval_cli\n"
            "assert eval_cli.main([sys.argv[1], '--out', sys.argv[1], '--set', 'name=a,path=b']) == 2\n"
            "from vllm.logger import init_logger\n"
            "init_logger('vllm.stapo_test').warning('VLLM-LOG-LINE')\n")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_STREAM"}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "missing")], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "VLLM-LOG-LINE" in proc.stderr and "VLLM-LOG-LINE" not in proc.stdout


def test_eval_of_a_run_into_its_own_folder_scores_with_the_runs_reward(tmp_path, tiny_hf):
    """The README's ``stapo-eval RUN ... --out RUN/eval``: the checkpoint's HF
    export must not go inside RUN; the run's reward (its config.yaml) scores, and eval.json says
    which. boxed_exact_match scores an unboxed response -1, math_verify 0."""
    from stapo_megatron.config.yaml_io import write_config
    from stapo_megatron.conversion.hf_to_mcore import convert_hf_to_mcore
    from stapo_megatron.recipes.paper import qwen3_1p7b

    run = tmp_path / "run"
    convert_hf_to_mcore(tiny_hf, str(run))
    # the config.yaml a training run writes (the trainer's own writer), here the paper recipes' reward
    write_config(str(run / "config.yaml"), qwen3_1p7b(), recipe="qwen3_1p7b")
    common = ["--set", f"name=bench,path={_problems(tmp_path, 2)},k=2,decodings=T1.0_p1.0", "--engine", "hf",
              "--max-tokens", "4", "--no-chat-template", "--dtype", "float32", "--reward-workers", "1"]
    for out, extra, reward, source, value in [
            (run / "eval", [], "boxed_exact_match", str(run / "config.yaml"), -1.0),
            (tmp_path / "mv", ["--reward", "math_verify"], "math_verify", "--reward", 0.0)]:
        assert eval_cli.main([str(run), "--out", str(out)] + common + extra) == 0
        settings = json.load(open(out / "eval.json"))["settings"]
        assert (settings["reward"], settings["reward_source"]) == (reward, source)
        rewards = [json.loads(line)["reward"] for line in (out / "generations.jsonl").read_text().splitlines()]
        assert rewards == [value] * 4  # 4 characters of the tiny model hold no finished \boxed{}
        assert sorted(os.listdir(out)) == ["eval.json", "eval.md", "generations.jsonl"]


def test_default_reward_without_a_run_config(tiny_hf):
    args = eval_cli._parser().parse_args([tiny_hf, "--out", "x"])
    assert eval_cli.choose_reward(args) == ("math_verify", "default (no run config.yaml)")
    args = eval_cli._parser().parse_args([tiny_hf, "--out", "x", "--reward", "no_such_reward"])
    with pytest.raises(ValueError, match="reward must be one of"):
        eval_cli.get_reward(eval_cli.choose_reward(args)[0])


def test_the_runs_reward_is_read_from_the_config_yaml_training_writes(tmp_path):
    """A run folder and its step folders carry the config.yaml of `config.yaml_io.write_config`
    (the reward under ``trainer.reward.name``): the reward is read from there, not defaulted."""
    from stapo_megatron.config.yaml_io import write_config
    from stapo_megatron.recipes.paper import qwen3_8b
    from stapo_megatron.recipes.tiny import tiny_demo

    run, step = tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    write_config(str(run / "config.yaml"), qwen3_8b(), recipe="qwen3_8b")
    assert eval_cli.run_reward(str(run)) == ("boxed_exact_match", str(run / "config.yaml"))
    assert eval_cli.run_reward(str(step)) == ("boxed_exact_match", str(run / "config.yaml"))
    cfg, warmstart = tiny_demo(run_dir=str(run))
    write_config(str(step / "config.yaml"), cfg, warmstart, recipe="tiny")  # the step's own copy comes first
    assert eval_cli.run_reward(str(step)) == ("math_verify", str(step / "config.yaml"))


def test_an_unreadable_run_config_names_the_file_and_the_way_out(tmp_path):
    (tmp_path / "config.yaml").write_text("seed: 0\nreward: boxed_exact_match\n")  # not a run's layout
    with pytest.raises(ValueError, match=r"cannot read the run's reward from .*config.yaml.*--reward"):
        eval_cli.run_reward(str(tmp_path))
