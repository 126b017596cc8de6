"""Benchmark `stapo-convert` on a random Qwen3-0.6B-shaped bf16 checkpoint (~1.2 GB) or on
Qwen3-14B-shaped tensors.

Writes the HF checkpoint locally (random weights, streamed, no hub), then in the same run and
on the same files times ``cp -r`` and the two conversions, each as a child process, and reads
each child's peak RSS from ``wait4``. Goals: hf-to-mcore <= 2.5x the copy time and
peak RSS <= 0.5x the checkpoint size.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \\
        .venv/bin/python benchmarks/bench_conversion.py [--workdir /tmp/bench_conversion] [--repeats 3]
        [--model qwen3-14b --num-layers 4]

The page cache is warm for every run (the copy runs first and all commands read the same
files), so the numbers compare the work done, not the disk. ``cp`` copies with
copy_file_range (inside the kernel, no user-space pass over the bytes); ``dd bs=16M`` is the
user-space floor any converter shares (read every byte into memory, write it out).
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

from stapo_megatron.conversion.safetensors_io import ShardWriter  # noqa: E402
from stapo_megatron.bridge import hf_shapes, spec_from_hf_config  # noqa: E402
from malloc_check import check_jemalloc  # noqa: E402 (benchmarks/, the script's folder)

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "tie_word_embeddings": True, "vocab_size": 151936,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "dtype": "bfloat16",
}
# Qwen3-14B(-Base) shapes: untied, 40 heads / 8 KV groups, ffn 17408 (use --num-layers to keep
# the file small: memory depends on the largest tensors, not on the layer count).
QWEN3_14B = dict(QWEN3_0_6B, hidden_size=5120, intermediate_size=17408, num_attention_heads=40,
                 num_hidden_layers=40, num_key_value_heads=8, tie_word_embeddings=False)
MODELS = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-14b": QWEN3_14B}


def make_checkpoint(hf_dir: str, config: dict = QWEN3_0_6B) -> int:
    """Random bf16 weights of the model's shapes, written tensor by tensor; returns bytes."""
    os.makedirs(hf_dir, exist_ok=True)
    shapes = hf_shapes(spec_from_hf_config(config))
    writer = ShardWriter(os.path.join(hf_dir, "model.safetensors"),
                         [(n, torch.bfloat16, s) for n, s in shapes.items()])
    gen = torch.Generator().manual_seed(0)
    for shape in shapes.values():
        writer.write(torch.randn(shape, generator=gen).to(torch.bfloat16))
    writer.close()
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return writer.total


# Runs inside the child: separates interpreter + import time from the conversion itself.
_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from stapo_megatron.conversion.cli import main
t1 = time.perf_counter()
code = main(sys.argv[1:])
print(json.dumps({"import_s": t1 - t0, "convert_s": time.perf_counter() - t1}))
sys.exit(code)
"""


def timed(argv: list[str]) -> dict:
    """Wall seconds and peak RSS of one command, plus the child's own split for conversions.

    GNU time forks a small process that execs the command, so its %M is the command's own peak
    RSS (os.wait4 on a child forked from this big process would report at least our RSS).
    """
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "maxrss_kb=%M", *argv], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{argv} exited with {proc.returncode}: {proc.stderr[-2000:]}")
    rss_kb = int(proc.stderr.rsplit("maxrss_kb=", 1)[1].split()[0])
    result = {"wall_s": wall, "rss": rss_kb * 1024}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if lines:
        result.update(json.loads(lines[-1]))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="/tmp/bench_conversion")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", choices=MODELS, default="qwen3-0.6b")
    p.add_argument("--num-layers", type=int, help="override the layer count (smaller file, same tensors)")
    args = p.parse_args()
    check_jemalloc()  # the timed commands inherit this process's environment
    config = dict(MODELS[args.model])
    if args.num_layers:
        config["num_hidden_layers"] = args.num_layers
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hf, copy, ckpt, back = (os.path.join(args.workdir, n) for n in ("hf", "copy", "ckpt", "back"))
    shutil.rmtree(args.workdir, ignore_errors=True)
    size = make_checkpoint(hf, config)
    cli = [sys.executable, "-c", _CHILD]
    os.chdir(root)
    runs = {"cp -r": [], "cp -r + sync": [], "dd bs=16M": [], "hf-to-mcore": [], "mcore-to-hf": []}
    src = os.path.join(hf, "model.safetensors")
    for _ in range(args.repeats):
        for name, argv, out in (
            ("cp -r", ["cp", "-r", hf, copy], copy),
            ("cp -r + sync", ["sh", "-c", f"cp -r {hf} {copy} && sync {copy}/model.safetensors"], copy),
            # A user-space copy (what any converter must at least do: read into memory, write out).
            ("dd bs=16M", ["sh", "-c", f"mkdir {copy} && dd if={src} of={copy}/m bs=16M status=none"], copy),
            ("hf-to-mcore", cli + ["hf-to-mcore", "--hf-dir", hf, "--out", ckpt], ckpt),
            ("mcore-to-hf", cli + ["mcore-to-hf", "--ckpt", ckpt, "--out", back], back),
        ):
            shutil.rmtree(out, ignore_errors=True)
            runs[name].append(timed(argv))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    cp, cps = med["cp -r"]["wall_s"], med["cp -r + sync"]["wall_s"]
    print(f"checkpoint: {size / 1e9:.3f} GB bf16 ({args.model} shapes, {config['num_hidden_layers']} layers, "
          f"tied={config['tie_word_embeddings']}); medians of {args.repeats} runs")
    print(f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')} nproc={os.cpu_count()} torch={torch.__version__}\n")
    print("| command | wall s | x cp -r | x cp -r + sync | of which import s | conversion s | conversion x cp -r "
          "| peak RSS MB | RSS / checkpoint |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, m in med.items():
        conv = m.get("convert_s")
        print(f"| {name} | {m['wall_s']:.2f} | {m['wall_s'] / cp:.2f} | {m['wall_s'] / cps:.2f} | "
              f"{m.get('import_s', 0):.2f} | {'' if conv is None else f'{conv:.2f}'} | "
              f"{'' if conv is None else f'{conv / cp:.2f}'} | {max(r['rss'] for r in runs[name]) / 1e6:.0f} | "
              f"{max(r['rss'] for r in runs[name]) / size:.2f} |")
    print("\nall runs, wall s:", {k: [round(r["wall_s"], 2) for r in rs] for k, rs in runs.items()})
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
