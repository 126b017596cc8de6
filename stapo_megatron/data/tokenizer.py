"""An offline character-level tokenizer for the embedded default (no model hub needed).

Owns ``build_char_tokenizer``: one token per character of an alphabet plus Qwen's special tokens,
saved as a Hugging Face tokenizer folder (``tokenizer.json`` + ``tokenizer_config.json``) that
``AutoTokenizer.from_pretrained`` and vLLM load like a Qwen tokenizer:

- ``<|im_start|>`` / ``<|im_end|>`` chat turns with a Qwen-style chat template (no system turn
  unless the messages have one), EOS ``<|im_end|>``, PAD ``<|endoftext|>``, no BOS;
- characters outside the alphabet encode to ``<|unk|>`` (Qwen has no unk; a character tokenizer
  needs one), so pass an alphabet that covers your data.

The tokenizer is a BPE model without merges: BPE splits a word into characters before merging,
so with no merges every character is one token, and no pre-tokenizer means spaces and newlines
are ordinary tokens. The ``Fuse`` decoder concatenates tokens, so decode(encode(text)) == text for
text within the alphabet.
"""

from __future__ import annotations

import json
import logging
import os
import string
from typing import Optional

logger = logging.getLogger(__name__)

DEFAULT_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"
"""Digits, ASCII letters, ASCII punctuation (includes ``\\``, ``{`` and ``}`` of ``\\boxed{}``),
space and newline."""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>")
"""Appended after the characters, in this order (Qwen also puts its special tokens last)."""

# Qwen2.5's template without its default system prompt (a tiny model gains nothing from it).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _char_vocab(alphabet: str) -> dict[str, int]:
    """Token -> id: the alphabet's characters in first-seen order, then ``SPECIAL_TOKENS``."""
    chars = list(dict.fromkeys(alphabet))
    if not chars:
        raise ValueError("alphabet is empty")
    vocab = {c: i for i, c in enumerate(chars)}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    return vocab


def _tokenizer_config() -> dict:
    """tokenizer_config.json: special tokens and the chat template, readable by transformers 4 and 5."""
    return {
        # PreTrainedTokenizerFast is understood by transformers 4.x and 5.x alike (5.x also writes
        # TokenizersBackend, which 4.x cannot load).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|unk|>",
        "bos_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        # True would rewrite " ." as "." on decode and break the text round trip.
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }


def build_char_tokenizer(out_dir: str, alphabet: Optional[str] = None):
    """Build a character-level tokenizer, save it to ``out_dir`` and load it back.

    Args:
        out_dir: folder to write ``tokenizer.json`` and ``tokenizer_config.json`` into (created if
            missing; a model folder is fine, vLLM reads the tokenizer from there).
        alphabet: the characters to give one token each; duplicates are ignored. Defaults to
            ``DEFAULT_ALPHABET``.

    Returns:
        The tokenizer as loaded by ``AutoTokenizer.from_pretrained(out_dir)`` (a
        ``PreTrainedTokenizerFast``); ``len(tokenizer)`` is the vocabulary size to build the model
        with (100 for the default alphabet), also logged at INFO level.

    Raises:
        ValueError: if the alphabet is empty.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import AutoTokenizer

    vocab = _char_vocab(DEFAULT_ALPHABET if alphabet is None else alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    tok.decoder = decoders.Fuse()
    # normalized=False: special tokens are matched in the raw text, before the character model.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])

    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(_tokenizer_config(), f, indent=2)
        f.write("\n")

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    assert len(tokenizer) == len(vocab), (len(tokenizer), len(vocab))
    logger.info("character tokenizer in %s: vocab size %d", out_dir, len(tokenizer))
    return tokenizer
