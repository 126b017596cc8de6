"""The paper's setups: Qwen3-1.7B/8B/14B-Base, JustRL hyperparameters + S2T, on 80 GB GPUs.

``qwen3_1p7b``, ``qwen3_8b`` and ``qwen3_14b`` return the trainer's `TrainerConfig` for
DAPO-Math-17k (paths are the user's: ``data.train_path`` / ``data.eval_path``), with the method
as a one-word switch (a name of `stapo_megatron.method.registry.METHODS`, `method_loss`).

Each size has a `Layout` (nodes, TP/PP/DP, vLLM TP and memory share, micro-batch, recompute,
sequence parallelism) chosen with `memory_estimate`, the written per-GPU memory model of
`stapo_megatron.recipes.memory` (its assumptions are in the function's docstring). Context parallelism stays 1: the STAPO
loss path here (``ops.vocab_parallel_logprob_entropy``, the S2T mini-batch quantile and the
packing in ``batching.py``) assumes every rank of a TP group holds whole sequences, so long
sequences are handled with sequence parallelism + full activation recomputation instead.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from stapo_megatron.bridge.config import QwenSpec
from stapo_megatron.config import DataConfig, LossConfig, ModelConfig, OptimConfig, RolloutSampling, TrainerConfig
from stapo_megatron.data.examples import JUSTRL_PROMPT_TEMPLATE
from stapo_megatron.method.config import method_loss_config
from stapo_megatron.recipes.memory import (
    GB, GPU_MEMORY_BYTES, MAX_PROMPT_LEN, MAX_RESPONSE_LEN, SEQ_LEN, Layout, memory_estimate,
)


def _qwen3(num_layers, hidden, heads, ffn, tied) -> QwenSpec:
    """A Qwen3 base model as in its HF config.json (8 KV heads, head_dim 128, 151936 tokens)."""
    return QwenSpec(
        architecture="Qwen3ForCausalLM", num_layers=num_layers, hidden_size=hidden,
        ffn_hidden_size=ffn, num_attention_heads=heads, num_query_groups=8, kv_channels=128,
        vocab_size=151936, max_position_embeddings=32768, rotary_base=1_000_000.0,
        layernorm_epsilon=1e-6, add_qkv_bias=False, qk_layernorm=True, tie_word_embeddings=tied,
        init_method_std=0.02,
    )


ARCHITECTURES: Dict[str, QwenSpec] = {
    "qwen3_1p7b": _qwen3(28, 2048, 16, 6144, tied=True),
    "qwen3_8b": _qwen3(36, 4096, 32, 12288, tied=False),
    "qwen3_14b": _qwen3(40, 5120, 40, 17408, tied=False),
}
"""Qwen3-{1.7B,8B,14B}-Base architectures (the training memory model and consistency checks
use them; the trainer itself reads the architecture from ``model.hf_dir``)."""
DISPLAY_NAMES = {"qwen3_1p7b": "Qwen3-1.7B-Base", "qwen3_8b": "Qwen3-8B-Base", "qwen3_14b": "Qwen3-14B-Base"}
"""The HF model each recipe starts from."""


LAYOUTS: Dict[str, Layout] = {
    # 2 nodes: TP=2 halves the 151936-wide logits and their gradient (5 GB instead of 10 GB at TP=1).
    "qwen3_1p7b": Layout(num_nodes=2, tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                         vllm_tensor_parallel_size=2, vllm_gpu_memory_utilization=0.55),
    # 4 nodes: TP=4 (at TP=2 training and vLLM's share exceed the budget); README's memory table
    # (scripts/memory_table.py) gives the components.
    "qwen3_8b": Layout(num_nodes=4, tensor_model_parallel_size=4, pipeline_model_parallel_size=1,
                       vllm_tensor_parallel_size=4, vllm_gpu_memory_utilization=0.5),
    # 8 nodes (the design's target): TP=4 within a node, PP=1, DP=16; one vLLM TP=4 engine per
    # TP group (KV cache per engine: README's memory table).
    # GRPO's reference model (+7.4 GB) fits beside the same vLLM share (the logits cost 4 B per
    # entry with the Triton op, measured on the H100: benchmarks/RESULTS.md).
    "qwen3_14b": Layout(num_nodes=8, tensor_model_parallel_size=4, pipeline_model_parallel_size=1,
                        vllm_tensor_parallel_size=4, vllm_gpu_memory_utilization=0.4),
}
"""The parallel layout of each paper recipe (see `memory_estimate` and the README table)."""


# -- recipes ----------------------------------------------------------------------------------


def method_loss(method: str) -> LossConfig:
    """The loss of each method, everything else equal (the paper's comparison).

    The shared constants (clip 0.2/0.28, dual clip c = 10 as JustRL sets it on veRL, no KL,
    tau_p 0.002, q 0.75, rho 0.2, T 1.0, tau_H from the current weights before each mini-batch
    as Algorithm 1 does: ``tau_h_source="exact"``), then the method's own
    ``Method.loss_options`` (`stapo_megatron.method.registry.method_loss_config`). stapo: S2T with tau_p
    0.002 and q 0.75; justrl: the JustRL/DAPO objective without a mask; grpo: DeepSeekMath GRPO
    (symmetric clip 0.2, no dual clip, k3 KL with beta 0.04, per-sequence mean); entropy20: keep
    the 20% highest-entropy response tokens; random: silence as many S2T candidates, drawn at
    random, as S2T would (same tau_p / q to count them); random_uniform: as many random response
    tokens.
    """
    return method_loss_config(method, **PAPER_LOSS)


PAPER_LOSS = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0, kl_coef=0.0, tau_p=0.002,
                  entropy_quantile=0.75, entropy_top_fraction=0.2, temperature=1.0, tau_h_source="exact")
"""The `LossConfig` values every method of the paper's comparison shares (`method_loss`)."""
TRAIN_STEPS = 3000
"""Training steps of a paper run (JustRL's schedule)."""
EVAL_EVERY = 20
"""Held-out evaluation every this many training steps."""
EVAL_MAX_RESPONSE_LEN = 20480
"""Maximum response tokens at evaluation (training: `MAX_RESPONSE_LEN`)."""
SAVE_EVERY = 10
"""Checkpoint every this many steps: a requeued or failed job repeats at most this many."""
KEEP_LAST = 3
"""Checkpoints kept (older ones are deleted after each save): at 14B one checkpoint with its
optimizer state is ~200 GB, so keeping all 300 of a 3000-step run would need ~60 TB."""
LR_WARMUP_STEPS = 10
"""Linear warm-up from lr 0, in training steps (veRL counts its scheduler in training steps)."""


def paper_recipe(size: str, method: str = "stapo", run_dir: Optional[str] = None) -> TrainerConfig:
    """JustRL + S2T for one Qwen3 size ("qwen3_1p7b" | "qwen3_8b" | "qwen3_14b").

    3000 training steps; AdamW lr 1e-6 (linear warm-up from 0 over 10 training steps, then
    constant), weight decay 0.1, grad clip 1.0; 256 prompts x 8 rollouts per step, PPO
    mini-batches of 64 prompts; prompts <= 1024 tokens in JustRL's prompt wrapper, responses
    <= 15360; sampling T=1.0, top-p 1.0; clip 0.2/0.28 with dual clip 10; no KL, no entropy
    bonus; the +1/-1 boxed exact-match reward; held-out evaluation every 20 steps with responses
    <= 20480 tokens. The README's fidelity table lists each setting against the paper.
    ``model.hf_dir``, ``model.megatron_ckpt`` and ``data.train_path`` / ``data.eval_path``
    (DAPO-Math-17k and a held-out set) are left empty for the user (`check_paper_config`).
    """
    if size not in LAYOUTS:
        raise ValueError(f"size must be one of {sorted(LAYOUTS)}, got {size!r}")
    layout = LAYOUTS[size]
    loss = method_loss(method)
    vllm_share = layout.vllm_gpu_memory_utilization
    if loss.kl_coef > 0 and layout.vllm_gpu_memory_utilization_with_reference is not None:
        vllm_share = layout.vllm_gpu_memory_utilization_with_reference
    cfg = TrainerConfig(
        run_dir=run_dir or f"runs/{size}_{method}",
        steps=TRAIN_STEPS,
        prompts_per_step=256,
        minibatch_prompts=64,
        micro_batch_size=layout.micro_batch_size,
        # whole sequences packed up to one longest sequence's tokens per micro-batch: the
        # memory estimate's seq_len x micro_batch_size tokens, with no padding computed
        packing="budget",
        max_tokens_per_microbatch=SEQ_LEN * layout.micro_batch_size,
        lr_warmup_steps=LR_WARMUP_STEPS,
        eval_every=EVAL_EVERY,
        eval_temperature=1.0,
        eval_samples=4,
        eval_max_response_len=EVAL_MAX_RESPONSE_LEN,
        save_every=SAVE_EVERY,
        keep_last=KEEP_LAST,
        reward="boxed_exact_match",
        reward_timeout_s=5.0,
        model=ModelConfig(
            tensor_model_parallel_size=layout.tensor_model_parallel_size,
            pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
            bf16=True,
            sequence_parallel=layout.sequence_parallel,
            recompute_granularity=layout.recompute_granularity,
            recompute_method=layout.recompute_method,
            recompute_num_layers=layout.recompute_num_layers,
        ),
        data=DataConfig(max_prompt_len=MAX_PROMPT_LEN, use_chat_template=True, dedupe=True,
                        prompt_template=JUSTRL_PROMPT_TEMPLATE),
        rollout=RolloutSampling(
            group_size=8, temperature=1.0, top_p=1.0, max_response_len=MAX_RESPONSE_LEN,
            tensor_parallel_size=layout.vllm_tensor_parallel_size,
            gpu_memory_utilization=vllm_share,
        ),
        loss=loss,
        optim=OptimConfig(lr=1e-6, weight_decay=0.1, clip_grad=1.0, use_distributed_optimizer=True),
    )
    return cfg


def qwen3_1p7b(method: str = "stapo", run_dir: Optional[str] = None) -> TrainerConfig:
    """Qwen3-1.7B-Base: 2 nodes x 8 GPUs, TP=2, DP=8, vLLM TP=2."""
    return paper_recipe("qwen3_1p7b", method, run_dir)


def qwen3_8b(method: str = "stapo", run_dir: Optional[str] = None) -> TrainerConfig:
    """Qwen3-8B-Base: 4 nodes x 8 GPUs, TP=4, DP=8, vLLM TP=4."""
    return paper_recipe("qwen3_8b", method, run_dir)


def qwen3_14b(method: str = "stapo", run_dir: Optional[str] = None) -> TrainerConfig:
    """Qwen3-14B-Base: 8 nodes x 8 GPUs, TP=4, DP=16, vLLM TP=4."""
    return paper_recipe("qwen3_14b", method, run_dir)


def layout_problems(spec: QwenSpec, layout: Layout, cfg: TrainerConfig) -> List[str]:
    """Why ``cfg`` cannot run on ``layout`` (empty when it can): divisibility of heads, layers,
    GPUs and batches, vLLM groups, and the memory estimate."""
    tp, pp = cfg.model.tensor_model_parallel_size, cfg.model.pipeline_model_parallel_size
    vtp = cfg.rollout.tensor_parallel_size
    world = layout.world_size
    problems = []
    for name, count in (("num_attention_heads", spec.num_attention_heads),
                        ("num_query_groups", spec.num_query_groups)):
        if count % tp:
            problems.append(f"{name} {count} is not divisible by tensor_model_parallel_size {tp}")
    if spec.num_layers % pp:
        problems.append(f"num_layers {spec.num_layers} is not divisible by pipeline_model_parallel_size {pp}")
    if world % (tp * pp):
        problems.append(f"{world} GPUs are not divisible by TP {tp} x PP {pp}")
        return problems
    dp = world // (tp * pp)
    if tp > layout.gpus_per_node or layout.gpus_per_node % tp:
        problems.append(f"TP {tp} must divide the {layout.gpus_per_node} GPUs of a node")
    if cfg.prompts_per_step % cfg.minibatch_prompts:
        problems.append(f"prompts_per_step {cfg.prompts_per_step} is not divisible by minibatch_prompts {cfg.minibatch_prompts}")
    if cfg.minibatch_prompts % dp:
        problems.append(f"minibatch_prompts {cfg.minibatch_prompts} is not divisible by DP {dp}")
    mini_sequences = cfg.minibatch_prompts * cfg.rollout.group_size
    if mini_sequences % (dp * cfg.micro_batch_size):
        problems.append(f"{mini_sequences} sequences per mini-batch are not divisible by DP {dp} x micro_batch_size {cfg.micro_batch_size}")
    if layout.gpus_per_node % vtp or world % vtp:
        problems.append(f"vLLM TP {vtp} must divide the {layout.gpus_per_node} GPUs per node and the {world} GPUs")
    if tp % vtp:
        problems.append(f"vLLM TP {vtp} must divide Megatron TP {tp} (an engine must not span two DP ranks)")
    if spec.num_query_groups % vtp:
        problems.append(f"num_query_groups {spec.num_query_groups} is not divisible by vLLM TP {vtp}")
    if cfg.model.sequence_parallel and tp == 1:
        problems.append("sequence_parallel needs tensor_model_parallel_size > 1")
    estimate = memory_estimate(spec, layout)  # layout_for: with the reference model if kl_coef > 0
    if estimate.total >= GPU_MEMORY_BYTES:
        problems.append(f"estimated {estimate.total / GB:.1f} GB per GPU exceeds {GPU_MEMORY_BYTES / GB:.0f} GB: {estimate.as_gb()}")
    return problems


def layout_for(size: str, cfg: TrainerConfig) -> Layout:
    """The size's `Layout` with the parallel settings of ``cfg`` (after overrides)."""
    return dataclasses.replace(
        LAYOUTS[size],
        tensor_model_parallel_size=cfg.model.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.model.pipeline_model_parallel_size,
        vllm_tensor_parallel_size=cfg.rollout.tensor_parallel_size,
        vllm_gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        micro_batch_size=cfg.micro_batch_size,
        sequence_parallel=cfg.model.sequence_parallel,
        recompute_granularity=cfg.model.recompute_granularity,
        recompute_method=cfg.model.recompute_method,
        recompute_num_layers=cfg.model.recompute_num_layers,
        reference_model=cfg.loss.kl_coef > 0,
    )


def check_paper_config(size: str, cfg: TrainerConfig, num_nodes: Optional[int] = None,
                       gpus_per_node: Optional[int] = None, check_paths: bool = True) -> None:
    """Raise ValueError naming every problem of a (possibly overridden) paper config.

    Checks the layout (`layout_problems`) on ``num_nodes`` x ``gpus_per_node`` GPUs (default:
    the size's `Layout`) and, with ``check_paths``, the paths the recipe leaves to the user.
    """
    layout = layout_for(size, cfg)
    layout = dataclasses.replace(layout, num_nodes=num_nodes or layout.num_nodes,
                                 gpus_per_node=gpus_per_node or layout.gpus_per_node)
    problems = layout_problems(ARCHITECTURES[size], layout, cfg)
    if check_paths:
        for field, value, what in (
            ("model.hf_dir", cfg.model.hf_dir, f"the HF folder of {DISPLAY_NAMES[size]}"),
            ("model.megatron_ckpt", cfg.model.megatron_ckpt, "its `stapo-convert hf-to-mcore` checkpoint"),
            ("data.train_path", cfg.data.train_path, "DAPO-Math-17k, parquet or JSONL"),
            ("data.eval_path", cfg.data.eval_path, "a held-out JSONL/parquet"),
        ):
            if not value:
                problems.append(f"{field} is not set ({what})")
    if problems:
        raise ValueError(f"recipe {size} cannot run:\n  - " + "\n  - ".join(problems))
