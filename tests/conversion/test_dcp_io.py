"""Tier a: the torch_dist checkpoint the converter writes: its files and the keys and shapes its
reader finds."""

import json
import os

import torch

from stapo_megatron.conversion.dcp_io import CheckpointReader
from tests.helpers.conversion_cli import _roundtrip


def test_checkpoint_layout(tmp_path):
    _, ckpt, _ = _roundtrip(tmp_path, "qwen3")
    tensors = CheckpointReader(ckpt).tensors()
    # Per-layer tensors are stacked on a leading layer axis; vocabulary padded to 128 (TP=1).
    assert tuple(tensors["decoder.layers.self_attention.linear_qkv.weight"].size) == (4, (4 + 2 * 2) * 32, 64)
    assert tuple(tensors["decoder.layers.mlp.linear_fc1.weight"].size) == (4, 2 * 96, 64)
    assert tuple(tensors["embedding.word_embeddings.weight"].size) == (384, 64)
    padded = CheckpointReader(ckpt).read({"embedding.word_embeddings.weight": ((300, 0), (84, 64))})
    assert torch.all(padded["embedding.word_embeddings.weight"] == 0)
    for name in ("config.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(ckpt, "hf", name))
    with open(os.path.join(ckpt, "stapo_conversion.json")) as f:
        assert json.load(f)["padded_vocab_size"] == 384
