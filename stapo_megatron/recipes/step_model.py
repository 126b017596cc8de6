"""The calibrated cost model of one RL step: one vLLM engine's decode iteration and prefill, the
trainer's passes with or without activation recompute, and the weight sync; and a recipe's step
time from them. The dry run's estimate (`step_time`) and the rollout-schedule simulator
(``benchmarks/sim_*.py``) both read it.

It is a model, not a measurement: the efficiency figures in `Efficiency` are fitted to two
published runs (``benchmarks/sim_calibrate.py``: NeMo-RL's Llama-3.1-8B GRPO and verl
fully-async's Qwen2.5-Math-7B phase table) and every other figure is a stated datasheet value or
prior.

- **Decode** (`DecodeModel`): one iteration of an engine on ``tp`` GPUs over n active sequences
  whose contexts sum to C costs ``weight_s + kv_s_per_token * C + seq_s * n``: reading the bf16
  weights and every active KV cache at the achieved HBM rate, each sequence's matmuls at
  ``decode_mfu`` of the peak, and a fixed per-iteration overhead (scheduler, sampling, kernel
  launches; 2 TP all-reduces per layer when tp > 1). A mixture of experts computes with its
  active parameters (`ModelSpec.active_params`) and reads its dense weights and the experts its
  n sequences are routed to (`DecodeModel.expert_weight_s`).
- **Training** (`train_phase_s`, `trainer_s`): the forward passes before the update (pi_old,
  the exact tau_H pass, GRPO's reference: 2N FLOPs a token plus causal attention each) and the
  update (6N, 8N with activation recompute, plus attention) at an MFU that falls as the tokens
  each GPU trains in the step shrink: ``mfu(w) = mfu_max * w / (w + half_tokens)``, i.e. every
  phase pays a fixed cost worth ``half_tokens`` tokens a GPU (optimizer steps, gradient
  reductions, launch and packing overheads) on top of its FLOPs. With LoRA
  (`ModelSpec.adapter_params`) the frozen base computes no weight gradients: the update is 4N
  (6N with recompute) for the base plus 6 (8) FLOPs per adapter parameter; the forward passes
  add the adapters' 2 each (the KL reference, the base with its adapters off, is still a pass).
- **Switching** (`switch_s`): colocated, every step sleeps the engines, wakes the trainer, and
  wakes the engines and reloads the weights in place; separate, the trainers send bf16 weights
  over the network and an engine pauses while it loads them (the fp32 adapters alone with
  ``rollout.engine="vllm_lora"``, `ModelSpec.adapter_sync`).
- **A recipe's step** (`recipe_job`, `estimate`; what the dry run prints): the recipe's model,
  GPUs, trainer passes and response cap over the paper's length distribution (`stapo_megatron.recipes.lengths.PAPER_LENGTHS`),
  the responses at its quantiles. Colocated and separate placement generate a step at once, each
  engine its share on `stapo_megatron.recipes.step_engine.Engine` (the simulator's engine), the
  step waiting for the slowest engine's longest response (`generation_s`). Streaming
  (`streaming_step`, closed form): engines that never drain, each running as many samples as its
  KV reservation admits, and trainers that take a step's groups as they complete: a step is the
  longer of the engines' share of the step's decode iterations and prefill (plus a weight load)
  and the trainers' passes (plus sending the weights); within 10% of the simulator's queue
  schedule (``tests/benchmarks/test_sim_recipe.py``).
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import List, Optional, Sequence, Tuple

from stapo_megatron.recipes.lengths import PAPER_LENGTHS, Lengths  # noqa: F401  (the model's lengths, re-exported)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU type (datasheet figures)."""

    name: str
    peak_tflops: float
    """Dense bf16 FLOP/s, in TFLOP/s."""
    hbm_tb_per_s: float
    memory_gb: float


H100 = Hardware("H100 SXM", peak_tflops=989.0, hbm_tb_per_s=3.35, memory_gb=80.0)
H20 = Hardware("H20", peak_tflops=148.0, hbm_tb_per_s=4.0, memory_gb=96.0)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The shapes the cost model reads."""

    name: str
    params: float
    num_layers: int
    attn_width: int
    """num_attention_heads x kv_channels: causal attention costs 4 x layers x width FLOPs per
    (token, earlier position) in the forward pass."""
    kv_heads: int
    kv_channels: int = 128
    active_params: Optional[float] = None
    """Parameters a token's matmuls use (a mixture of experts: the routed experts only); None:
    ``params``. FLOPs count these; a weight transfer moves all ``params``."""
    expert_params: float = 0.0
    """Parameters in routed experts (0: dense)."""
    expert_share: float = 0.0
    """The share of the routed experts one token uses (top-k / experts)."""
    attn_layers: Optional[int] = None
    """Layers with causal attention and a KV cache (Qwen3.5: the full-attention ones); None: all."""
    state_bytes: float = 0.0
    """Qwen3.5: a sequence's delta-net states in vLLM, whatever its length (`delta_net`)."""
    linear_flops: float = 0.0
    """Qwen3.5: forward FLOPs a token of the delta rule beyond its projections, linear in the length."""
    adapter_params: float = 0.0
    """LoRA: the adapters' parameters, the rest frozen (0: full fine-tuning)."""
    adapter_sync: bool = False
    """LoRA with adapter-only sync: the weight sync moves the fp32 adapters, not the bf16 model."""

    @property
    def kv_bytes_per_token(self) -> float:
        """bf16 K and V of every attention layer for one token."""
        layers = self.num_layers if self.attn_layers is None else self.attn_layers
        return layers * self.kv_heads * self.kv_channels * 2 * 2

    @property
    def flop_params(self) -> float:
        """Parameters per token in the FLOP count: ``active_params``, else ``params``."""
        return self.params if self.active_params is None else self.active_params


def model_spec(spec, name: str = "") -> ModelSpec:
    """The cost model's shapes of a `stapo_megatron.bridge.hf_config.QwenSpec`."""
    from stapo_megatron.bridge.hf_config import expert_params, num_active_params, num_params

    from stapo_megatron.recipes import delta_net

    experts = (spec.num_moe_experts or 0) * spec.num_layers * expert_params(spec) if spec.is_moe else 0.0
    hybrid = dict(attn_layers=delta_net.num_attention_layers(spec), state_bytes=delta_net.state_bytes_per_sequence(
        spec), linear_flops=delta_net.delta_rule_flops_per_token(spec)) if spec.is_hybrid else {}
    return ModelSpec(name or spec.architecture, params=float(num_params(spec)), num_layers=spec.num_layers,
                     attn_width=spec.q_size, kv_heads=spec.num_query_groups, kv_channels=spec.kv_channels,
                     active_params=float(num_active_params(spec)) if spec.is_moe else None,
                     expert_params=float(experts),
                     expert_share=spec.moe_router_topk / spec.num_moe_experts if spec.is_moe else 0.0, **hybrid)


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """What the hardware achieves. The first five are fitted (``benchmarks/sim_calibrate.py
    --fit``); the rest are priors, not fitted."""

    iteration_overhead_s: float = 5.51e-3
    """Fixed cost of a decode iteration (fitted)."""
    decode_mfu: float = 0.463
    """Achieved share of the peak in decode matmuls (fitted)."""
    forward_mfu: float = 0.492
    """Ceiling of a forward pass's MFU (pi_old, tau_H, reference; fitted)."""
    update_mfu: float = 0.864
    """Ceiling of the update's MFU, recompute FLOPs counted (fitted)."""
    half_tokens: float = 1.786e5
    """Tokens a GPU trains per step at which a phase runs at half its ceiling (fitted)."""
    hbm_efficiency: float = 1 / 1.16
    """Achieved share of the HBM bandwidth: this project's log-prob op reached 1/1.16 of its
    HBM bound on an H100 (benchmarks/RESULTS.md, "Log-prob/entropy op")."""
    prefill_mfu: float = 0.5
    """Achieved share of the peak in prefill (prior)."""
    allreduce_s: float = 12e-6
    """One small NVLink all-reduce of a TP engine (2 a layer per iteration; prior)."""
    sleep_wake_s: float = 2.0
    """Colocated, per step: sleeping the engines and waking them (prior)."""
    refit_gb_per_s: float = 50.0
    """Colocated weight reload in place, CUDA IPC within the node (prior)."""
    transfer_gb_per_s: float = 25.0
    """Separate: trainer -> engine weights, NCCL over 400 Gb/s InfiniBand at ~50% (prior)."""
    max_num_seqs: int = 1024
    """vLLM's default concurrency cap on GPUs with >= 70 GB (V1 engine)."""


@dataclasses.dataclass
class DecodeModel:
    """Seconds of one decode iteration: ``weight_s + kv_s_per_token * sum(contexts) + seq_s * n``."""

    weight_s: float
    kv_s_per_token: float
    seq_s: float
    prefill_s_per_token: float
    kv_capacity_tokens: int = 10**12
    """Context tokens the KV cache holds: a sequence waits for room before it starts, and a full
    cache preempts the newest running sequence (`step_engine.Engine`)."""
    max_num_seqs: int = 10**9
    seq_tokens: int = 1
    """Cache tokens a running sequence holds beyond its context: its next token, and a hybrid
    model's delta-net states in KV tokens' worth (`ModelSpec.state_bytes`)."""
    expert_weight_s: float = 0.0
    """A mixture of experts: reading every routed expert once; an iteration over n sequences
    reads the share 1 - (1 - expert_share)^n of them (the experts some token is routed to, for
    uniform routing), so a small batch (the tail) reads little more than the dense weights."""
    expert_share: float = 0.0

    def time(self, context_sum: float, n: int, m: int) -> float:
        """m iterations over n sequences whose contexts sum to ``context_sum`` at the start."""
        experts = self.expert_weight_s * (1 - (1 - self.expert_share) ** n) if self.expert_weight_s else 0.0
        return (m * (self.weight_s + experts + self.seq_s * n)
                + self.kv_s_per_token * (m * context_sum + n * m * (m - 1) / 2))

    def iterations_within(self, context_sum: float, n: int, budget: float, limit: int) -> int:
        """The most iterations (<= limit) that fit in ``budget`` seconds."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.time(context_sum, n, mid) <= budget else (lo, mid - 1)
        return lo


def decode_model(model: ModelSpec, hw: Hardware, eff: Efficiency, tp: int, memory_share: float) -> DecodeModel:
    """One engine on ``tp`` GPUs holding ``memory_share`` of each (vLLM's gpu_memory_utilization)."""
    bw = hw.hbm_tb_per_s * 1e12 * eff.hbm_efficiency * tp
    flops = hw.peak_tflops * 1e12 * tp
    weights_gb = 2 * model.params / 1e9
    kv_gb = memory_share * hw.memory_gb * tp - weights_gb
    if kv_gb <= 0:
        raise ValueError(f"{model.name}'s {weights_gb:.1f} GB of weights leave no KV cache in {memory_share} of "
                         f"{tp} x {hw.memory_gb} GB")
    overhead = eff.iteration_overhead_s + (2 * model.num_layers * eff.allreduce_s if tp > 1 else 0.0)
    return DecodeModel(weight_s=2 * (model.params - model.expert_params) / bw + overhead,
                       kv_s_per_token=model.kv_bytes_per_token / bw,
                       # a delta-net state is read and written back every iteration
                       seq_s=2 * model.flop_params / (flops * eff.decode_mfu) + 2 * model.state_bytes / bw,
                       seq_tokens=1 + math.ceil(model.state_bytes / model.kv_bytes_per_token),
                       prefill_s_per_token=2 * model.flop_params / (flops * eff.prefill_mfu),
                       kv_capacity_tokens=int(kv_gb * 1e9 / model.kv_bytes_per_token), max_num_seqs=eff.max_num_seqs,
                       expert_weight_s=2 * model.expert_params / bw, expert_share=model.expert_share)


def train_phase_s(model: ModelSpec, hw: Hardware, eff: Efficiency, tokens: Sequence[int], gpus: int,
                  phase: str, recompute: bool = False) -> float:
    """Seconds of one forward pass (``phase="forward"``) or the update (``"update"``) over
    sequences of ``tokens`` on ``gpus`` GPUs."""
    if phase not in ("forward", "update"):
        raise ValueError(f"phase must be 'forward' or 'update', got {phase!r}")
    passes = 1 if phase == "forward" else 3 + int(recompute)  # backward = 2 forwards
    # a frozen base's backward is its input gradients only: one forward's FLOPs, not two
    base_passes = passes - int(phase == "update" and model.adapter_params > 0)
    mfu_max = eff.forward_mfu if phase == "forward" else eff.update_mfu
    total = sum(tokens)
    layers = model.num_layers if model.attn_layers is None else model.attn_layers  # the quadratic ones
    attention = 4 * layers * model.attn_width * sum(n * n / 2 for n in tokens)
    # the weights' GEMMs follow base_passes; the adapters, the delta rule and attention (no
    # weights of their own to skip) every pass
    flops = (base_passes * 2 * model.flop_params * total
             + passes * ((2 * model.adapter_params + model.linear_flops) * total + attention))
    per_gpu = total / gpus
    mfu = mfu_max * per_gpu / (per_gpu + eff.half_tokens)
    return flops / (gpus * hw.peak_tflops * 1e12 * mfu)


def trainer_s(model: ModelSpec, hw: Hardware, eff: Efficiency, tokens: Sequence[int], gpus: int, forwards: int = 1,
              recompute: bool = False) -> Tuple[float, float]:
    """(forward passes, update) seconds of a step over sequences of ``tokens`` on ``gpus`` GPUs:
    ``forwards`` passes before the update (pi_old, the exact tau_H pass, the reference)."""
    if forwards < 0:
        raise ValueError(f"forwards must be >= 0, got {forwards}")
    return (forwards * train_phase_s(model, hw, eff, tokens, gpus, "forward"),
            train_phase_s(model, hw, eff, tokens, gpus, "update", recompute))


def switch_s(model: ModelSpec, eff: Efficiency, colocated: bool) -> float:
    """Colocated: sleep, wake and reload in place; separate: the network transfer of the weights."""
    weights_gb = (4 * model.adapter_params if model.adapter_sync else 2 * model.params) / 1e9
    if colocated:
        return eff.sleep_wake_s + weights_gb / eff.refit_gb_per_s
    return weights_gb / eff.transfer_gb_per_s


@dataclasses.dataclass
class Prompt:
    """A prompt of ``prompt_len`` tokens and its group's response lengths."""

    index: int
    prompt_len: int
    responses: List[int]


@dataclasses.dataclass(frozen=True)
class RecipeJob:
    """A recipe's step as the model reads it (`recipe_job` builds it from a recipe)."""

    model: ModelSpec
    hardware: Hardware
    lengths: Lengths
    prompts_per_step: int
    group: int
    engine_gpus: int
    """GPUs that generate: all of them colocated, the engine ranks with separate placement."""
    engine_tp: int
    memory_share: float
    """vLLM's gpu_memory_utilization on the engine GPUs."""
    trainer_gpus: int
    trainer_replica_gpus: int
    """TP x PP x CP of a trainer replica (the trainer's data-parallel size is trainer_gpus / this)."""
    forwards: int
    """Forward passes before the update: pi_old, the exact tau_H pass, GRPO's reference."""
    recompute: bool
    """Full activation recompute in the update (8N FLOPs a token instead of 6N)."""
    colocated: bool = False
    max_staleness: int = 0
    """Separate modes: ``rollout.separate.max_staleness`` (k; streaming's eta)."""
    streaming: bool = False
    reserve_tokens: Optional[int] = None
    """Streaming: KV reserved a sample beyond its prompt (``rollout.streaming.reserve_tokens``; None: the response cap)."""
    eff: Efficiency = Efficiency()

    @property
    def kv_reserve(self) -> float:
        """The reservation as a multiple of the mean sequence (the simulator's ``kv_reserve``)."""
        cap = self.lengths.response_cap
        mean = self.lengths.mean_prompt + self.lengths.mean_response()
        return (self.lengths.mean_prompt + min(self.reserve_tokens or cap, cap)) / mean


def recipe_forwards(cfg) -> int:
    """Forward passes a step of ``cfg`` makes before its update: pi_old, the exact tau_H pass
    (``loss.tau_h_source="exact"``) and the reference (``loss.kl_coef > 0``)."""
    return 1 + (cfg.loss.tau_h_source == "exact") + (cfg.loss.kl_coef > 0)


def recipe_lengths(cfg) -> Lengths:
    """The paper's length distribution capped at ``rollout.max_response_len``."""
    return dataclasses.replace(PAPER_LENGTHS, response_cap=cfg.rollout.max_response_len)


def recipe_job(spec, layout, cfg, hardware: Hardware = H100) -> RecipeJob:
    """The `RecipeJob` of ``cfg`` on ``layout`` (a `memory.ParallelLayout` after overrides) for
    the architecture ``spec``; with LoRA (``layout.lora_rank``) its adapters, `memory`'s count."""
    from stapo_megatron.recipes.memory import adapter_params_per_gpu

    colocated = not layout.engine_ranks
    whole = layout.replace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1)
    model = dataclasses.replace(model_spec(spec), adapter_params=float(adapter_params_per_gpu(spec, whole)),
                                adapter_sync=cfg.rollout.engine == "vllm_lora")
    return RecipeJob(
        model, hardware, recipe_lengths(cfg), cfg.prompts_per_step, cfg.rollout.group_size,
        engine_gpus=layout.world_size if colocated else layout.engine_ranks,
        engine_tp=layout.vllm_tensor_parallel_size, memory_share=layout.vllm_gpu_memory_utilization,
        trainer_gpus=layout.training_ranks, trainer_replica_gpus=layout.training_ranks // layout.data_parallel_size,
        forwards=recipe_forwards(cfg), recompute=cfg.model.recompute_granularity == "full", colocated=colocated,
        max_staleness=cfg.rollout.separate.max_staleness, streaming=cfg.rollout.mode == "streaming",
        reserve_tokens=cfg.rollout.streaming.reserve_tokens)


def _engines(job: RecipeJob) -> int:
    engines = job.engine_gpus // job.engine_tp
    if engines < 1:
        raise ValueError(f"engine_gpus={job.engine_gpus} hold no engine of TP {job.engine_tp}")
    return engines


def _tokens(job: RecipeJob) -> List[int]:
    """The step's sequences: the mean prompt and the responses at the length distribution's quantiles."""
    prompt = int(job.lengths.mean_prompt)
    return [prompt + r for r in job.lengths.quantile_responses(job.prompts_per_step * job.group)]


def training_s(job: RecipeJob) -> float:
    """The trainer's forward passes and update of a step on its GPUs."""
    return sum(trainer_s(job.model, job.hardware, job.eff, _tokens(job), job.trainer_gpus, job.forwards,
                         job.recompute))


def generation_s(job: RecipeJob) -> float:
    """One step generated at once (colocated, or separate k): every engine's share of the step's
    samples (the responses at the length distribution's quantiles, dealt round the engines from
    the longest, in a fixed shuffled order) on `step_engine.Engine`, until the slowest engine's
    last response (the tail)."""
    from stapo_megatron.recipes.step_engine import Engine

    engines = _engines(job)
    dm = decode_model(job.model, job.hardware, job.eff, job.engine_tp, job.memory_share)
    responses = sorted(job.lengths.quantile_responses(job.prompts_per_step * job.group), reverse=True)
    slowest = 0.0
    for e in range(engines):
        share = responses[e::engines]
        random.Random(e).shuffle(share)
        engine = Engine(dm)
        for i, r in enumerate(share):
            engine.admit(Prompt(i, int(job.lengths.mean_prompt), [r]), 0)
        engine.run()
        slowest = max(slowest, engine.clock)
    return slowest


def estimate(job: RecipeJob) -> Tuple[float, float, bool]:
    """(rollout, training, overlapped) seconds of a steady step of ``job``: a step takes the sum,
    or the longer of the two when overlapped (separate placement with k >= 1, streaming).

    Colocated: the step's generation with its tail and the switch (sleep, wake, reload), then the
    trainer's passes on every GPU. Separate: the generation and the engines' weight load, the
    trainer's passes and sending the weights. Streaming: `streaming_step`."""
    if job.streaming:
        return (*streaming_step(job), True)
    if job.colocated:
        return generation_s(job) + switch_s(job.model, job.eff, colocated=True), training_s(job), False
    transfer = switch_s(job.model, job.eff, colocated=False)
    return generation_s(job) + transfer, training_s(job) + transfer, job.max_staleness > 0


def streaming_step(job: RecipeJob) -> Tuple[float, float]:
    """(rollout, training) seconds of a steady streaming step (module docstring); a step takes
    the longer of the two.

    Rollout: each engine runs n samples at once, the fewest of what its reservation admits (a
    group is admitted while the running samples and the group's fit the cache at prompt +
    reserve each: on average half a group below the limit), what its cache holds at the running
    samples' mean context (prompt + E[L^2] / 2E[L]: a running sample is length-biased and half
    done), and vLLM's max_num_seqs; it decodes its share of the step's response tokens n at a
    time, prefills its share of the prompts and pauses once for the weights. Training: the
    forward passes and the update of the step's sequences (responses at the length
    distribution's quantiles) on the trainer GPUs, and sending the weights."""
    lengths, model = job.lengths, job.model
    dm = decode_model(model, job.hardware, job.eff, job.engine_tp, job.memory_share)
    engines, samples = _engines(job), job.prompts_per_step * job.group
    mean, prompt = lengths.mean_response(), lengths.mean_prompt
    context = prompt + lengths.response_moment(2) / (2 * mean)
    reserve = prompt + min(job.reserve_tokens or lengths.response_cap, lengths.response_cap) + dm.seq_tokens - 1
    running = max(1.0, min(dm.max_num_seqs, dm.kv_capacity_tokens / reserve - job.group / 2,
                           dm.kv_capacity_tokens / (context + dm.seq_tokens - 1)))
    iteration = dm.time(running * context, running, 1) if not dm.expert_weight_s else \
        dm.time(running * context, int(running), 1)
    transfer = switch_s(model, job.eff, colocated=False)
    rollout = (samples * mean / (engines * running) * iteration
               + samples * prompt / engines * dm.prefill_s_per_token + transfer)
    return rollout, training_s(job) + transfer
