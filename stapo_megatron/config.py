"""The trainer's configuration tree (dataclasses; recipes are functions that return one).

Defaults are the paper's recipe (JustRL hyperparameters + S2T) where it has one; the embedded
CPU default lives in ``stapo_megatron/recipes/``. Command-line overrides use NeMo-Run's ``key=value``
form in the launch scripts; the library never parses argv.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from stapo_megatron.loss import LossConfig
from stapo_megatron.step import OptimConfig


def _check_at_least(obj, minimum: int, *names: str) -> None:
    """ValueError unless each integer field ``names`` of ``obj`` is >= ``minimum``."""
    for name in names:
        value = getattr(obj, name)
        if value < minimum:
            raise ValueError(f"{type(obj).__name__}.{name} must be >= {minimum}, got {value}")


@dataclasses.dataclass
class ModelConfig:
    """Which model, at which parallel layout."""

    hf_dir: str = ""
    """HF model folder (config.json, tokenizer, safetensors): architecture, tokenizer, and the
    folder vLLM starts from."""
    megatron_ckpt: Optional[str] = None
    """Initial weights as a Megatron dist checkpoint (`stapo-convert hf-to-mcore`); None keeps
    the random init (tiny demo models only)."""
    tensor_model_parallel_size: int = 1
    """Training TP."""
    pipeline_model_parallel_size: int = 1
    """Training PP."""
    bf16: bool = False
    """Train in bf16 (GPU); fp32 on CPU."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1): the activations outside the TP-split
    matmuls (norms, residuals) are split over the TP ranks along the sequence."""
    recompute_granularity: Optional[str] = None
    """Activation recomputation: None (off), "full" (keep only the inputs of recomputed layers
    and rerun them in backward) or "selective" (recompute the attention core only)."""
    recompute_method: Optional[str] = None
    """With "full": "uniform" (layers in groups of ``recompute_num_layers``, each group's input
    kept) or "block" (recompute only the first ``recompute_num_layers`` layers of a stage)."""
    recompute_num_layers: Optional[int] = None
    """With "full": layers per group ("uniform") or recomputed layers per stage ("block")."""

    def __post_init__(self):
        _check_at_least(self, 1, "tensor_model_parallel_size", "pipeline_model_parallel_size")


@dataclasses.dataclass
class DataConfig:
    """Prompts for training and the held-out set."""

    train_path: Optional[str] = None
    """JSONL/parquet with `prompt` and `answer` (or DAPO-Math-17k's layout); None = generate."""
    eval_path: Optional[str] = None
    """Held-out JSONL/parquet; None = generate."""
    dedupe: bool = False
    """Keep one copy of repeated training problems (the published DAPO-Math-17k parquet repeats
    each problem about 100 times)."""
    reasoning_gym_task: str = "basic_arithmetic"
    """reasoning-gym task used when no paths are given (offline generator)."""
    reasoning_gym_kwargs: dict = dataclasses.field(default_factory=dict)
    """Extra arguments of the reasoning-gym task."""
    num_train: int = 2000
    """Generated training prompts."""
    num_eval: int = 100
    """Generated held-out prompts."""
    max_prompt_len: int = 1024
    """Longer prompts are dropped (counted, warned)."""
    use_chat_template: bool = True
    """Wrap questions in the tokenizer's chat template (plus the paper's suffix)."""

    def __post_init__(self):
        _check_at_least(self, 0, "num_train", "num_eval")
        _check_at_least(self, 1, "max_prompt_len")


@dataclasses.dataclass
class RolloutSampling:
    """How responses are sampled."""

    group_size: int = 8
    """G responses per prompt."""
    temperature: float = 1.0
    """Sampling temperature (the loss uses the same)."""
    top_p: float = 1.0
    """Nucleus sampling."""
    max_response_len: int = 15360
    """Maximum response tokens."""
    engine: str = "auto"
    """Rollout engine: "vllm" (`VLLMEngine`), "hf" (`HFEngine`: transformers ``generate``, no
    vLLM needed, no rollout TP) or "auto" (vLLM where it is installed, else hf)."""
    tensor_parallel_size: int = 1
    """vLLM's own TP."""
    gpu_memory_utilization: float = 0.5
    """vLLM's share of GPU memory (colocated with training; freed by sleep mode)."""
    sleep_during_training: bool = True
    """GPU: put vLLM to sleep (level 1: weights to host memory, KV cache freed) after each
    rollout and wake it before the weight sync, so training gets the memory. No-op on CPU."""

    def __post_init__(self):
        # group advantages (r - mean) / std need two responses per prompt
        _check_at_least(self, 2, "group_size")
        _check_at_least(self, 1, "max_response_len", "tensor_parallel_size")
        # `not (a < x ...)` also refuses NaN, which every comparison fails
        if not (0 < self.temperature and math.isfinite(self.temperature)):
            raise ValueError(f"RolloutSampling.temperature must be finite and > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"RolloutSampling.top_p must be in (0, 1], got {self.top_p}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"RolloutSampling.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclasses.dataclass
class TrainerConfig:
    """One STAPO training run."""

    run_dir: str = "runs/stapo"
    """Where metrics, plots, inspector output and checkpoints go."""
    steps: int = 100
    """Training steps (rollout batches)."""
    prompts_per_step: int = 256
    """Prompts per step over all DP ranks (the paper: 256)."""
    minibatch_prompts: int = 64
    """Prompts per PPO mini-batch (the paper: 64, so 4 optimizer steps per rollout batch)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch."""
    lr_warmup_steps: int = 10
    """Optimizer steps of linear warm-up, then constant (the paper: 10)."""
    seed: int = 1234
    """Seeds data order, sampling and the random-control mask."""
    eval_every: int = 10
    """Held-out evaluation every this many steps (and at step 0 and the end); 0 = never."""
    eval_temperature: float = 0.0
    """Held-out decoding temperature (0 = greedy)."""
    eval_samples: int = 1
    """Samples per held-out prompt (avg@k with k = this)."""
    save_every: int = 10
    """Checkpoint every this many steps (and at the end); 0 = never."""
    max_consecutive_skips: int = 3
    """Stop with an error after this many consecutive steps with a NaN/Inf loss or gradient."""
    reward_timeout_s: float = 5.0
    """Time bound of one math-verify check."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """Model and training parallelism."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Prompt data."""
    rollout: RolloutSampling = dataclasses.field(default_factory=RolloutSampling)
    """Sampling."""
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    """Policy loss (``method``: a name of `stapo_megatron.methods.METHODS`)."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """AdamW (the paper: lr 1e-6, weight decay 0.1, grad clip 1.0)."""

    def __post_init__(self):
        _check_at_least(self, 0, "steps", "lr_warmup_steps", "eval_every", "save_every", "max_consecutive_skips")
        _check_at_least(self, 1, "prompts_per_step", "minibatch_prompts", "micro_batch_size", "eval_samples")
        if not (0 <= self.eval_temperature and math.isfinite(self.eval_temperature)):
            raise ValueError(f"eval_temperature must be finite and >= 0 (0 = greedy), got {self.eval_temperature}")
        if not (0 < self.reward_timeout_s and math.isfinite(self.reward_timeout_s)):
            raise ValueError(f"reward_timeout_s must be finite and > 0, got {self.reward_timeout_s}")
        # The loss recomputes pi_old and pi_theta at loss.temperature; sampling at another
        # temperature would make every ratio, entropy and S2T decision refer to a distribution
        # the responses were not drawn from.
        if self.rollout.temperature != self.loss.temperature:
            raise ValueError(
                f"rollout.temperature={self.rollout.temperature} but loss.temperature={self.loss.temperature}: "
                f"the loss must see the distribution the responses were sampled from; set both "
                f"(rollout.temperature={self.rollout.temperature} loss.temperature={self.rollout.temperature})"
            )
        if self.loss.kl_coef > 0:
            raise ValueError(
                f"loss.kl_coef={self.loss.kl_coef} needs a reference model's log-probs, which this trainer "
                "does not compute (the paper uses no KL term); set loss.kl_coef=0"
            )
