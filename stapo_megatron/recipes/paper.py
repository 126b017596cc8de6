"""The paper's setups: Qwen3-1.7B/8B/14B-Base (and Qwen3-30B-A3B-Base), JustRL + S2T, on 80 GB GPUs.

``qwen3_1p7b``, ``qwen3_8b``, ``qwen3_8b_32k``, ``qwen3_14b`` and ``qwen3_30b_a3b`` return the
trainer's `TrainerConfig` for
DAPO-Math-17k (paths are the user's: ``data.train_path`` / ``data.eval_path``), with the method
as a one-word switch (a name of `stapo_megatron.method.registry.METHODS`, `method_loss`).

Each recipe has a `ParallelLayout` (nodes, TP/PP/CP/EP/DP, vLLM TP and memory share, micro-batch,
recompute, sequence parallelism, sequence length) chosen with `memory_estimate`, the written
per-GPU memory model of `stapo_megatron.recipes.memory` (its assumptions are in the function's
docstring). Context parallelism splits each packed sequence over CP ranks (2 x CP load-balanced
chunks): the 8B and 14B recipes use it to drop full recomputation, ``qwen3_8b_32k`` to train
32k-token sequences. ``qwen3_30b_a3b`` is the mixture-of-experts model with expert parallelism
(EP). A recipe's `ParallelLayout` holds the `ModelConfig` its `TrainerConfig` trains with; the layout
checks (`layout_problems`) are the one validator's, `stapo_megatron.config.parallel_layout`, plus the
memory estimate.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from stapo_megatron.bridge.hf_config import QwenSpec
from stapo_megatron.config import TrainerConfig
from stapo_megatron.data.config import DataConfig
from stapo_megatron.eval.config import EvalConfig
from stapo_megatron.mcore.config import ModelConfig, OptimConfig
from stapo_megatron.method.config import LossConfig
from stapo_megatron.rewards.config import RewardConfig
from stapo_megatron.rollout.config import RolloutSampling
from stapo_megatron.rollout.rollout_modes import SeparatePlacement, StreamingRollouts
from stapo_megatron.batch.alignment import rank_tokens
from stapo_megatron.config.parallel_layout import Cluster
from stapo_megatron.config.parallel_layout import layout_problems as check_layout
from stapo_megatron.data.examples import JUSTRL_PROMPT_TEMPLATE
from stapo_megatron.method.config import method_loss_config
from stapo_megatron.method.rollout_correction import RolloutCorrectionConfig
from stapo_megatron.recipes.engine_memory import engine_start_problems
from stapo_megatron.recipes.memory import (GB, GPU_MEMORY_BYTES, MAX_PROMPT_LEN, ParallelLayout, lora_rank_problems,
                                           memory_estimate)
from stapo_megatron.recipes.qwen35 import (QWEN35_ARCHITECTURES, QWEN35_DISPLAY_NAMES, QWEN35_LAYOUTS,
                                           QWEN35_PACKING)


def _qwen3(num_layers, hidden, heads, ffn, tied) -> QwenSpec:
    """A Qwen3 base model as in its HF config.json (8 KV heads, head_dim 128, 151936 tokens)."""
    return QwenSpec(
        architecture="Qwen3ForCausalLM", num_layers=num_layers, hidden_size=hidden,
        ffn_hidden_size=ffn, num_attention_heads=heads, num_query_groups=8, kv_channels=128,
        vocab_size=151936, max_position_embeddings=32768, rotary_base=1_000_000.0,
        layernorm_epsilon=1e-6, add_qkv_bias=False, qk_layernorm=True, tie_word_embeddings=tied,
        init_method_std=0.02,
    )


QWEN3_30B_A3B = QwenSpec(
    architecture="Qwen3MoeForCausalLM", num_layers=48, hidden_size=2048, ffn_hidden_size=6144,
    num_attention_heads=32, num_query_groups=4, kv_channels=128, vocab_size=151936,
    max_position_embeddings=40960, rotary_base=1_000_000.0, layernorm_epsilon=1e-6, add_qkv_bias=False,
    qk_layernorm=True, tie_word_embeddings=False, init_method_std=0.02, num_moe_experts=128,
    moe_router_topk=8, moe_ffn_hidden_size=768, norm_topk_prob=True, moe_aux_loss_coeff=0.001,
)
"""Qwen3-30B-A3B-Base as in its HF config.json: every layer an MoE of 128 experts (top-8, width
768, normalised top-k probabilities, aux loss 0.001), no shared experts; ``ffn_hidden_size`` is
the config's unused dense ``intermediate_size``. 30.5B parameters, 3.3B active per token."""

ARCHITECTURES: Dict[str, QwenSpec] = {
    "qwen3_1p7b": _qwen3(28, 2048, 16, 6144, tied=True),
    "qwen3_8b": _qwen3(36, 4096, 32, 12288, tied=False),
    "qwen3_8b_32k": _qwen3(36, 4096, 32, 12288, tied=False),
    "qwen3_8b_async": _qwen3(36, 4096, 32, 12288, tied=False),
    "qwen3_8b_stream": _qwen3(36, 4096, 32, 12288, tied=False),
    "qwen3_14b": _qwen3(40, 5120, 40, 17408, tied=False),
    "qwen3_30b_a3b": QWEN3_30B_A3B,
    **QWEN35_ARCHITECTURES,  # Qwen3.5-27B and -35B-A3B (recipes/qwen35.py)
}
"""The architecture of each recipe: Qwen3-{1.7B,8B,14B,30B-A3B}-Base (the training memory model
and consistency checks use them; the trainer itself reads the architecture from ``model.hf_dir``)."""
DISPLAY_NAMES = {"qwen3_1p7b": "Qwen3-1.7B-Base", "qwen3_8b": "Qwen3-8B-Base", "qwen3_8b_32k": "Qwen3-8B-Base",
                 "qwen3_8b_async": "Qwen3-8B-Base", "qwen3_8b_stream": "Qwen3-8B-Base",
                 "qwen3_14b": "Qwen3-14B-Base", "qwen3_30b_a3b": "Qwen3-30B-A3B-Base", **QWEN35_DISPLAY_NAMES}
"""The HF model each recipe starts from."""


ASYNC_STALENESS = 1
"""``rollout.separate.max_staleness`` of the asynchronous recipe: one-step-off (verl's one_step_off, NeMo-RL's
async GRPO at 1): step s trains on samples of the policy after step s - 1."""
ASYNC_CORRECTION = "tis"
"""``loss.rollout_correction.mode`` of the asynchronous recipe: the samples come from a policy one
update old, so the surrogate of every token is weighted by min(pi_old / pi_rollout, C), the
behaviour-policy correction of AReaL's decoupled objective (pi_old recomputed by the trainer is its
proximal policy; docs/async.md, "What staleness does to STAPO")."""
STREAMING_LAYOUTS = ("qwen3_8b_stream",)
"""The layouts that stream their rollouts (``rollout.mode="streaming"``)."""
STREAM_RESERVE_TOKENS = 4096
"""Streaming recipes' KV reservation per sample beyond its prompt (``rollout.streaming.reserve_tokens``):
about the paper's mean response (4,222 tokens in the simulator's length distribution), as the
simulator that picked the split reserves; the worst case (15,360) would run a third of the
samples (the control plane at time scale: 218 s a step against 132 s; benchmarks/RESULTS.md).
Responses that outgrow it are preempted by vLLM and prefilled again."""
STREAM_STALENESS = 3
"""Streaming recipes' off-policyness bound eta (``rollout.separate.max_staleness``): with the recipe's split the
24 TP=1 engines set the pace at eta 2 (1.53x colocated in the simulator's queue schedule, 1.40x
with the slices) and at eta 3 the trainers nearly do (1.74x, 1.56x); in completion order 16% of
the trained tokens are then 4 versions old (benchmarks/RESULTS.md, "Where the streaming recipe
pays")."""
STREAM_TAU_H_SOURCE = "old"
"""Streaming recipes' ``loss.tau_h_source``: tau_H from the pi_old pass, exact for the first of a
step's 4 PPO mini-batches (256 / 64 prompts) and lagging the 1-3 updates before it for the
others. The exact pass is a second forward over the step's tokens on the recipe's 8 trainer GPUs,
which then set the pace (1.35x colocated at best with it on 4 nodes, 1.48x on 6;
benchmarks/RESULTS.md, "Where the streaming recipe pays")."""

_NO_RECOMPUTE = dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
"""Model fields of a recipe that keeps every layer's activations (CP, or a card of its own, makes room for them)."""


def _model(tensor_model_parallel_size: int, **changes) -> ModelConfig:
    """A paper recipe's `ModelConfig`: bf16, sequence parallelism and full recomputation of
    single layers unless ``changes`` say otherwise (``model.hf_dir`` and ``megatron_ckpt`` are
    the user's)."""
    fields = dict(bf16=True, sequence_parallel=True, recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=1)
    return ModelConfig(tensor_model_parallel_size=tensor_model_parallel_size, **{**fields, **changes})

LAYOUTS: Dict[str, ParallelLayout] = {
    # 2 nodes: TP=2 halves the 151936-wide logits and their gradient (5 GB instead of 10 GB at TP=1).
    "qwen3_1p7b": ParallelLayout(num_nodes=2, model=_model(2), vllm_tensor_parallel_size=2,
                                 vllm_gpu_memory_utilization=0.55),
    # 4 nodes: TP=4 (at TP=2 training and vLLM's share exceed the budget), CP=2 inside the node
    # (TP x CP = 8 GPUs): each rank holds 8k of a 16k sequence, which pays for keeping every
    # layer's activations (21 GB) instead of full recomputation; vLLM's share goes from 0.5 to
    # 0.4 for it (0.35 with GRPO's reference). docs/recipes.md's memory table gives the components.
    "qwen3_8b": ParallelLayout(num_nodes=4, model=_model(4, context_parallel_size=2, **_NO_RECOMPUTE),
                               vllm_tensor_parallel_size=4, vllm_gpu_memory_utilization=0.4,
                               vllm_gpu_memory_utilization_with_reference=0.35),
    # 32k-token sequences (1024 prompt + 31744 response: the model's 32768 positions) on the
    # 8B's 4 nodes: CP=4 (two nodes per model replica, DP=2) keeps a rank at 8k tokens, the
    # same activations as qwen3_8b without recomputation.
    "qwen3_8b_32k": ParallelLayout(num_nodes=4, model=_model(4, context_parallel_size=4, **_NO_RECOMPUTE),
                                   vllm_tensor_parallel_size=4, vllm_gpu_memory_utilization=0.4,
                                   vllm_gpu_memory_utilization_with_reference=0.35, seq_len=32768),
    # The 8B on the same 4 nodes with separate placement and one-step-off rollouts (docs/async.md,
    # "Asynchronous rollouts"; not the paper's protocol): 2 nodes train (TP=4, CP=2, DP=2, the
    # whole card: no vLLM share beside training), 2 nodes generate (4 vLLM engines of TP=4 at 0.85
    # of their card) while the trainers train the step before: 4.3 min a step by recipes/step_time.py
    # against the colocated 4.4 (generation, bound by the longest response, dominates both; 24
    # engine GPUs of TP=4 would generate in 3.6 min, with the trainers at DP=1);
    # benchmarks/sim_async.py models the overlap with a length distribution.
    "qwen3_8b_async": ParallelLayout(num_nodes=4, model=_model(4, context_parallel_size=2, **_NO_RECOMPUTE),
                                     vllm_tensor_parallel_size=4, vllm_gpu_memory_utilization=0.85, engine_ranks=16),
    # The 8B with streaming rollouts (docs/async.md, "Streaming rollouts"; not the paper's
    # protocol): 1 node trains (TP=4, DP=2, streaming needs CP=1) without recomputation (the
    # whole card is the trainer's: 65.5 GB with every layer's activations of a 16k sequence), 3
    # nodes generate as 24 vLLM engines of TP=1 (streaming steps one engine per process; the 8B's
    # 16 GB of weights leave 52 GB of KV cache at 0.85); eta = `STREAM_STALENESS`, tau_H from the pi_old
    # pass (`STREAM_TAU_H_SOURCE`). The simulator's best split per GPU over 4-7 nodes
    # (benchmarks/sim_split.py): 1.74x colocated's tokens/s/GPU in the queue schedule, 1.56x with
    # the slices (benchmarks/RESULTS.md, "Where the streaming recipe pays").
    "qwen3_8b_stream": ParallelLayout(num_nodes=4, model=_model(4, **_NO_RECOMPUTE), vllm_tensor_parallel_size=1,
                                      vllm_gpu_memory_utilization=0.85, engine_ranks=24),
    # 8 nodes (the design's target): TP=4 within a node, CP=4 (two nodes per model replica,
    # DP=4): 4k tokens of a 16k sequence per rank, without recomputation; one vLLM TP=4 engine
    # per TP group at 0.35 of the card (0.3 beside GRPO's reference, +7.4 GB).
    "qwen3_14b": ParallelLayout(num_nodes=8, model=_model(4, context_parallel_size=4, **_NO_RECOMPUTE),
                                vllm_tensor_parallel_size=4, vllm_gpu_memory_utilization=0.35,
                                vllm_gpu_memory_utilization_with_reference=0.3),
    # MoE, 4 nodes: TP=4 (the 4 KV heads; vLLM TP=4 holds 15 GB of the 61 GB of bf16 weights),
    # EP=16 with ETP=1 (8 whole experts per rank; the expert optimizer shards over world /
    # (ETP x EP) = 2), full recomputation. The peers: verl TP=4 PP=2 EP=4 on 4 nodes, NeMo-RL
    # TP=2 EP=8 ETP=1 on 8 nodes with vLLM TP=4, slime TP=4 EP=8 ETP=1 on one node with CPU Adam
    # (docs/recipes.md, the memory table). At EP=8 on 4 nodes the estimate is 79.7 GB. MoE trains under
    # CP too (mcore/moe.py), but CP=2 (DP=4) without recomputation is 121.8 GB per GPU by the
    # memory model (57.5 GB of activations; CP=4: 92.4 GB): `python -c "import dataclasses as d;
    # from stapo_megatron.recipes.paper import *; from stapo_megatron.recipes.memory import *;
    # print(describe(QWEN3_30B_A3B, LAYOUTS['qwen3_30b_a3b'].replace(context_parallel_size=2,
    # **_NO_RECOMPUTE)))"`.
    "qwen3_30b_a3b": ParallelLayout(num_nodes=4,
                                    model=_model(4, expert_model_parallel_size=16, expert_tensor_parallel_size=1),
                                    vllm_tensor_parallel_size=4, vllm_gpu_memory_utilization=0.4),
    **QWEN35_LAYOUTS,  # no CP (the delta-net layers have none): recipes/qwen35.py
}
"""The parallel layout of each paper recipe (see `memory_estimate` and the table of docs/recipes.md)."""


# -- recipes ----------------------------------------------------------------------------------


def method_loss(method: str) -> LossConfig:
    """The loss of each method, everything else equal (the paper's comparison).

    The shared constants (clip 0.2/0.28, dual clip c = 10 as JustRL sets it on veRL, no KL,
    tau_p 0.002, q 0.75, rho 0.2, T 1.0, tau_H from the current weights before each mini-batch
    as Algorithm 1 does: ``tau_h_source="exact"``), then the method's own
    ``Method.loss_options`` (`stapo_megatron.method.config.method_loss_config`). stapo: S2T with tau_p
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
"""Maximum response tokens at evaluation (training: `memory.MAX_RESPONSE_LEN`; a long-response
recipe evaluates at least as long as it trains)."""
SAVE_EVERY = 10
"""Checkpoint every this many steps: a requeued or failed job repeats at most this many."""
KEEP_LAST = 3
"""Checkpoints kept (older ones are deleted after each save): at 14B one checkpoint with its
optimizer state is ~200 GB, so keeping all 300 of a 3000-step run would need ~60 TB."""
ROUTING_EVERY = 10
"""MoE recipes: steps between routing-disagreement measurements (`RolloutSampling.routing_every`)."""
LR_WARMUP_STEPS = 10
"""Linear warm-up from lr 0, in training steps (veRL counts its scheduler in training steps)."""


def paper_recipe(size: str, method: str = "stapo", run_dir: Optional[str] = None) -> TrainerConfig:
    """JustRL + S2T for one recipe of `LAYOUTS` ("qwen3_1p7b" | "qwen3_8b" | "qwen3_8b_32k" |
    "qwen3_8b_async" | "qwen3_8b_stream" | "qwen3_14b" | "qwen3_30b_a3b" | Qwen3.5's "qwen35_27b" |
    "qwen35_35b_a3b", `recipes.qwen35`).

    3000 training steps; AdamW lr 1e-6 (linear warm-up from 0 over 10 training steps, then
    constant), weight decay 0.1, grad clip 1.0; 256 prompts x 8 rollouts per step, PPO
    mini-batches of 64 prompts; prompts <= 1024 tokens in JustRL's prompt wrapper, responses
    <= 15360 (``qwen3_8b_32k``: 31744); sampling T=1.0, top-p 1.0; clip 0.2/0.28 with dual clip 10; no KL, no entropy
    bonus; the +1/-1 boxed exact-match reward; held-out evaluation every 20 steps with responses
    <= 20480 tokens. docs/recipes.md's fidelity table lists each setting against the paper.
    ``model.hf_dir``, ``model.megatron_ckpt`` and ``data.train_path`` / ``data.eval_path``
    (DAPO-Math-17k and a held-out set) are left empty for the user (`check_paper_config`).
    """
    if size not in LAYOUTS:
        raise ValueError(f"size must be one of {sorted(LAYOUTS)}, got {size!r}")
    layout = LAYOUTS[size]
    max_response_len = layout.seq_len - MAX_PROMPT_LEN
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
        # whole sequences packed up to one longest sequence's tokens per micro-batch (per CP
        # rank: its 1/CP share): the memory estimate's tokens, with no padding computed
        packing=QWEN35_PACKING.get(size, "budget"),  # Qwen3.5 with PP: padded (recipes/qwen35.py)
        max_tokens_per_microbatch=rank_tokens(layout.seq_len, layout.context_parallel_size) * layout.micro_batch_size,
        lr_warmup_steps=LR_WARMUP_STEPS,
        save_every=SAVE_EVERY,
        keep_last=KEEP_LAST,
        reward=RewardConfig(name="boxed_exact_match", timeout_s=5.0),
        eval=EvalConfig(every=EVAL_EVERY, temperature=1.0, samples=4,
                        max_response_len=max(EVAL_MAX_RESPONSE_LEN, max_response_len)),
        model=dataclasses.replace(layout.model),  # the layout's, as it is (a copy the caller may change)
        data=DataConfig(max_prompt_len=MAX_PROMPT_LEN, use_chat_template=True, dedupe=True,
                        prompt_template=JUSTRL_PROMPT_TEMPLATE),
        rollout=RolloutSampling(
            group_size=8, temperature=1.0, top_p=1.0, max_response_len=max_response_len,
            tensor_parallel_size=layout.vllm_tensor_parallel_size,
            gpu_memory_utilization=vllm_share,
            # MoE: the routing-disagreement pass is one more no-grad forward over the step's
            # samples (as the pi_old pass); a diagnostic, so every 10th step (dense: ignored)
            routing_every=ROUTING_EVERY,
            **(_separate(size, layout) if layout.engine_ranks else {}),
        ),
        loss=(dataclasses.replace(loss, rollout_correction=RolloutCorrectionConfig(mode=ASYNC_CORRECTION),
                                  **({"tau_h_source": STREAM_TAU_H_SOURCE} if size in STREAMING_LAYOUTS else {}))
              if layout.engine_ranks else loss),
        optim=OptimConfig(lr=1e-6, weight_decay=0.1, clip_grad=1.0, use_distributed_optimizer=True),
    )
    return cfg


def _separate(size: str, layout: ParallelLayout) -> dict:
    """The rollout fields of a separately placed recipe: one-step-off, or streaming."""
    if size in STREAMING_LAYOUTS:
        return dict(mode="streaming", separate=SeparatePlacement(layout.engine_ranks, STREAM_STALENESS),
                    streaming=StreamingRollouts(reserve_tokens=STREAM_RESERVE_TOKENS))
    return dict(mode="separate", separate=SeparatePlacement(layout.engine_ranks, ASYNC_STALENESS))


def qwen3_1p7b(method: str = "stapo", run_dir: Optional[str] = None) -> TrainerConfig:
    """Qwen3-1.7B-Base: 2 nodes x 8 GPUs, TP=2, DP=8, vLLM TP=2."""
    return paper_recipe("qwen3_1p7b", method, run_dir)


def qwen3_8b(method: str = "stapo", run_dir: Optional[str] = None) -> TrainerConfig:
    """Qwen3-8B-Base: 4 nodes x 8 GPUs, TP=4, CP=2, DP=4, no recomputation, vLLM TP=4."""
    return paper_recipe("qwen3_8b", method, run_dir)


def qwen3_8b_32k(method: str = "stapo", run_dir: Optional[str] = None) -> TrainerConfig:
    """Qwen3-8B-Base with 32k-token sequences (responses <= 31744): 4 nodes, TP=4, CP=4, DP=2."""
    return paper_recipe("qwen3_8b_32k", method, run_dir)


def qwen3_8b_async(method: str = "stapo", run_dir: Optional[str] = None) -> TrainerConfig:
    """Qwen3-8B-Base with separate placement and one-step-off rollouts
    (``rollout.separate.max_staleness`` 1): 4 nodes, 2 train (TP=4, CP=2, DP=2), 2 generate (4 vLLM engines of TP=4); the stale
    samples corrected for their behaviour policy (``loss.rollout_correction.mode`` "tis",
    `ASYNC_CORRECTION`)."""
    return paper_recipe("qwen3_8b_async", method, run_dir)


def qwen3_8b_stream(method: str = "stapo", run_dir: Optional[str] = None) -> TrainerConfig:
    """Qwen3-8B-Base with streaming rollouts (``rollout.mode="streaming"``, eta `STREAM_STALENESS`): 4 nodes, 1
    trains (TP=4, DP=2, no recomputation), 3 generate (24 vLLM engines of TP=1, never drained,
    weights loaded between decode iterations); tis corrects for the behaviour policy; tau_H from
    the pi_old pass (`STREAM_TAU_H_SOURCE`)."""
    return paper_recipe("qwen3_8b_stream", method, run_dir)


def qwen3_14b(method: str = "stapo", run_dir: Optional[str] = None) -> TrainerConfig:
    """Qwen3-14B-Base: 8 nodes x 8 GPUs, TP=4, CP=4, DP=4, no recomputation, vLLM TP=4."""
    return paper_recipe("qwen3_14b", method, run_dir)


def qwen3_30b_a3b(method: str = "stapo", run_dir: Optional[str] = None) -> TrainerConfig:
    """Qwen3-30B-A3B-Base (MoE): 4 nodes x 8 GPUs, TP=4, EP=16, ETP=1, DP=8, vLLM TP=4.

    Router replay (``rollout.routing_replay``) stays off: its vLLM engine returns routed experts
    only from Model Runner V2 (``rollout.vllm_model_runner_v2=True``), which has not run on a GPU
    here (nor has its log-prob parity), and the paper trains without replay. To turn it on, set
    both once a GPU run shows V2's parity; the routing-disagreement metric (every 10th step)
    says how much it would change."""
    return paper_recipe("qwen3_30b_a3b", method, run_dir)


def qwen35_27b(method: str = "stapo", run_dir: Optional[str] = None) -> TrainerConfig:
    """Qwen3.5-27B (`recipes.qwen35`): 8 nodes x 8 GPUs, TP=4, PP=2, DP=8, no CP, vLLM TP=4."""
    return paper_recipe("qwen35_27b", method, run_dir)


def qwen35_35b_a3b(method: str = "stapo", run_dir: Optional[str] = None) -> TrainerConfig:
    """Qwen3.5-35B-A3B (MoE, `recipes.qwen35`): 8 nodes x 8 GPUs, TP=2, EP=64, ETP=1, DP=32, no CP, vLLM TP=2."""
    return paper_recipe("qwen35_35b_a3b", method, run_dir)


def layout_problems(spec: QwenSpec, layout: ParallelLayout, cfg: TrainerConfig) -> List[str]:
    """Why ``cfg`` cannot run on ``layout``'s cluster (empty when it can): the one validator's
    problems (`stapo_megatron.config.parallel_layout.layout_problems`: heads, layers, experts, GPUs and
    batches over TP/PP/CP/EP/DP, the node topology, the CP token budget, vLLM groups), a
    ``lora.rank`` wider than a targeted linear (`lora_rank_problems`), then the memory estimate
    of ``layout``."""
    problems = check_layout(cfg, layout.cluster, spec) + lora_rank_problems(spec, layout)
    if layout.world_size % (layout.tensor_model_parallel_size * layout.pipeline_model_parallel_size
                            * layout.context_parallel_size):
        return problems  # named by the validator; there is no estimate for a layout that does not split the GPUs
    estimate = memory_estimate(spec, layout)  # layout_for: with the reference model if kl_coef > 0
    if estimate.total >= GPU_MEMORY_BYTES:
        problems.append(f"estimated {estimate.total / GB:.1f} GB per GPU exceeds {GPU_MEMORY_BYTES / GB:.0f} GB: {estimate.as_gb()}")
    return problems + engine_start_problems(spec, layout)


def layout_for(size: str, cfg: TrainerConfig) -> ParallelLayout:
    """The `ParallelLayout` of ``cfg`` (after overrides) on the size's cluster (`memory.ParallelLayout.of`)."""
    return ParallelLayout.of(cfg, LAYOUTS[size].cluster)


def check_paper_config(size: str, cfg: TrainerConfig, num_nodes: Optional[int] = None,
                       gpus_per_node: Optional[int] = None, check_paths: bool = True) -> None:
    """Raise ValueError naming every problem of a (possibly overridden) paper config.

    Checks the layout (`layout_problems`) on ``num_nodes`` x ``gpus_per_node`` GPUs (default:
    the size's `ParallelLayout`) and, with ``check_paths``, the paths the recipe leaves to the user.
    """
    default = LAYOUTS[size]
    layout = ParallelLayout.of(cfg, Cluster(num_nodes or default.num_nodes, gpus_per_node or default.gpus_per_node))
    problems = layout_problems(ARCHITECTURES[size], layout, cfg)
    if check_paths:
        for field, value, what in (
            ("model.hf_dir", cfg.model.hf_dir, f"the HF folder of {DISPLAY_NAMES[size]}"),
            ("model.megatron_ckpt", cfg.model.megatron_ckpt, "its `stapo-convert hf-to-mcore` checkpoint"),
            ("data.train_path", cfg.data.train_path, "DAPO-Math-17k, parquet or JSONL"),
            ("data.eval_path", cfg.data.eval_path or cfg.eval.sets, "a held-out JSONL/parquet, or the benchmarks "
                                                                   "in eval.sets: `with_paper_benchmarks`"),
        ):
            if not value:
                problems.append(f"{field} is not set ({what})")
    if problems:
        raise ValueError(f"recipe {size} cannot run:\n  - " + "\n  - ".join(problems))


def with_paper_benchmarks(cfg: TrainerConfig, bench_dir: str) -> TrainerConfig:
    """``cfg`` with ``eval.sets`` set to the paper's benchmarks found in ``bench_dir``, the folder
    ``scripts/prepare_data.py bench`` writes (aime24/aime25/amc23 at k=32, math500/minerva/
    olympiadbench at k=4, both decodings; `stapo_megatron.eval.scoring.paper_eval_set_configs`)."""
    from stapo_megatron.eval.scoring import paper_eval_set_configs

    cfg.eval.sets = paper_eval_set_configs(bench_dir)
    return cfg
