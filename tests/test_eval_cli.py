"""Tier a: stapo-eval's command line: defaults in --help, a folder without a tokenizer, the
engine's context length from the prompts, --dtype auto as the folder's dtype (issue 27)."""

import json
import os
import shutil

import pytest

from stapo_megatron import eval_cli
from stapo_megatron.bridge.tiny import save_tiny_hf_model
from stapo_megatron.tokenizer import build_char_tokenizer


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
    from stapo_megatron.data import format_prompt

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
