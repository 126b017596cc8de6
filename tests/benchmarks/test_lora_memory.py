"""benchmarks/lora_memory.py: the memory model's weights, gradients and optimizer state equal the
bytes a real bf16 Megatron run holds, with LoRA and with full fine-tuning, and the harness's
live-bytes counter counts what was created and frees what was freed."""

import os
import sys

import pytest
import torch

from tests.helpers import REPO_DIR

sys.path.insert(0, os.path.join(REPO_DIR, "benchmarks"))

import lora_memory as bench  # noqa: E402

SEQ_LEN, RANK = 64, 8


def test_live_bytes_counts_new_storages_until_they_are_freed():
    keep = torch.zeros(10)
    live = bench.LiveTensorBytes()
    with live:
        a = torch.ones(256)                  # 1024 bytes
        b = torch.ones(128, dtype=torch.float64)  # 1024 bytes
        view = a[:10]                        # a view: no new storage
        del b
        c = keep + 1                         # 40 bytes
    assert (live.peak, live.current) == (2048, 1064)
    del a, view, c
    assert live.current == 0


@pytest.mark.slow  # two bf16 Megatron runs of two updates each
def test_the_models_training_state_is_the_runs(parallel):
    spec = bench.benchmark_spec(num_layers=2, hidden_size=64, vocab_size=512)
    full = bench.measure(parallel, spec, SEQ_LEN, 0)
    lora = bench.measure(parallel, spec, SEQ_LEN, RANK)
    for got, rank in ((full, 0), (lora, RANK)):
        est = bench.modelled(spec, SEQ_LEN, rank)
        # exact: bf16 weights, fp32 gradient buffer, fp32 master + Adam moments of what trains
        # (the fp32 norm weights at their real size, the buffers' alignment: `modelled_state`)
        assert got["state"] == bench.modelled_state(est, got, bool(rank))
        assert got["fp32_base_params"] == 2 * (64 + 16 + 16 + 64) + 64  # the RMSNorms: 2 per layer, q/k (head dim 16), final
    assert lora["state"] < full["state"] / 4  # the frozen base: 2 bytes a parameter against 18
    # the frozen base computes no weight gradients and its optimizer updates only the adapters
    assert lora["backward_peak"] < full["backward_peak"]
    assert lora["optimizer_peak"] < full["optimizer_peak"] / 4
    # the CPU keeps at least what the GPU model counts (its attention keeps scores, its loss a softmax)
    est = bench.modelled(spec, SEQ_LEN, RANK)
    assert lora["backward_peak"] >= est.activations + est.logits
