"""Benchmark: Megatron -> vLLM weight sync, seconds per GB, for the tiny Qwen3 and a
Qwen3-0.6B-shaped random model.

Each rank builds a GPTModel (random init) and an in-process `VLLMEngine` started with
``load_format="dummy"`` from a config-only HF folder, then times, over interleaved repeats:

- stream: consuming `iter_hf_weights` alone (TP all-gathers, PP broadcasts, bridge transforms);
- sync:   `sync_weights`, i.e. the stream fed into vLLM's in-place ``reload_weights``.

GB = 1e9 bytes of HF tensors delivered to one engine (the unpadded model in the given dtype).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \
        .venv/bin/python benchmarks/bench_weight_sync.py --dtype float32,bfloat16
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \
        .venv/bin/torchrun --nproc-per-node 2 benchmarks/bench_weight_sync.py --tp 2 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from stapo_megatron.bridge.tiny import tiny_config
from malloc_check import check_jemalloc  # benchmarks/, the script's folder

MODELS = {
    "tiny": tiny_config("qwen3"),
    # Qwen3-0.6B's published architecture; weights are random.
    "qwen3-0.6b-shape": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True,
        attention_bias=False, initializer_range=0.02,
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}),
}


def bench(name: str, dtype: torch.dtype, groups, workdir: str, repeats: int) -> dict:
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.vllm_engine import VLLMEngine
    from stapo_megatron.rollout.weight_sync import iter_hf_weights, sync_weights

    cfg = MODELS[name]
    path = os.path.join(workdir, name)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(dict(cfg, dtype=str(dtype).replace("torch.", "")), f)
    dist.barrier()
    model = build_gpt_model(cfg, params_dtype=dtype, bf16=dtype == torch.bfloat16)
    engine = VLLMEngine(path, RolloutConfig(dtype=str(dtype).replace("torch.", ""), load_format="dummy",
                                            max_model_len=128, kv_cache_memory_bytes=2**26))
    stream_s, sync_s, nbytes = [], [], 0
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        nbytes = sum(t.numel() * t.element_size() for _, t in iter_hf_weights(model, cfg, groups))
        stream_s.append(time.perf_counter() - t0)
        dist.barrier()
        stats = sync_weights(model, cfg, groups, engine)
        assert stats["bytes"] == nbytes
        sync_s.append(stats["seconds"])
    engine.shutdown()
    del model, engine
    gb = nbytes / 1e9
    stream, sync = statistics.median(stream_s), statistics.median(sync_s)
    return dict(model=name, dtype=str(dtype).replace("torch.", ""), gb=gb, stream_s=stream, sync_s=sync,
                stream_s_per_gb=stream / gb, sync_s_per_gb=sync / gb)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,qwen3-0.6b-shape")
    parser.add_argument("--dtype", default="float32", help="comma-separated: float32,bfloat16")
    parser.add_argument("--tp", type=int, default=1, help="Megatron TP (launch with torchrun for > 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # A single process without torchrun is a 1-rank job.
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", LOCAL_RANK="0",
                           WORLD_SIZE="1").items():
        os.environ.setdefault(key, value)
    if os.environ["RANK"] == "0":  # one line per run (every torchrun rank has the same environment)
        check_jemalloc()
    from stapo_megatron.mcore.parallel import destroy_parallel, init_parallel

    groups = init_parallel(args.tp, 1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = [tmp]
        dist.broadcast_object_list(workdir, src=0)  # one folder for all ranks (single machine)
        for name in args.models.split(","):
            for dtype in args.dtype.split(","):
                rows.append(bench(name, getattr(torch, dtype), groups, workdir[0], args.repeats))
                if dist.get_rank() == 0:
                    print(rows[-1], flush=True)
        dist.barrier()
    if dist.get_rank() == 0:
        print(f"\nMegatron TP={args.tp} (world {dist.get_world_size()}), vLLM TP=1 per rank, "
              f"{args.threads} thread(s) per rank, median of {args.repeats}\n")
        print("| model | dtype | GB per engine | stream s | stream s/GB | sync s | sync s/GB |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['model']} | {r['dtype']} | {r['gb']:.4f} | {r['stream_s']:.3f} | {r['stream_s_per_gb']:.2f} "
                  f"| {r['sync_s']:.3f} | {r['sync_s_per_gb']:.2f} |")
    destroy_parallel()


if __name__ == "__main__":
    main()
