"""The configuration tree: every dataclass a run is configured with (recipes are functions that return one).

    TrainerConfig                 one run (steps, batch sizes, seeds, checkpoints, timeouts)
      .model   ModelConfig        which model, at which parallel layout
      .data    DataConfig         prompts for training and the held-out set
      .rollout RolloutSampling    how responses are sampled (shares `EngineResources` with
                                  the engine's `RolloutConfig`, built by `engine_config`)
      .loss    LossConfig         the method (`stapo_megatron.method.registry`) and its constants
      .optim   OptimConfig        AdamW
      .logging LoggingConfig      where metrics go besides metrics.jsonl (TensorBoard, W&B, MLflow)
      .reward  RewardConfig       the reward function and its worker processes
      .eval    EvalConfig         held-out evaluation: every, temperature, samples, max length,
                                  and .sets [EvalSetConfig], named sets (benchmarks)
      .lora    LoraConfig | None  LoRA adapters on the policy, the base frozen (None: full fine-tuning)
    WarmStartConfig               the supervised warm-start before RL (CPU demo)

Every field has a one-line (or longer) docstring under it. Defaults are the paper's recipe
(JustRL hyperparameters + S2T) where it has one; the embedded CPU default lives in
``stapo_megatron/recipes/``. Command-line overrides use NeMo-Run's ``key=value`` form in the
launch scripts and are applied by the one parser, ``stapo_megatron.config.overrides``; the library never
parses argv.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import textwrap
import warnings
from typing import ClassVar, Dict, Optional

from stapo_megatron.config.parallel_layout import config_problems
from stapo_megatron.data.config import DataConfig
from stapo_megatron.eval.config import EvalConfig, EvalSetConfig, eval_set_configs
from stapo_megatron.method.config import LossConfig
from stapo_megatron.method.objectives import check_parallelism
from stapo_megatron.rewards.config import RewardConfig
from stapo_megatron.rollout.config import EngineResources, RolloutConfig, RolloutSampling
from stapo_megatron.runlog.config import LoggingConfig
from stapo_megatron.mcore.config import ModelConfig, OptimConfig
from stapo_megatron.mcore.lora_config import LoraConfig
from stapo_megatron.utils import check_at_least

__all__ = ["TrainerConfig", "field_docs"]


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
    """Sequences per micro-batch (padded, ``packing="padded"``, and ``packing="fixed"``)."""
    packing: str = "padded"
    """How a mini-batch becomes micro-batches (`stapo_megatron.batch.alignment.PACKING_MODES`, built by
    `stapo_megatron.batch.packing`): "padded" right-pads
    ``micro_batch_size`` sequences to the step's longest ([N, S] rows); "fixed" packs the same
    sequences end to end (THD, no padding); "budget" packs whole sequences up to
    ``max_tokens_per_microbatch`` tokens per micro-batch, the same number of micro-batches on every
    DP rank with near-equal tokens (sequences are exchanged between DP ranks to balance them).
    The statistics (kept-token normaliser, tau_H) are over the whole mini-batch in every mode.
    Packing needs no pipeline parallelism (not supported yet)."""
    max_tokens_per_microbatch: int = 0
    """With ``packing="budget"``: the token budget of one micro-batch on one rank (prompt +
    response tokens of whole sequences, a sequence is never split over micro-batches). With
    context parallelism it counts the tokens one CP rank holds after the split: a sequence of L
    tokens is padded to a multiple m of 2 x CP (x TP with sequence parallelism) and each rank
    holds L_padded / CP of it, so a sequence longer than the budget trains. At least that for
    ``data.max_prompt_len + rollout.max_response_len``. The peers' names: verl ``ppo_max_token_len_per_gpu`` (``use_dynamic_bsz``),
    NeMo-RL ``dynamic_batching.train_mb_tokens`` / ``sequence_packing.train_mb_tokens``, slime
    ``--max-tokens-per-gpu``."""
    lr_warmup_steps: int = 10
    """Training steps (rollout batches, not optimizer steps) of linear warm-up from lr 0, then
    constant: step s (0-based) trains at lr * min(1, s / lr_warmup_steps), as veRL's
    constant-with-warm-up schedule does (the paper: 10). 0 = no warm-up."""
    seed: int = 1234
    """Seeds data order, sampling and the random-control mask."""
    save_every: int = 10
    """Checkpoint every this many steps (and at the end); 0 = never."""
    keep_last: int = 0
    """Keep only this many newest complete checkpoints (older ``step_*`` folders are deleted after
    each save; the one ``latest`` names never is); 0 = keep all. A 14B checkpoint with optimizer
    state is about 200 GB."""
    max_consecutive_skips: int = 3
    """Stop with an error after this many consecutive steps with a NaN/Inf loss or gradient."""
    init_timeout_s: float = 180.0
    """How long a rank waits for every other rank to join the process group (the ``timeout`` of
    ``torch.distributed.init_process_group``, default 30 min on gloo): a rank or node that fails
    before it (bad input, import error, lost node) ends the whole job after at most this long."""
    distributed_timeout_s: float = 600.0
    """How long a collective waits for a rank that stopped answering once the group has formed
    (Megatron's ``--distributed-timeout-minutes``, 10); a rank that dies is noticed at once."""
    rollout_timeout_s: Optional[float] = None
    """How long the ranks wait for each other's rollouts (and evaluation samples): the
    collectives of those phases, where the fastest DP rank waits for the slowest engine. None =
    `rollout_timeout`'s bound from the longest response, never below ``distributed_timeout_s``."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """Model and training parallelism."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Prompt data."""
    rollout: RolloutSampling = dataclasses.field(default_factory=RolloutSampling)
    """Sampling."""
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    """Policy loss (``method``: a name of `stapo_megatron.method.registry.METHODS`)."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """AdamW (the paper: lr 1e-6, weight decay 0.1, grad clip 1.0)."""
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    """Experiment tracking: TensorBoard, Weights & Biases, MLflow."""
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    """The reward function and its worker processes (``reward.name``, ``reward.workers``,
    ``reward.timeout_s``)."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """In-training evaluation: when (``eval.every``), how (``eval.temperature``,
    ``eval.samples``, ``eval.max_response_len``) and the named sets (``eval.sets``)."""
    lora: Optional[LoraConfig] = None
    """LoRA: low-rank adapters on the policy's parallel linears, the base model frozen and the
    optimizer holding only the adapters; the KL reference is the base with the adapters off and
    the rollout engine gets the merged weights (docs/lora.md). None: full fine-tuning. Setting any
    of its fields (``lora.rank=16``) turns it on with the other fields' defaults; ``lora=none``
    turns it off."""

    RENAMED_FIELDS: ClassVar[Dict[str, str]] = {
        "reward": "reward.name", "reward_timeout_s": "reward.timeout_s", "reward_workers": "reward.workers",
        "eval_every": "eval.every", "eval_temperature": "eval.temperature", "eval_samples": "eval.samples",
        "eval_max_response_len": "eval.max_response_len", "eval_sets": "eval.sets",
    }
    """Flat keys of earlier versions and the key each is now (`stapo_megatron.config.overrides`
    refuses an old key, on the command line and in a config YAML, with a message naming the new
    one); ``reward`` given a value instead of a section means ``reward.name``."""

    def __post_init__(self):
        check_at_least(self, 0, "steps", "lr_warmup_steps", "save_every", "max_consecutive_skips", "keep_last")
        check_at_least(self, 1, "prompts_per_step", "minibatch_prompts", "micro_batch_size")
        for name in ("init_timeout_s", "distributed_timeout_s", "rollout_timeout_s"):
            if name == "rollout_timeout_s" and self.rollout_timeout_s is None:
                continue
            if not (0 < getattr(self, name) and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be finite and > 0, got {getattr(self, name)}")
        if not isinstance(self.reward, RewardConfig):  # the reward's name was a flat field once
            raise ValueError(f"TrainerConfig.reward is a RewardConfig section, got {self.reward!r}: "
                             f"give its name as reward.name (RewardConfig(name={self.reward!r}))")
        if not isinstance(self.eval, EvalConfig):
            raise ValueError(f"TrainerConfig.eval must be an EvalConfig, got {type(self.eval).__name__}")
        # the parallel layout's checks that need no world size (`stapo_megatron.config.parallel_layout`)
        problems = config_problems(self)
        if problems:
            raise ValueError(problems[0])
        check_parallelism(self.loss.effective_objective, self.model.context_parallel_size)
        # adapter-only sync (rollout/vllm_lora.py), colocated or to the engine ranks; streaming is the
        # engine's capability (RolloutSampling refuses it)
        if self.rollout.engine == "vllm_lora":
            if self.lora is None:
                raise ValueError("rollout.engine='vllm_lora' syncs LoRA adapters, but lora is None: set the lora "
                                 "section (lora.rank=...) or choose rollout.engine='vllm'")
            if self.lora.experts or self.model.pipeline_model_parallel_size > 1:
                raise ValueError(f"rollout.engine='vllm_lora' syncs dense adapters at pipeline parallel size 1; got "
                                 f"lora.experts={self.lora.experts}, model.pipeline_model_parallel_size="
                                 f"{self.model.pipeline_model_parallel_size}: use rollout.engine='vllm' (merged sync)")
        if self.rollout.separate.max_staleness >= 1 and self.loss.rollout_correction.mode == "none":
            warnings.warn(f"rollout.separate.max_staleness={self.rollout.separate.max_staleness} with loss.rollout_correction.mode="
                          f"'none': stale samples train without a behaviour-policy correction (pi_old / "
                          f"pi_rollout); set loss.rollout_correction.mode='tis' (or 'icepop') (docs/async.md)",
                          stacklevel=2)
        # The loss recomputes pi_old and pi_theta at loss.temperature; sampling at another
        # temperature would make every ratio, entropy and S2T decision refer to a distribution
        # the responses were not drawn from.
        if self.rollout.temperature != self.loss.temperature:
            raise ValueError(
                f"rollout.temperature={self.rollout.temperature} but loss.temperature={self.loss.temperature}: "
                f"the loss must see the distribution the responses were sampled from; set both "
                f"(rollout.temperature={self.rollout.temperature} loss.temperature={self.rollout.temperature})"
            )

    def rollout_timeout(self) -> float:
        """The collective timeout of the rollout and evaluation phases, in seconds:
        ``rollout_timeout_s``, or ``SECONDS_PER_RESPONSE_TOKEN`` x the longest response
        (training or evaluation) but at least ``distributed_timeout_s``."""
        if self.rollout_timeout_s is not None:
            return self.rollout_timeout_s
        longest = max(self.rollout.max_response_len, self.eval.max_response_len or 0)
        return max(self.distributed_timeout_s, SECONDS_PER_RESPONSE_TOKEN * longest)

    def longest_sequence(self) -> int:
        """The longest sequence an engine holds: the prompt limit plus training's or evaluation's
        response limit, whichever is longer."""
        return self.data.max_prompt_len + max(self.rollout.max_response_len, self.eval.max_response_len or 0)


SECONDS_PER_RESPONSE_TOKEN = 0.2
"""A bound on the wall time per decoded token of the slowest sequence, for the derived
`TrainerConfig.rollout_timeout`: a decode step of a 14B engine with a DP rank's 128 sequences
takes some 25-60 ms on an H100 (eager mode at the upper end), so the 15,360-token paper responses
get 3072 s (4x headroom over ~770 s) and the 20,480-token evaluation 4096 s."""
