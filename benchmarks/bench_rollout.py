"""Benchmark: rollout tokens/s of the in-process vLLM engine vs HF ``generate``.

Same HF folder (random weights, fp32, no EOS so every sequence runs to max_tokens: the case
most favourable to HF, which keeps stepping finished sequences), same prompts, same sampling
(T=1, top-p 1, n samples per prompt), one process, one torch thread (the trainer runs one rank
per core). vLLM goes through `VLLMEngine.generate`, i.e. with the
sampler's log-probs returned; HF through ``model.generate(num_return_sequences=n)`` with
the KV cache. Rounds interleave the two after one warm-up call each; medians are reported.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \
        .venv/bin/python benchmarks/bench_rollout.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from stapo_megatron.bridge.tiny import tiny_config
from malloc_check import check_jemalloc  # benchmarks/, the script's folder

# The bridge's tiny Qwen3 test model (with a longer position range) and a wider sibling, where
# per-token compute starts to matter.
MODELS = {
    "tiny": dict(tiny_config("qwen3"), max_position_embeddings=4096),
    "small": dict(tiny_config("qwen3"), hidden_size=256, intermediate_size=768, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=4096, max_position_embeddings=4096),
}


def save_model(path: str, name: str) -> None:
    """Random weights at HF's init (speed does not depend on the values), fp32, no EOS."""
    import transformers

    cfg = {k: v for k, v in MODELS[name].items() if k not in ("architectures", "model_type")}
    config = transformers.Qwen3Config(**cfg)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def hf_round(model, prompts_BS: torch.Tensor, n: int, max_tokens: int) -> int:
    with torch.no_grad():
        out = model.generate(prompts_BS, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             num_return_sequences=n, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             pad_token_id=0)
    return (out.shape[1] - prompts_BS.shape[1]) * out.shape[0]


def vllm_round(engine, prompts: list, n: int, max_tokens: int, seed: int) -> int:
    samples = engine.generate(prompts, n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=seed)
    return sum(len(s.token_ids) for group in samples for s in group)


def bench(name: str, args) -> list[dict]:
    """All lengths of one model: one HF model and one engine, interleaved timed rounds."""
    import transformers

    from stapo_megatron.rollout.config import RolloutConfig

    from stapo_megatron.rollout.vllm_engine import VLLMEngine

    path = os.path.join(args.workdir, name)
    save_model(path, name)
    lengths = [int(x) for x in args.max_tokens.split(",")]
    vocab = MODELS[name]["vocab_size"]
    prompts_BS = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    engine = VLLMEngine(path, RolloutConfig(dtype="float32", max_model_len=args.prompt_len + max(lengths),
                                            kv_cache_memory_bytes=2**28))
    startup = time.perf_counter() - t0
    prompts = prompts_BS.tolist()
    hf_round(hf, prompts_BS[:2], 2, 4)  # warm-up
    vllm_round(engine, prompts[:2], 2, 4, seed=0)
    rows = []
    for max_tokens in lengths:
        hf_s, vllm_s = [], []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            hf_tokens = hf_round(hf, prompts_BS, args.n, max_tokens)
            hf_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            vllm_tokens = vllm_round(engine, prompts, args.n, max_tokens, seed=r)
            vllm_s.append(time.perf_counter() - t0)
        assert hf_tokens == vllm_tokens == args.prompts * args.n * max_tokens, (hf_tokens, vllm_tokens)
        hf_tps, vllm_tps = hf_tokens / statistics.median(hf_s), vllm_tokens / statistics.median(vllm_s)
        rows.append(dict(model=name, params=sum(p.numel() for p in hf.parameters()), max_tokens=max_tokens,
                         tokens=vllm_tokens, hf_tps=hf_tps, vllm_tps=vllm_tps, speedup=vllm_tps / hf_tps,
                         startup=startup))
        print(rows[-1], flush=True)
    engine.shutdown()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", default="64,256", help="comma-separated response lengths")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    check_jemalloc()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        args.workdir = args.workdir or tmp
        rows = [row for name in args.models.split(",") for row in bench(name, args)]
    print(f"\n{args.prompts} prompts x {args.prompt_len} tokens, n={args.n}, T=1, top-p 1, "
          f"{args.threads} thread(s), median of {args.rounds} interleaved rounds\n")
    print("| model | params | new tokens / sequence | tokens / round | HF generate tok/s | vLLM engine tok/s "
          "| speedup | vLLM startup s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['max_tokens']} | {r['tokens']} | {r['hf_tps']:.0f} "
              f"| {r['vllm_tps']:.0f} | {r['speedup']:.1f}x | {r['startup']:.1f} |")


if __name__ == "__main__":
    main()
