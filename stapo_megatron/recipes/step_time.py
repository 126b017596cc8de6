"""A written estimate of one paper-recipe training step on H100s, and what it means for Slurm.

Not a measurement (nothing here has run on a GPU): a throughput model with its assumptions as
named constants, so that the launch defaults (time limit x requeues, the save-before-the-limit
signal) are derived from a stated number and a dry run can show it. A real run's
``time_step`` metric replaces it (`stapo_megatron.runlog.progress`).

Streaming rollouts (``rollout.streaming``) are estimated by the calibrated cost model that the
rollout-schedule simulator runs on (`stapo_megatron.recipes.step_model.streaming_step`: the
engines' decode iterations and prefill at the samples their KV reservation admits, the trainer's
forward passes and update with the recipe's recompute, the weight transfer; within 10% of the
simulator's queue schedule, ``tests/benchmarks/test_sim_recipe.py``). Every other placement is
the written model below.

Step = rollout (vLLM decode, memory-bandwidth bound) + training (Megatron, FLOP bound), or the
longer of the two with separate placement and ``rollout.max_staleness`` >= 1 (each on its own GPUs):
    rollout  = decode steps x (this GPU's weight shard + the KV cache read per decode step) / HBM
    training = (old-logprob forward + exact tau_H forward + reference forward + forward, backward
               and, with full recomputation, the recomputed forward) FLOPs of all sampled tokens
               / (GPUs x peak x MFU); an MoE counts its active parameters (top-k experts)
"""

from __future__ import annotations

import dataclasses
import math

MEAN_PROMPT_TOKENS = 200
"""Assumed mean prompt length in the JustRL wrapper (DAPO-Math-17k problems are short)."""
MEAN_RESPONSE_FRACTION = 0.5
"""Assumed mean response length as a fraction of ``rollout.max_response_len`` (an assumption:
responses of RL-trained Qwen3 base models grow over a run toward several thousand tokens)."""
PEAK_BF16_FLOPS = 989e12
"""H100 SXM dense bf16 peak."""
TRAIN_MFU = 0.3
"""Assumed model FLOP utilisation of the Megatron update (full recompute, 16k sequences)."""
HBM_BYTES_PER_S = 3.35e12
"""H100 SXM memory bandwidth."""
DECODE_EFFICIENCY = 0.5
"""Assumed fraction of the bandwidth vLLM's decode reaches."""
SAVE_S = 120.0
"""Allowance for one checkpoint save (the ~200 GB of a 14B checkpoint over 64 ranks)."""
JOB_STARTUP_S = 900.0
"""Allowance per Slurm job for container start, checkpoint load and vLLM start-up."""


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one training step (estimate)."""

    rollout_s: float
    """vLLM generation of ``prompts_per_step x group_size`` responses."""
    training_s: float
    """Log-prob passes and the policy update."""
    overlapped: bool = False
    """Separate placement with ``rollout.max_staleness`` >= 1: the engines generate the next step
    while the trainers train this one, so a step takes the longer of the two."""
    source: str = "recipes/step_time.py"
    """The model the estimate comes from (the dry run names it)."""

    @property
    def total_s(self) -> float:
        """One step."""
        return max(self.rollout_s, self.training_s) if self.overlapped else self.rollout_s + self.training_s


def estimate_step_time(spec, layout, cfg) -> StepTime:
    """The step time of ``cfg`` on ``layout`` (a `memory.ParallelLayout` after overrides) for ``spec``.

    Evaluation (every ``eval.every`` steps) is not included, nor the weight sync but with
    streaming rollouts (`step_model.streaming_step`, the calibrated model).
    """
    from stapo_megatron.bridge.hf_config import num_active_params, num_params
    from stapo_megatron.recipes.memory import memory_estimate

    if cfg.rollout.streaming and layout.engine_ranks:
        from stapo_megatron.recipes import step_model

        rollout_s, training_s = step_model.streaming_step(step_model.streaming_job(spec, layout, cfg))
        return StepTime(rollout_s=rollout_s, training_s=training_s, overlapped=True,
                        source="recipes/step_model.py, the simulator's calibrated model")

    n = num_params(spec)  # decode reads every weight (a batch of sequences touches every expert)
    sequences = cfg.prompts_per_step * cfg.rollout.group_size
    mean_response = MEAN_RESPONSE_FRACTION * cfg.rollout.max_response_len
    mean_seq = MEAN_PROMPT_TOKENS + mean_response
    # rollout: each engine decodes its share, as many at once as its KV cache holds
    vtp = layout.vllm_tensor_parallel_size
    engines = (layout.engine_ranks or layout.world_size) // vtp  # separate placement: its engine GPUs
    per_engine = math.ceil(sequences / engines)
    kv_tokens = memory_estimate(spec, layout).vllm_kv_tokens
    concurrent = max(1, min(per_engine, int(kv_tokens / mean_seq)))
    decode_steps = max(per_engine * mean_response / concurrent, cfg.rollout.max_response_len)
    kv_bytes_per_token = 2 * spec.num_layers * spec.kv_size * 2 / vtp
    bytes_per_decode = 2 * n / vtp + concurrent * (mean_seq / 2) * kv_bytes_per_token
    rollout_s = decode_steps * bytes_per_decode / (HBM_BYTES_PER_S * DECODE_EFFICIENCY)
    # training: 2N (active) per token and forward pass (+ causal attention); the update is a
    # forward and a backward of twice its FLOPs, plus the recomputed forward with full recompute
    update = 3 + (cfg.model.recompute_granularity == "full")
    forwards = 1 + (cfg.loss.tau_h_source == "exact") + (cfg.loss.kl_coef > 0) + update
    attention = 2 * 2 * spec.num_layers * (mean_seq / 2) * spec.q_size
    flops = forwards * (2 * num_active_params(spec) + attention) * sequences * mean_seq
    training_s = flops / (layout.training_ranks * PEAK_BF16_FLOPS * TRAIN_MFU)
    return StepTime(rollout_s=rollout_s, training_s=training_s,
                    overlapped=bool(layout.engine_ranks) and cfg.rollout.max_staleness > 0)


def signal_seconds(step: StepTime) -> int:
    """Seconds before the time limit at which to save and stop: one and a half steps plus a save,
    in whole minutes, at least 10 minutes."""
    return max(600, 60 * math.ceil((1.5 * step.total_s + SAVE_S) / 60))


def jobs_needed(steps: int, step: StepTime, time_limit_s: float, signal_s: float) -> int:
    """Slurm jobs of ``time_limit_s`` that a run of ``steps`` steps needs (each loses its start-up
    and the time after the save signal)."""
    useful = time_limit_s - signal_s - JOB_STARTUP_S
    if useful <= step.total_s:
        raise ValueError(f"a time limit of {time_limit_s / 3600:.1f} h leaves {useful / 60:.0f} min after start-up "
                         f"and the save signal: less than one step (~{step.total_s / 60:.1f} min)")
    return math.ceil(steps * step.total_s / useful)


def parse_slurm_time(text: str) -> float:
    """Seconds of an sbatch ``--time`` value: [D-]HH:MM:SS, HH:MM or MM."""
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if len(parts) == 3:
        h, m, s = parts
    elif len(parts) == 2:
        (h, m), s = parts, 0
    else:
        h, m, s = 0, parts[0], 0
    return ((int(days) if days else 0) * 24 + h) * 3600 + m * 60 + s
