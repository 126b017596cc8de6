"""Benchmark `stapo-convert` on a random Qwen3-0.6B-shaped bf16 checkpoint (~1.2 GB).

Writes the HF checkpoint locally (random weights, streamed, no hub), then in the same run and
on the same files times ``cp -r`` and the two conversions, each as a child process, and reads
each child's peak RSS from ``wait4``. Goals (issue 3): hf-to-mcore <= 2.5x the copy time and
peak RSS <= 0.5x the checkpoint size.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \\
        .venv/bin/python benchmarks/bench_conversion.py [--workdir /tmp/bench_conversion] [--repeats 3]

The page cache is warm for every run (the copy runs first and all commands read the same
files), so the numbers compare the work done, not the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conversion.safetensors_io import ShardWriter  # noqa: E402
from stapo_megatron.bridge import hf_shapes, spec_from_hf_config  # noqa: E402

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "tie_word_embeddings": True, "vocab_size": 151936,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "dtype": "bfloat16",
}


def make_checkpoint(hf_dir: str) -> int:
    """Random bf16 weights of the Qwen3-0.6B shapes, written tensor by tensor; returns bytes."""
    os.makedirs(hf_dir, exist_ok=True)
    shapes = hf_shapes(spec_from_hf_config(QWEN3_0_6B))
    writer = ShardWriter(os.path.join(hf_dir, "model.safetensors"),
                         [(n, torch.bfloat16, s) for n, s in shapes.items()])
    gen = torch.Generator().manual_seed(0)
    for shape in shapes.values():
        writer.write(torch.randn(shape, generator=gen).to(torch.bfloat16))
    writer.close()
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(QWEN3_0_6B, f, indent=2)
    return writer.total


def timed(argv: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{argv} exited with {proc.returncode}")
    return elapsed, usage.ru_maxrss * 1024  # Linux reports KiB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="/tmp/bench_conversion")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hf, copy, ckpt, back = (os.path.join(args.workdir, n) for n in ("hf", "copy", "ckpt", "back"))
    shutil.rmtree(args.workdir, ignore_errors=True)
    size = make_checkpoint(hf)
    cli = [sys.executable, "-m", "conversion.cli"]
    os.chdir(root)
    runs = {"cp -r": [], "cp -r + sync": [], "hf-to-mcore": [], "mcore-to-hf": []}
    for _ in range(args.repeats):
        for name, argv, out in (
            ("cp -r", ["cp", "-r", hf, copy], copy),
            ("cp -r + sync", ["sh", "-c", f"cp -r {hf} {copy} && sync {copy}/model.safetensors"], copy),
            ("hf-to-mcore", cli + ["hf-to-mcore", "--hf-dir", hf, "--out", ckpt], ckpt),
            ("mcore-to-hf", cli + ["mcore-to-hf", "--ckpt", ckpt, "--out", back], back),
        ):
            shutil.rmtree(out, ignore_errors=True)
            runs[name].append(timed(argv))
    cp_time = statistics.median(t for t, _ in runs["cp -r"])
    print(f"checkpoint: {size / 1e9:.3f} GB bf16 (Qwen3-0.6B shapes, tied), {args.repeats} runs, medians")
    print(f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')} nproc={os.cpu_count()} torch={torch.__version__}\n")
    print("| command | wall s | x cp -r | peak RSS MB | RSS / checkpoint |")
    print("| --- | --- | --- | --- | --- |")
    for name, vals in runs.items():
        t = statistics.median(v[0] for v in vals)
        rss = max(v[1] for v in vals)
        print(f"| {name} | {t:.2f} | {t / cp_time:.2f} | {rss / 1e6:.0f} | {rss / size:.2f} |")
    print("\nall runs (s):", {k: [round(v[0], 2) for v in vals] for k, vals in runs.items()})
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
