"""The cost model under the rollout-schedule simulator (`sim_schedules.py`): hardware, model
shapes, the length distribution, one vLLM engine's decode iteration and the training phases.

It is a model, not a measurement: the efficiency figures in `Efficiency` are fitted to two
published runs (`sim_calibrate.py`: NeMo-RL's Llama-3.1-8B GRPO and verl fully-async's
Qwen2.5-Math-7B phase table) and every other figure is a stated datasheet value or prior.

- **Decode** (`DecodeModel`): one iteration of an engine on ``tp`` GPUs over n active sequences
  whose contexts sum to C costs ``weight_s + kv_s_per_token * C + seq_s * n``: reading the bf16
  weights and every active KV cache at the achieved HBM rate, each sequence's matmuls at
  ``decode_mfu`` of the peak, and a fixed per-iteration overhead (scheduler, sampling, kernel
  launches; 2 TP all-reduces per layer when tp > 1). A mixture of experts computes with its
  active parameters (`ModelSpec.active_params`) and reads its dense weights and the experts its
  n sequences are routed to (`DecodeModel.expert_weight_s`).
- **Training** (`train_phase_s`): the pi_old forward (2N FLOPs a token plus causal attention)
  and the update (6N, 8N with activation recompute, plus attention) at an MFU that falls as the
  tokens each GPU trains in the step shrink: ``mfu(w) = mfu_max * w / (w + half_tokens)``, i.e.
  every phase pays a fixed cost worth ``half_tokens`` tokens a GPU (optimizer steps, gradient
  reductions, launch and packing overheads) on top of its FLOPs. The curve's shape comes from
  verl's colocated rows at 32, 64 and 128 GPUs on one batch (`sim_calibrate.VERL_ROWS`).
- **Switching** (`switch_s`): colocated, every step sleeps the engines, wakes the trainer, and
  wakes the engines and reloads the weights in place; separate, the trainers send bf16 weights
  over the network and an engine pauses while it loads them.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import List, Optional, Sequence, Tuple


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

    @property
    def kv_bytes_per_token(self) -> float:
        """bf16 K and V of every layer for one token."""
        return self.num_layers * self.kv_heads * self.kv_channels * 2 * 2

    @property
    def flop_params(self) -> float:
        """Parameters per token in the FLOP count: ``active_params``, else ``params``."""
        return self.params if self.active_params is None else self.active_params


QWEN3_8B = ModelSpec("Qwen3-8B", params=8.19e9, num_layers=36, attn_width=4096, kv_heads=8)
LLAMA31_8B = ModelSpec("Llama-3.1-8B", params=8.03e9, num_layers=32, attn_width=4096, kv_heads=8)
QWEN25_MATH_7B = ModelSpec("Qwen2.5-Math-7B", params=7.62e9, num_layers=28, attn_width=3584, kv_heads=4)
QWEN3_30B_A3B = ModelSpec("Qwen3-30B-A3B", params=30.5e9, num_layers=48, attn_width=4096, kv_heads=4,
                          active_params=3.35e9, expert_params=29.0e9, expert_share=8 / 128)
"""Its HF config.json: 48 layers of 32 query and 4 KV heads of 128 and an MoE of 128 experts of
width 768 (top-8), hidden 2048, 151,936 tokens untied: 30.5B parameters, 29.0B of them in experts
(48 x 128 x 3 x 2048 x 768), 3.35B a token (attention 18.9M, 8 experts 37.7M and the router 0.26M
a layer, and both embeddings, counted as the dense models' are)."""


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """What the hardware achieves. The first five are fitted (`sim_calibrate.fit`, printed by
    ``python benchmarks/sim_calibrate.py --fit``); the rest are priors, not fitted."""

    iteration_overhead_s: float = 5.51e-3
    """Fixed cost of a decode iteration (fitted)."""
    decode_mfu: float = 0.463
    """Achieved share of the peak in decode matmuls (fitted)."""
    forward_mfu: float = 0.492
    """Ceiling of the pi_old forward's MFU (fitted)."""
    update_mfu: float = 0.864
    """Ceiling of the update's MFU, recompute FLOPs counted (fitted)."""
    half_tokens: float = 1.786e5
    """Tokens a GPU trains per step at which a phase runs at half its ceiling (fitted)."""
    hbm_efficiency: float = 1 / 1.16
    """Achieved share of the HBM bandwidth: this project's log-prob op reached 1/1.16 of its
    HBM bound on an H100 (RESULTS.md, "Log-prob/entropy op")."""
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


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Prompts uniform in ``prompt_range``; responses log-normal (``response_median``,
    ``response_sigma``) capped at ``response_cap`` tokens."""

    prompt_range: Tuple[int, int]
    response_median: float
    response_sigma: float
    response_cap: int

    def mean_response(self) -> float:
        """E[min(X, cap)] of the log-normal X."""
        mu, s, c = math.log(self.response_median), self.response_sigma, self.response_cap
        phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
        return (math.exp(mu + s * s / 2) * phi((math.log(c) - mu - s * s) / s)
                + c * (1 - phi((math.log(c) - mu) / s)))

    def with_mean_response(self, mean: float) -> "Lengths":
        """The same shape with the median that gives a capped mean of ``mean`` tokens."""
        if not 0 < mean < self.response_cap:
            raise ValueError(f"mean response {mean} must lie in (0, response_cap={self.response_cap})")
        lo, hi = 1.0, float(self.response_cap) * 10
        for _ in range(100):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if dataclasses.replace(self, response_median=mid).mean_response() < mean else (lo, mid)
        return dataclasses.replace(self, response_median=math.sqrt(lo * hi))


PAPER_LENGTHS = Lengths((100, 1024), response_median=3000, response_sigma=0.9, response_cap=15360)
"""The paper's regime (`benchmarks/bench_packing.py` at full scale)."""


@dataclasses.dataclass
class Prompt:
    index: int
    prompt_len: int
    responses: List[int]


def sample_prompts(lengths: Lengths, num: int, group: int, seed: int, first_index: int = 0) -> List[Prompt]:
    """``num`` prompts with ``group`` response lengths each."""
    rng = random.Random(seed)
    mu, s = math.log(lengths.response_median), lengths.response_sigma
    return [Prompt(first_index + i, rng.randint(*lengths.prompt_range),
                   [min(lengths.response_cap, max(1, int(math.exp(mu + s * rng.gauss(0, 1))))) for _ in range(group)])
            for i in range(num)]


def sample_tokens(prompts: Sequence[Prompt]) -> List[int]:
    """Prompt + response length of every sample of ``prompts``."""
    return [p.prompt_len + r for p in prompts for r in p.responses]


@dataclasses.dataclass
class DecodeModel:
    """Seconds of one decode iteration: ``weight_s + kv_s_per_token * sum(contexts) + seq_s * n``."""

    weight_s: float
    kv_s_per_token: float
    seq_s: float
    prefill_s_per_token: float
    kv_capacity_tokens: int = 10**12
    """Context tokens the KV cache holds: a sequence waits for room before it starts, and a full
    cache preempts the newest running sequence (`sim_engine.Engine`)."""
    max_num_seqs: int = 10**9
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
                       seq_s=2 * model.flop_params / (flops * eff.decode_mfu),
                       prefill_s_per_token=2 * model.flop_params / (flops * eff.prefill_mfu),
                       kv_capacity_tokens=int(kv_gb * 1e9 / model.kv_bytes_per_token), max_num_seqs=eff.max_num_seqs,
                       expert_weight_s=2 * model.expert_params / bw, expert_share=model.expert_share)


def train_phase_s(model: ModelSpec, hw: Hardware, eff: Efficiency, tokens: Sequence[int], gpus: int,
                  phase: str, recompute: bool = False) -> float:
    """Seconds of the pi_old forward (``phase="forward"``) or the update (``"update"``) over
    sequences of ``tokens`` on ``gpus`` GPUs."""
    if phase not in ("forward", "update"):
        raise ValueError(f"phase must be 'forward' or 'update', got {phase!r}")
    passes = 1 if phase == "forward" else 3 + int(recompute)  # backward = 2 forwards
    mfu_max = eff.forward_mfu if phase == "forward" else eff.update_mfu
    total = sum(tokens)
    attention = 4 * model.num_layers * model.attn_width * sum(n * n / 2 for n in tokens)
    flops = passes * (2 * model.flop_params * total + attention)
    per_gpu = total / gpus
    mfu = mfu_max * per_gpu / (per_gpu + eff.half_tokens)
    return flops / (gpus * hw.peak_tflops * 1e12 * mfu)


def switch_s(model: ModelSpec, eff: Efficiency, colocated: bool) -> float:
    """Colocated: sleep, wake and reload in place; separate: the network transfer of the weights."""
    weights_gb = 2 * model.params / 1e9
    if colocated:
        return eff.sleep_wake_s + weights_gb / eff.refit_gb_per_s
    return weights_gb / eff.transfer_gb_per_s
