"""Tier a: the offline character-level tokenizer loads through AutoTokenizer and round-trips text."""

import json
import os
import string

import pytest
from transformers import AutoTokenizer

from stapo_megatron.data.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("char_tok"))
    build_char_tokenizer(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def tok(tok_dir):
    return AutoTokenizer.from_pretrained(tok_dir)


def test_files_and_config(tok_dir):
    assert sorted(os.listdir(tok_dir)) == ["tokenizer.json", "tokenizer_config.json"]
    with open(os.path.join(tok_dir, "tokenizer_config.json")) as f:
        config = json.load(f)
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert "<|im_start|>" in config["chat_template"]


def test_vocab_and_special_tokens(tok):
    # 10 digits + 52 letters + 32 punctuation + space + newline, then 4 special tokens.
    assert len(DEFAULT_ALPHABET) == 96
    assert len(tok) == 100
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]) == [96, 97, 98, 99]
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token) == (98, 96, None)
    assert tok.encode("\\boxed{}") == [DEFAULT_ALPHABET.index(c) for c in "\\boxed{}"]


@pytest.mark.parametrize("text", [
    "Calculate ( 56 + -33 ) - 84.",
    "a , b . c ! ?  double  space\n\nnew lines\t",  # no clean-up of spaces before punctuation
    "\\boxed{\\frac{1}{2}} $x^2$ ~`|",
    string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", ""),
])
def test_round_trip_one_token_per_char(tok, text):
    text = text.replace("\t", " ")  # tab is not in the default alphabet
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_unknown_char_and_specials_in_text(tok):
    assert tok.encode("1\u00e92") == [1, 99, 2]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 97 and ids[-1] == 98 and len(ids) == 2 + len("user\nhi")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_chat_template_renders(tok):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids == tok.encode(text)
    two_turns = messages + [{"role": "assistant", "content": "\\boxed{4}"}]
    assert tok.apply_chat_template(two_turns, tokenize=False).endswith(
        "<|im_start|>assistant\n\\boxed{4}<|im_end|>\n")


def test_custom_alphabet(tmp_path):
    tok = build_char_tokenizer(str(tmp_path), alphabet="0123456789+= 0")  # duplicate '0' ignored
    assert len(tok) == 13 + 4
    assert tok.decode(tok.encode("12+3=15")) == "12+3=15"
    with pytest.raises(ValueError, match="alphabet is empty"):
        build_char_tokenizer(str(tmp_path / "empty"), alphabet="")
