"""The configuration tree: every dataclass a run is configured with (recipes are functions that return one).

    TrainerConfig                 one run (steps, batch sizes, seeds, evaluation, checkpoints)
      .model   ModelConfig        which model, at which parallel layout
      .data    DataConfig         prompts for training and the held-out set
      .rollout RolloutSampling    how responses are sampled (shares `EngineResources` with
                                  the engine's `RolloutConfig`, built by `engine_config`)
      .loss    LossConfig         the method (`stapo_megatron.method.registry`) and its constants
      .optim   OptimConfig        AdamW
      .eval_sets [EvalSetConfig]  named evaluation sets (benchmarks), scored every eval_every
      .logging LoggingConfig      where metrics go besides metrics.jsonl (TensorBoard, W&B, MLflow)
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
from typing import Any, Dict, List, Optional

from stapo_megatron.config.overrides import unknown_field_error
from stapo_megatron.data.config import DataConfig
from stapo_megatron.eval.config import EvalSetConfig
from stapo_megatron.method.config import LossConfig
from stapo_megatron.method.objectives import check_parallelism
from stapo_megatron.rollout.config import EngineResources, RolloutConfig, RolloutSampling
from stapo_megatron.runlog.config import LoggingConfig
from stapo_megatron.train.config import ModelConfig, OptimConfig
from stapo_megatron.trainer.config import WarmStartConfig
from stapo_megatron.utils import check_at_least

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
    """How a mini-batch becomes micro-batches (`stapo_megatron.train.packing`): "padded" right-pads
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
    eval_every: int = 10
    """Evaluation (held-out set and ``eval_sets``) every this many steps (and at step 0 and the
    end); 0 = never."""
    eval_temperature: float = 0.0
    """Held-out decoding temperature (0 = greedy)."""
    eval_samples: int = 1
    """Samples per held-out prompt (avg@k with k = this)."""
    eval_max_response_len: Optional[int] = None
    """Maximum response tokens of evaluation, the held-out set and ``eval_sets`` (the paper:
    20480); None = the training rollouts' ``rollout.max_response_len``."""
    save_every: int = 10
    """Checkpoint every this many steps (and at the end); 0 = never."""
    keep_last: int = 0
    """Keep only this many newest complete checkpoints (older ``step_*`` folders are deleted after
    each save; the one ``latest`` names never is); 0 = keep all. A 14B checkpoint with optimizer
    state is about 200 GB."""
    max_consecutive_skips: int = 3
    """Stop with an error after this many consecutive steps with a NaN/Inf loss or gradient."""
    reward: str = "math_verify"
    """The reward function: a name of `stapo_megatron.rewards.functions.REWARDS` ("math_verify": 1/0 by
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
    eval_sets: List[EvalSetConfig] = dataclasses.field(default_factory=list)
    """Named evaluation sets scored with the held-out set (every ``eval_every`` steps, at step 0
    and the end), sampled with ``eval_max_response_len`` tokens at most (as the held-out set);
    dicts of `EvalSetConfig` fields are accepted (what a ``key=value`` override gives)."""

    def __post_init__(self):
        check_at_least(self, 0, "steps", "lr_warmup_steps", "eval_every", "save_every", "max_consecutive_skips",
                        "keep_last")
        check_at_least(self, 1, "prompts_per_step", "minibatch_prompts", "micro_batch_size", "eval_samples",
                        "reward_workers")
        if self.eval_max_response_len is not None:
            check_at_least(self, 1, "eval_max_response_len")
        if not (0 <= self.eval_temperature and math.isfinite(self.eval_temperature)):
            raise ValueError(f"eval_temperature must be finite and >= 0 (0 = greedy), got {self.eval_temperature}")
        for name in ("reward_timeout_s", "init_timeout_s", "distributed_timeout_s", "rollout_timeout_s"):
            if name == "rollout_timeout_s" and self.rollout_timeout_s is None:
                continue
            if not (0 < getattr(self, name) and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be finite and > 0, got {getattr(self, name)}")
        self.eval_sets = eval_set_configs(self.eval_sets)
        self._check_packing()
        check_parallelism(self.loss.effective_objective, self.model.context_parallel_size)
        # vLLM's external launcher forms an engine from consecutive ranks, and Megatron's TP
        # groups are consecutive ranks too (TP is the innermost dimension); an engine wider than
        # a TP group would span two DP ranks, which sample different prompts.
        tp, vtp = self.model.tensor_model_parallel_size, self.rollout.tensor_parallel_size
        if tp % vtp:
            raise ValueError(
                f"vLLM TP {vtp} must divide Megatron TP {tp} (rollout.tensor_parallel_size={vtp}, "
                f"model.tensor_model_parallel_size={tp}): a vLLM engine must not span two DP ranks"
            )
        # The loss recomputes pi_old and pi_theta at loss.temperature; sampling at another
        # temperature would make every ratio, entropy and S2T decision refer to a distribution
        # the responses were not drawn from.
        if self.rollout.temperature != self.loss.temperature:
            raise ValueError(
                f"rollout.temperature={self.rollout.temperature} but loss.temperature={self.loss.temperature}: "
                f"the loss must see the distribution the responses were sampled from; set both "
                f"(rollout.temperature={self.rollout.temperature} loss.temperature={self.rollout.temperature})"
            )

    def _check_packing(self) -> None:
        modes = ("padded", "fixed", "budget")  # train.packing.PACKING_MODES (no torch import here)
        if self.packing not in modes:
            raise ValueError(f"packing must be one of {modes}, got {self.packing!r}")
        if self.packing != "padded" and self.model.pipeline_model_parallel_size > 1:
            raise ValueError(f"packing={self.packing!r} is not supported with pipeline parallelism yet "
                             f"(model.pipeline_model_parallel_size {self.model.pipeline_model_parallel_size}); "
                             f"use packing=padded")
        cp = self.model.context_parallel_size
        if cp > 1 and self.packing == "padded":
            raise ValueError(f"model.context_parallel_size {cp} needs packed micro-batches: packing='fixed' or "
                             f"'budget', got packing='padded'")
        if self.packing == "budget":
            longest = self.data.max_prompt_len + self.rollout.max_response_len
            # with CP the budget is one rank's tokens: the sequence padded to whole chunks, over CP
            # (train.context_parallel.sequence_multiple; not imported: the config tree stays torch-free)
            multiple = 1 if cp == 1 else 2 * cp * (self.model.tensor_model_parallel_size
                                                   if self.model.sequence_parallel else 1)
            per_rank = -(-longest // multiple) * multiple // cp
            if self.max_tokens_per_microbatch <= 0:
                raise ValueError(f"max_tokens_per_microbatch must be > 0 with packing='budget', "
                                 f"got {self.max_tokens_per_microbatch}")
            if self.max_tokens_per_microbatch < per_rank:
                raise ValueError(
                    f"max_tokens_per_microbatch {self.max_tokens_per_microbatch} < the longest sequence "
                    f"data.max_prompt_len + rollout.max_response_len = {self.data.max_prompt_len} + "
                    f"{self.rollout.max_response_len} = {longest}"
                    + (f", padded to a multiple of {multiple}, over context_parallel_size {cp} = {per_rank} tokens "
                       f"per rank" if cp > 1 else "")
                    + " (a sequence is never split between micro-batches; context parallelism splits it over its ranks)")

    def rollout_timeout(self) -> float:
        """The collective timeout of the rollout and evaluation phases, in seconds:
        ``rollout_timeout_s``, or ``SECONDS_PER_RESPONSE_TOKEN`` x the longest response
        (training or evaluation) but at least ``distributed_timeout_s``."""
        if self.rollout_timeout_s is not None:
            return self.rollout_timeout_s
        longest = max(self.rollout.max_response_len, self.eval_max_response_len or 0)
        return max(self.distributed_timeout_s, SECONDS_PER_RESPONSE_TOKEN * longest)


SECONDS_PER_RESPONSE_TOKEN = 0.2
"""A bound on the wall time per decoded token of the slowest sequence, for the derived
`TrainerConfig.rollout_timeout`: a decode step of a 14B engine with a DP rank's 128 sequences
takes some 25-60 ms on an H100 (eager mode at the upper end), so the 15,360-token paper responses
get 3072 s (4x headroom over ~770 s) and the 20,480-token evaluation 4096 s."""


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
