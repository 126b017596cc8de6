"""Context parallelism: activation memory per CP rank of one long sequence (CPU, exact), and the
local-spec CP attention kernel's time for one rank's chunks (``--device cuda``).

Memory (default): one packed sequence of ``--tokens`` tokens through a small Qwen3-shaped GPT
(local spec, `SDPAttention`, fp32) and the STAPO per-token statistics (log-prob, entropy) at
CP = 1, 2, 4 (``--cp``), one gloo process per CP rank. Every tensor autograd saves for backward
during the forward is counted with ``torch.autograd.graph.saved_tensors_hooks`` (bytes of the
distinct storages, parameters excluded): deterministic, no timing. Reported per CP size: the
largest rank's bytes and their ratio to CP=1, and the same without the causal masks the CPU
path materialises (fp32 [c, keys] per later chunk and layer, kept by torch's CPU SDPA; O(T^2 /
CP), absent on CUDA where the flash dispatch takes none). The all-gather CP keeps the whole
sequence's K and V per layer (Llama 3's trade-off), so the ratio is a little above 1/CP.

Kernel time (``--device cuda``, one GPU, no process group): CP rank r's attention -- its two
chunks of the sequence against the keys they see, `bridge.attention.chunk_attention` on the
whole K/V as the all-gather would give it -- vs the causal attention of the whole sequence
(CP=1), bf16, CUDA events, median of ``--repeats``; ideal per rank: 1/CP of the whole. It times
the kernel only: no all-gather, which one GPU cannot show.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_context_parallel.py --tokens 8192
    PYTHONPATH=. .venv/bin/python benchmarks/bench_context_parallel.py --device cuda --tokens 32768
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics

import torch
import torch.multiprocessing as mp

from stapo_megatron.utils import free_port, local_rank_env

VOCAB = 2048


def _config(cp: int):
    from stapo_megatron.recipes.synthetic import tiny_gpt_config

    # Qwen3-like proportions at a CPU-sized width: 8 heads of 64, 2 KV groups, SwiGLU 3x
    base = tiny_gpt_config(1, 1, num_layers=2, hidden_size=512, num_attention_heads=8, num_query_groups=2,
                           kv_channels=64, ffn_hidden_size=1536)
    return dataclasses.replace(base, context_parallel_size=cp)


def _saved_bytes(fn, exclude) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn()`` runs."""
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _memory_rank(rank: int, cp: int, tokens: int, port: int, queue) -> None:
    os.environ.update(local_rank_env(rank, cp, port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from stapo_megatron.batch.context_parallel import split_for_context_parallel
    from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy
    from stapo_megatron.batch.packing import pack_thd
    from stapo_megatron.mcore.parallel import destroy_parallel, init_parallel
    from stapo_megatron.batch.records import record
    from stapo_megatron.mcore.schedule import packed_seq_params
    from stapo_megatron.recipes.synthetic import build_tiny_gpt

    groups = init_parallel(1, 1, context_parallel_size=cp)
    model = build_tiny_gpt(_config(cp), VOCAB, tokens, core_attention="sdpa")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, VOCAB, (64,), generator=gen).tolist()
    response = torch.randint(1, VOCAB, (tokens - 64,), generator=gen).tolist()
    whole = pack_thd([record(prompt, response, 1.0, [-1.0] * len(response))], 0, align=2 * cp,
                     seq_align=2 * cp)
    batch = split_for_context_parallel(whole, cp, dist.get_rank(groups.cp) if cp > 1 else 0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def forward():
        logits = model(batch.tokens, batch.position_ids, attention_mask=None, packed_seq_params=packed_seq_params(batch))
        logprob, entropy = vocab_parallel_logprob_entropy(logits, batch.labels)
        torch.where(batch.response_mask, logprob, 0.0).sum().backward()  # the graph is complete and runs

    # The CPU reference path materialises each later chunk's lower-right causal mask, which
    # torch's CPU SDPA keeps for backward as fp32 [c, keys] (measured; CUDA's flash dispatch
    # takes none): counted here to report it apart.
    rank_cp, c = (dist.get_rank(groups.cp) if cp > 1 else 0), tokens // (2 * cp)
    chunks = (rank_cp, 2 * cp - 1 - rank_cp) if cp > 1 else ()
    mask = sum(c * (k + 1) * c * 4 for k in chunks if k > 0) * model.config.num_layers
    queue.put((rank, _saved_bytes(forward, params), batch.tokens.shape[1], mask))
    destroy_parallel()


def memory(tokens: int, sizes) -> list:
    rows, base = [], None
    for cp in sizes:
        port = free_port()
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_memory_rank, args=(r, cp, tokens, port, queue)) for r in range(cp)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=1800) for _ in procs]
        for p in procs:
            p.join()
        _, peak, local, mask = max(results, key=lambda r: r[1])
        base = base or peak
        rows.append(dict(cp=cp, tokens_per_rank=local, saved_mib=round(peak / 2**20, 1),
                         ratio_to_cp1=round(peak / base, 3), cpu_mask_mib=round(mask / 2**20, 1),
                         ratio_without_cpu_mask=round((peak - mask) / base, 3), ideal=round(1 / cp, 3)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def kernel_time(tokens: int, sizes, repeats: int) -> list:

    from stapo_megatron.bridge.attention import chunk_attention
    from stapo_megatron.batch.context_parallel import local_positions

    heads, groups, dim = 32, 8, 128  # Qwen3-8B's attention shape
    dev, dtype = torch.device("cuda"), torch.bfloat16
    q, k, v = (torch.randn(tokens, h, dim, device=dev, dtype=dtype) for h in (heads, groups, groups))
    cu = torch.tensor([0, tokens], dtype=torch.int32)

    def sdpa(q_, k_, v_, mask, is_causal):
        rep = heads // groups
        return torch.nn.functional.scaled_dot_product_attention(
            q_, k_.repeat_interleave(rep, 1), v_.repeat_interleave(rep, 1), mask, 0.0, is_causal)

    def timed(fn) -> float:
        times = []
        for _ in range(repeats + 2):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        return statistics.median(times[2:])

    whole = timed(lambda: sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, True))
    rows = []
    for cp in sizes:
        for rank in range(cp):
            idx = local_positions(cu, cp, rank).to(dev)
            ms = timed(lambda: chunk_attention(sdpa, q[idx], k, v, cu, cp, rank))
            rows.append(dict(cp=cp, rank=rank, ms=round(ms, 3), whole_ms=round(whole, 3), ratio=round(ms / whole, 3)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if args.device == "cuda":
        kernel_time(args.tokens, args.cp, args.repeats)
    else:
        memory(args.tokens, args.cp)


if __name__ == "__main__":
    main()
