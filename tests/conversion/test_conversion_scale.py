"""Tier a: conversion at scale (issue 36 item 9). `stapo-convert verify` starts TP x PP x EP
processes on one host: their memory is estimated first and a layout that does not fit is refused
before any rank starts; a rank the kernel kills is named with its signal; `hf-to-mcore` checks
``--ep`` as `verify` does."""

import json
import multiprocessing
import os
import signal
import time

import psutil
import pytest

from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from stapo_megatron.conversion import verify
from stapo_megatron.conversion.cli import main
from stapo_megatron.bridge.hf_config import num_params
from stapo_megatron.recipes.paper import QWEN3_30B_A3B

GIB = 2**30


def test_host_memory_estimate_of_a_30b_a3b_verify():
    """TP=4 x EP=4: 16 ranks; the dense weights on each of the 4 EP ranks of a TP x PP group
    (4 replicas), the experts once; fp32, twice (model and read buffer)."""
    spec = QWEN3_30B_A3B
    experts = 48 * 128 * 3 * 2048 * 768
    dense = num_params(spec) - experts
    assert experts == 28_991_029_248 and 1.0e9 < dense < 2.0e9
    assert verify.host_bytes_needed(spec, [(4, 1)], 4) == 16 * 0.75 * GIB + 8 * (4 * dense + experts)
    # EP 1 at TP 4: 4 ranks, one copy of everything
    assert verify.host_bytes_needed(spec, [(4, 1)], 1) == 4 * 0.75 * GIB + 8 * (dense + experts)
    # ranks on GPUs: only their host-side overhead
    assert verify.host_bytes_needed(spec, [(4, 1)], 4, weights_on_host=False) == 12 * GIB
    with pytest.raises(ValueError, match=r"verify needs 16 processes on this host, about 12.0 GiB .* and 8.00 GiB "
                                         r"is available: verify at a smaller --tp/--ep"):
        verify.check_host_memory(12 * GIB, 8 * GIB, 16)
    verify.check_host_memory(8 * GIB, 8 * GIB, 16)  # fits: no error


def test_verify_refuses_a_layout_that_does_not_fit_before_starting_ranks(capsys, tmp_path):
    """A Qwen3-30B-A3B-shaped config.json (no weights needed: the check comes first)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    cfg = dict(tiny_config("qwen3-moe"), hidden_size=2048, num_hidden_layers=48, num_experts=128,
               num_experts_per_tok=8, moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4,
               head_dim=128, vocab_size=151936, intermediate_size=6144)
    (hf / "config.json").write_text(json.dumps(cfg))
    needed = verify.host_bytes_needed(QWEN3_30B_A3B, [(4, 1)], 4)
    if psutil.virtual_memory().available >= needed:
        pytest.skip(f"this host has more than {needed / GIB:.0f} GiB available")
    assert main(["verify", "--hf-dir", str(hf), "--ckpt", str(tmp_path / "none"), "--tp", "4", "--ep", "4"]) == 2
    err = capsys.readouterr().err
    assert "verify needs 16 processes on this host" in err and "smaller --tp/--ep" in err, err


def _sleep():
    time.sleep(60)


def test_a_killed_rank_is_named_with_its_signal():
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_sleep) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(timeout=30)
        assert verify.killed_ranks(procs) == ["rank 1: killed by SIGKILL"]
        rank, status, message = verify._next_result(ctx.Queue(), procs, timeout=30)
        assert (rank, status) == (-1, "error") and message.startswith("rank 1: killed by SIGKILL (out of host memory?")
    finally:
        for p in procs:
            p.kill()
            p.join()


def test_hf_to_mcore_checks_ep(capsys, tmp_path):
    moe, dense = str(tmp_path / "moe"), str(tmp_path / "dense")
    save_tiny_hf_model(moe, "qwen3-moe")  # 4 experts
    save_tiny_hf_model(dense, "qwen3")
    assert main(["hf-to-mcore", "--hf-dir", moe, "--out", str(tmp_path / "a"), "--ep", "3"]) == 2
    assert "expert_model_parallel_size 3 does not divide num_moe_experts (num_experts) 4" in capsys.readouterr().err
    assert main(["hf-to-mcore", "--hf-dir", dense, "--out", str(tmp_path / "b"), "--ep", "2"]) == 2
    assert "expert_model_parallel_size 2 needs a MoE model" in capsys.readouterr().err
    assert main(["hf-to-mcore", "--hf-dir", moe, "--out", str(tmp_path / "c"), "--ep", "2"]) == 0
    with open(tmp_path / "c" / "stapo_conversion.json") as f:
        assert json.load(f)["expert_model_parallel_size"] == 2
