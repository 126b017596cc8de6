"""The per-GPU memory table of the paper recipes in docs/recipes.md, from `recipes.memory.memory_estimate`.

    python scripts/memory_table.py            # rewrite the block in docs/recipes.md
    python scripts/memory_table.py --print    # print it

The block sits between ``<!-- memory-table:begin -->`` and ``<!-- memory-table:end -->``;
`tests/recipes/test_paper.py` fails when it differs from what this script writes (so a change to a
layout or to the memory model cannot leave the page behind).
"""

from __future__ import annotations

import argparse
import os
import re

from stapo_megatron.recipes import memory, paper

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "recipes.md")
BEGIN, END = "<!-- memory-table:begin -->", "<!-- memory-table:end -->"
COLUMNS = ("weights", "grads", "optimizer", "activations", "logits", "overhead", "training", "vllm")


def table() -> str:
    """The markdown table, one row per paper recipe (STAPO; GRPO adds its reference model)."""
    rows = ["| recipe | nodes x GPUs | TP / PP / CP / EP / DP | sequence, recompute | vLLM TP, share | "
            + " | ".join(COLUMNS) + " | **total** | GRPO total (+ reference) | KV cache per engine |",
            "| --- " * (len(COLUMNS) + 8) + "|"]
    for size in paper.LAYOUTS:
        spec = paper.ARCHITECTURES[size]
        layout = paper.layout_for(size, paper.paper_recipe(size))
        est = memory.memory_estimate(spec, layout)
        gb = est.as_gb()
        grpo_cfg = paper.paper_recipe(size, "grpo")
        grpo = memory.memory_estimate(spec, paper.layout_for(size, grpo_cfg))
        tokens = est.vllm_kv_tokens
        seq_k = layout.seq_len // 1024
        rows.append(
            f"| `{size}` | {layout.num_nodes} x {layout.gpus_per_node} | {layout.tensor_model_parallel_size} / "
            f"{layout.pipeline_model_parallel_size} / {layout.context_parallel_size} / "
            f"{layout.expert_model_parallel_size} / {layout.data_parallel_size} | "
            f"{seq_k}k, {layout.recompute_granularity or 'none'} | "
            f"{layout.vllm_tensor_parallel_size}, {layout.vllm_gpu_memory_utilization} | "
            + " | ".join(f"{gb[c]:.1f}" for c in COLUMNS)
            + f" | **{gb['total']:.1f}** | {grpo.total / memory.GB:.1f} (vLLM {grpo_cfg.rollout.gpu_memory_utilization}) | "
            f"{tokens / 1000:.0f}k tokens ({tokens // layout.seq_len} x {seq_k}k) |")
    return "\n".join(rows)


def block() -> str:
    return f"{BEGIN}\n{table()}\n{END}"


def rewrite(path: str = PAGE) -> bool:
    """Replace the page's block with the current one; whether it changed."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path} has no {BEGIN} ... {END} block")
    new = pattern.sub(lambda _: block(), text)
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--print", action="store_true", help="print the table instead of rewriting docs/recipes.md")
    if parser.parse_args().print:
        print(table())
    else:
        print("docs/recipes.md memory table", "rewritten" if rewrite() else "already current")
