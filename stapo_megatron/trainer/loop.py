"""The STAPO training loop (docs/design.md, "One training step"), SPMD: one process per device.

Per step: (1) this DP rank's prompts; (2) rollouts (vLLM, or transformers where vLLM is not
installed: ``RolloutSampling.engine``), G per prompt, in this process;
(3) math rewards; (4) group advantages (groups stay whole on one DP rank); (5) pi_old log-probs
and entropies with the Megatron model; (6) per PPO mini-batch the STAPO loss through Megatron's
forward_backward and an optimizer step; (7) weight sync Megatron -> vLLM; (8) metrics, evaluation
(held-out set and named sets, through ``evaluation.py``), checkpoint. Started by torchrun (or srun
through NeMo-Run): ``train(config)``.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import time
import warnings
from functools import partial
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from stapo_megatron.train import checkpoint as ckpt

from stapo_megatron.trainer import faults

from stapo_megatron.trainer import warmstart as warmstart_cache
from stapo_megatron.train.batching import group_advantages, pack_sequences, split_microbatches
from stapo_megatron.config import TrainerConfig, WarmStartConfig
from stapo_megatron.eval.config import Decoding
from stapo_megatron.eval.scoring import Counts, load_eval_set, score_responses, summarize
from stapo_megatron.runlog.metrics import RunLogger
from stapo_megatron.runlog.plots import plot_run
from stapo_megatron.train.parallel import Groups, collective_device, destroy_parallel, init_parallel
from stapo_megatron.trainer.preemption import SaveOnSignal, StoppedForRequeue
from stapo_megatron.runlog.progress import Progress, describe
from stapo_megatron.runlog.provenance import RunProvenance
from stapo_megatron.train.reference import add_reference_logprobs, frozen_copy, reset_reference
from stapo_megatron.train.schedule import compute_logprob_entropy
from stapo_megatron.trainer.seeds import Seeds
from stapo_megatron.train.sft import sft_step
from stapo_megatron.train.step import build_optimizer, policy_update, wrap_ddp


def _import_dotted(path: str, field: str):
    """The object a dotted path ``package.module.name`` names; a ValueError naming ``field`` if none."""
    module_name, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{field} = {path!r} does not name an importable object: {e}") from None


def _pad_to(n: int, multiple: int = 8) -> int:
    return (n + multiple - 1) // multiple * multiple


def _memory_settings(cfg: TrainerConfig) -> Dict:
    """ModelConfig's sequence parallelism / recomputation as Megatron TransformerConfig fields."""
    m = cfg.model
    out = {}
    if m.sequence_parallel:
        if m.tensor_model_parallel_size < 2:
            raise ValueError("model.sequence_parallel needs tensor_model_parallel_size > 1")
        out["sequence_parallel"] = True
    if m.recompute_granularity:
        out["recompute_granularity"] = m.recompute_granularity
        if m.recompute_granularity == "full":
            out["recompute_method"] = m.recompute_method or "uniform"
            out["recompute_num_layers"] = m.recompute_num_layers or 1
    return out


def _reduce_from_last_stage(values: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Sum a last-stage tensor over DP, then broadcast it over PP: the same on every rank."""
    if groups.is_last_stage and groups.dp is not None:
        dist.all_reduce(values, group=groups.dp)
    if groups.pp is not None and dist.get_world_size(groups.pp) > 1:
        dist.broadcast(values, src=groups.pp_last_rank, group=groups.pp)
    return values


class _Timer:
    def __init__(self):
        self.seconds: Dict[str, float] = {}

    def __call__(self, name):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[f"time_{name}"] = timer.seconds.get(f"time_{name}", 0.0) + time.perf_counter() - self.t0

        return _Ctx()


def _load_data(cfg: TrainerConfig, tokenizer):
    from stapo_megatron.data import examples as data

    if cfg.data.train_path:
        fields = dict(prompt_field=cfg.data.prompt_field, answer_field=cfg.data.answer_field)
        train = data.load_examples(cfg.data.train_path, dedupe=cfg.data.dedupe, **fields)
        if not cfg.data.eval_path:
            raise ValueError("data.train_path is set but data.eval_path is not: give a held-out file")
        held_out = data.load_examples(cfg.data.eval_path, **fields)
    else:
        train, held_out = data.reasoning_gym_split(
            cfg.data.reasoning_gym_task, cfg.data.num_train, cfg.data.num_eval, Seeds(cfg.seed, data_seed=cfg.data.seed).data_split,
            **cfg.data.reasoning_gym_kwargs,
        )
    out = []
    for examples in (train, held_out):
        ids, kept, _ = data.tokenize_prompts(
            tokenizer, examples, cfg.data.max_prompt_len, cfg.data.use_chat_template, cfg.data.prompt_template
        )
        out.append((ids, kept))
    return out


def _load_eval_sets(cfg: TrainerConfig, tokenizer) -> List[Tuple]:
    """``TrainerConfig.eval_sets`` loaded and tokenized as the held-out set is: (EvalSet with the
    kept problems, their prompt token ids) per set."""
    from stapo_megatron.data import examples as data

    out = []
    for set_cfg in cfg.eval_sets:
        eval_set = load_eval_set(set_cfg)
        ids, eval_set.examples, _ = data.tokenize_prompts(
            tokenizer, eval_set.examples, cfg.data.max_prompt_len, cfg.data.use_chat_template
        )
        out.append((eval_set, ids))
    return out


class Trainer:
    """Holds the model, optimizer, rollout engine and scorer of one run; ``run()`` trains."""

    def __init__(self, cfg: TrainerConfig, warmstart: Optional[WarmStartConfig] = None):
        from transformers import AutoTokenizer

        from stapo_megatron.bridge.config import load_hf_config
        from stapo_megatron.bridge.model import build_gpt_model, load_checkpoint

        if cfg.prompts_per_step % cfg.minibatch_prompts:
            raise ValueError(
                f"prompts_per_step {cfg.prompts_per_step} must be a multiple of minibatch_prompts {cfg.minibatch_prompts}"
            )
        self.cfg, self.warmstart = cfg, warmstart
        self.seeds = Seeds(cfg.seed, warmstart.seed if warmstart else None, cfg.data.seed)
        self.groups = init_parallel(
            cfg.model.tensor_model_parallel_size, cfg.model.pipeline_model_parallel_size, seed=self.seeds.model_init,
            init_timeout_s=cfg.init_timeout_s, timeout_s=cfg.distributed_timeout_s,
        )
        self.rank = dist.get_rank()
        self.dp_size = dist.get_world_size(self.groups.dp)
        self.dp_rank = dist.get_rank(self.groups.dp)
        if cfg.minibatch_prompts % self.dp_size:
            raise ValueError(f"minibatch_prompts {cfg.minibatch_prompts} must divide over DP size {self.dp_size}")
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
        self.hf_config = load_hf_config(cfg.model.hf_dir)
        (self.train_ids, self.train_ex), (self.eval_ids, self.eval_ex) = _load_data(cfg, self.tokenizer)
        self.eval_sets = _load_eval_sets(cfg, self.tokenizer)
        build = partial(
            build_gpt_model,
            self.hf_config,
            params_dtype=torch.bfloat16 if cfg.model.bf16 else torch.float32,
            calculate_per_token_loss=True,
            bf16=cfg.model.bf16,
            **_memory_settings(cfg),
        )
        model = build()
        # sequence parallelism splits the sequence over TP: pad lengths to a multiple of it
        self.seq_multiple = math.lcm(8, cfg.model.tensor_model_parallel_size if cfg.model.sequence_parallel else 1)
        if cfg.model.megatron_ckpt:
            load_checkpoint(model, cfg.model.megatron_ckpt)
        # the output layer is padded to a multiple of 128 x TP; the softmax must not see it
        self.vocab_size = model.qwen_spec.vocab_size
        # GRPO's KL term: a frozen copy of the initial weights, same sharding (reference.py)
        self.ref_model = frozen_copy(model, build) if cfg.loss.kl_coef > 0 else None
        # Device rule: batches live on the model's device; what goes through a DP collective is
        # created on the backend's device (the same CUDA device under NCCL, the CPU under gloo).
        self.device = next(model.parameters()).device
        self.dp_device = collective_device(self.groups.dp)
        self.model = wrap_ddp(model, cfg.optim.use_distributed_optimizer)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.logger = RunLogger(cfg.run_dir, enabled=self.rank == 0, logging=cfg.logging, config=cfg,
                                plot_every_eval=True)
        # config, git commit, command, versions: into the run folder and every checkpoint (rank 0)
        self.provenance = RunProvenance(cfg, warmstart) if self.rank == 0 else None
        # Slurm's warning before the time limit: save at the next step boundary and stop
        self.stop_signal = SaveOnSignal().install()
        self.stopped_at: Optional[int] = None
        self.engine = None
        self.scorer = None

    # -- pieces ------------------------------------------------------------------------------

    def _start_services(self):
        from stapo_megatron.rewards.functions import get_reward
        from stapo_megatron.rewards.scorer import RewardScorer
        from stapo_megatron.rollout.registry import build_engine

        r = self.cfg.rollout
        reward = get_reward(self.cfg.reward)  # before the engine: a bad name fails fast
        self.engine = build_engine(
            r.engine,
            self.cfg.model.hf_dir,
            r.engine_config(
                max_model_len=_pad_to(self.cfg.data.max_prompt_len + max(r.max_response_len, self._eval_max_len())),
                seed=self.seeds.engine,
                # vLLM must run the dtype the trainer trains in, whatever the folder was saved in
                dtype="bfloat16" if self.cfg.model.bf16 else "float32",
                enable_sleep_mode=r.sleep_during_training and torch.cuda.is_available(),
            ),
        )
        self.scorer = RewardScorer(num_workers=self.cfg.reward_workers, timeout_s=self.cfg.reward_timeout_s,
                                   score_fn=reward.score_fn, failure_reward=reward.failure_reward)

    def _eval_max_len(self) -> int:
        """Held-out responses' token limit (`TrainerConfig.eval_max_response_len`)."""
        return self.cfg.eval_max_response_len or self.cfg.rollout.max_response_len

    def _sync_weights(self) -> Dict[str, float]:
        from stapo_megatron.rollout.weight_sync import sync_weights

        return sync_weights(self.model, self.hf_config, self.groups, self.engine)

    def _step_prompts(self, step: int, count: int, seed: int) -> List[int]:
        """Indices of this DP rank's prompts for a step: a seeded permutation per epoch."""
        n = len(self.train_ids)
        first = step * count
        idx, perms = [], {}
        for pos in range(first, first + count):
            epoch, offset = divmod(pos, n)
            if epoch not in perms:
                perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
            idx.append(int(perms[epoch][offset]))
        per_rank = count // self.dp_size
        return idx[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]

    def _generate(self, prompt_ids, n, temperature, top_p, max_tokens, seed):
        samples = self.engine.generate(prompt_ids, n, temperature, top_p, max_tokens, seed=seed)
        # Every rank of a model-parallel group must train on identical data: take rank 0's.
        mp_group = self.groups.mp
        if dist.get_world_size(mp_group) > 1:
            box = [samples]
            dist.broadcast_object_list(box, src=dist.get_process_group_ranks(mp_group)[0], group=mp_group)
            samples = box[0]
        return samples

    def evaluate(self, step: int) -> Dict[str, float]:
        """The held-out set's ``eval_accuracy`` (avg@k with k = ``eval_samples``: the fraction of
        its samples with a positive reward, correct under 1/0 and +1/-1 rewards alike) and, per named set and decoding (``TrainerConfig.eval_sets``),
        ``eval/<set>/<decoding>/avg@<k>`` and ``pass@<k>``; every set split over DP."""
        cfg = self.cfg
        t0 = time.perf_counter()
        held_out = Decoding(cfg.eval_temperature, 1.0, "held_out")
        samples: List[Dict] = []
        counts = self._eval_counts(self.eval_ids, self.eval_ex, cfg.eval_samples, held_out, samples)
        row = dict(kind="eval", step=step, eval_accuracy=summarize(counts, cfg.eval_samples, held_out)["avg@k"],
                   eval_num=int(counts.num_samples))
        for eval_set, ids in self.eval_sets:
            for decoding in eval_set.decodings:
                result = summarize(self._eval_counts(ids, eval_set.examples, eval_set.k, decoding), eval_set.k, decoding)
                for metric in ("avg", "pass"):
                    row[f"eval/{eval_set.name}/{decoding.name}/{metric}@{eval_set.k}"] = result[f"{metric}@k"]
        row["time_eval"] = time.perf_counter() - t0
        self.logger.log(row)
        self.logger.log_samples(step, samples)
        return row

    def _eval_counts(self, prompt_ids: List[List[int]], examples: List, k: int, decoding: Decoding,
                     samples_out: Optional[List[Dict]] = None) -> Counts:
        """avg@k sums of ``k`` samples per problem, this DP rank's share sampled and scored here
        (``evaluation.score_responses``), then summed over DP (float32, as every metric sum).
        ``samples_out``, if given, gets this rank's samples (prompt, response, answer, reward)."""
        idx = list(range(self.dp_rank, len(prompt_ids), self.dp_size))
        samples = self._generate(
            [prompt_ids[i] for i in idx], k, decoding.temperature, decoding.top_p,
            self._eval_max_len(), seed=self.seeds.evaluation,
        )
        texts = [[s.text for s in group] for group in samples]
        rewards: List[float] = []
        counts = score_responses(texts, [examples[i] for i in idx], k, self.scorer, rewards)
        if samples_out is not None:
            flat = [(examples[i], t) for i, group in zip(idx, texts) for t in group]
            samples_out.extend(dict(prompt=ex.prompt, response=t, answer=ex.answer, reward=r)
                               for (ex, t), r in zip(flat, rewards))
        sums = torch.tensor(counts.as_list(), device=self.dp_device)
        dist.all_reduce(sums, group=self.groups.dp)
        return Counts(*sums)

    def warm_start(self):
        """Supervised warm-start on training prompts (fresh AdamW, discarded afterwards)."""
        ws = self.warmstart
        eos = self.tokenizer.eos_token_id
        optim = dataclasses.replace(self.cfg.optim, lr=ws.lr, weight_decay=0.0)
        optimizer = build_optimizer(self.model, optim)
        target = (_import_dotted(ws.target_fn, "warmstart.target_fn") if ws.target_fn
                  else lambda ex: ws.target_template.format(answer=ex.answer))
        for step in range(ws.steps):
            idx = self._step_prompts(step, ws.prompts_per_step, self.seeds.warmstart_order)
            prompts = [self.train_ids[i] for i in idx]
            targets = [self.tokenizer.encode(target(self.train_ex[i]), add_special_tokens=False) + [eos]
                       for i in idx]
            seq = _pad_to(max(len(p) + len(t) for p, t in zip(prompts, targets)), self.seq_multiple)
            batch = pack_sequences(prompts, targets, [0.0] * len(idx), [[0.0] * len(t) for t in targets],
                                   self.tokenizer.pad_token_id, seq, device=self.device)
            mbs = split_microbatches(batch, self.cfg.micro_batch_size, seed=self.seeds.warmstart_microbatches(step))
            nll = sft_step(self.model, optimizer, mbs, seq, self.groups.tp, self.groups.dp, self.vocab_size,
                           ws.label_smoothing)
            if self.rank == 0 and (step % 10 == 0 or step == ws.steps - 1):
                print(f"[warm-start] step {step}/{ws.steps} nll {nll:.4f}", flush=True)

    def _warm_start_or_load(self):
        """The warm-start, or its cached weights (`warmstart_cache`) when a run already made them."""
        from stapo_megatron.bridge.model import load_checkpoint

        cached = warmstart_cache.cached_path(self.cfg, self.warmstart, self.seeds.model_init,
                                             self.seeds.data_split, dist.get_world_size())
        if cached and warmstart_cache.is_complete(cached):
            load_checkpoint(self.model.module, cached)
            if self.rank == 0:
                print(f"[warm-start] loaded the cached warm-start {cached}", flush=True)
        else:
            self.warm_start()
            if cached:
                ckpt.save_model_only(self.model, cached)
                if self.rank == 0:
                    print(f"[warm-start] cached in {cached}", flush=True)
        if self.warmstart.save_to:
            ckpt.save_model_only(self.model, self.warmstart.save_to)
        # the RL optimizer was built before: with bf16 its fp32 main parameters still hold the
        # initial weights and would overwrite the warm-start at the first step
        self.optimizer.reload_model_params()

    def _reference_from_warm_start_cache(self):
        """On resume: the KL reference is the warm-started policy RL began from, read back from
        the warm-start cache; without a cache it keeps the pre-warm-start weights (warned)."""
        from stapo_megatron.bridge.model import load_checkpoint

        cached = warmstart_cache.cached_path(self.cfg, self.warmstart, self.seeds.model_init,
                                             self.seeds.data_split, dist.get_world_size())
        if cached and warmstart_cache.is_complete(cached):
            load_checkpoint(self.ref_model, cached)
            return
        warnings.warn("resumed with a warm-start and loss.kl_coef > 0 but no cached warm-start: the KL reference "
                      "holds the weights before the warm-start (model.megatron_ckpt or the random init)")

    def train_step(self, step: int) -> Tuple[Dict, List]:
        """One training step, one line per phase (docs/design.md, "One training step").

        Returns the metrics row and this rank's silenced-token rows (label id, log p, H, A).
        """
        timer = _Timer()
        self._set_lr(step)
        prompts, answers = self._prompts(step)
        with timer("rollout"):
            samples = self._rollout(prompts, step)
        with timer("reward"):
            rewards_PG, reward_info = self._score(samples, answers)
        self.engine.sleep()  # GPU: vLLM's memory goes to training until the weight sync
        minis, seq, num_flat = self._advantages_and_minibatches(step, prompts, samples, rewards_PG)
        with timer("old_logprob"):
            old_stats, logprob_diff = self._old_policy_pass(minis, seq)
            if self.ref_model is not None:
                add_reference_logprobs(self.ref_model, minis, seq, self.cfg.loss.temperature, self.groups.tp,
                                       self.vocab_size, self.groups.is_last_stage)
        with timer("train"):
            updates = [policy_update(self.model, self.optimizer, m, self.cfg.loss, self.groups, seq, s, self.vocab_size)
                       for m, s in zip(minis, old_stats)]
        with timer("weight_sync"):
            self._weight_sync()
        row = self._step_row(step, updates, rewards_PG, num_flat, samples, logprob_diff, reward_info)
        row.update(timer.seconds)
        return row, [r for u in updates for r in u["silenced_tokens"]]

    # -- the phases of a step ----------------------------------------------------------------

    def _prompts(self, step: int) -> Tuple[List[List[int]], List[str]]:
        """This DP rank's prompts of ``step`` (token ids) and their reference answers."""
        idx = self._step_prompts(step, self.cfg.prompts_per_step, self.seeds.data_order)
        return [self.train_ids[i] for i in idx], [self.train_ex[i].answer for i in idx]

    def _rollout(self, prompts: List[List[int]], step: int) -> List[List]:
        """G samples per prompt (``Sample`` lists), the same on every rank of a model-parallel group."""
        r = self.cfg.rollout
        return self._generate(prompts, r.group_size, r.temperature, r.top_p, r.max_response_len,
                              seed=self.seeds.rollout(step))

    def _score(self, samples: List[List], answers: List[str]) -> Tuple[torch.Tensor, Dict]:
        """Rewards [P, G] of the samples against their prompts' answers, and the scorer's info."""
        G = self.cfg.rollout.group_size
        texts = [s.text for group in samples for s in group]
        rewards, info = self.scorer.score(texts, [answer for answer in answers for _ in range(G)])
        return torch.tensor(rewards, dtype=torch.float32).view(len(answers), G), info

    def _advantages_and_minibatches(self, step: int, prompts: List[List[int]], samples: List[List],
                                    rewards_PG: torch.Tensor) -> Tuple[List[List[Dict]], int, int]:
        """Group advantages, packed into label-aligned micro-batches per PPO mini-batch.

        Returns (per mini-batch its micro-batch dicts, the padded sequence length, the number
        of flat groups: all-equal rewards, zero advantage).
        """
        G = self.cfg.rollout.group_size
        adv_PG, num_flat = group_advantages(rewards_PG)
        flat = [s for group in samples for s in group]
        seq = _pad_to(max(len(prompts[i // G]) + len(s.token_ids) for i, s in enumerate(flat)), self.seq_multiple)
        batch = pack_sequences(
            [prompts[i // G] for i in range(len(flat))], [s.token_ids for s in flat],
            adv_PG.reshape(-1).tolist(), [s.logprobs for s in flat], self.tokenizer.pad_token_id, seq,
            device=self.device,
        )
        per_mini = self.cfg.minibatch_prompts // self.dp_size * G
        minis = [
            split_microbatches({k: v[s : s + per_mini] for k, v in batch.items()}, self.cfg.micro_batch_size,
                               seed=self.seeds.microbatches(step, s, self.dp_rank))
            for s in range(0, len(flat), per_mini)
        ]
        return minis, seq, num_flat

    def _old_policy_pass(self, minis: List[List[Dict]], seq: int) -> Tuple[List[List], torch.Tensor]:
        """pi_old log-probs and entropies (no grad), written into each micro-batch as ``old_logprob``.

        Returns per mini-batch its per micro-batch (logprob, entropy) (the "old" tau_H source;
        last stage only) and [sum |log pi_old - log pi_rollout|, response tokens] over the step,
        the same on every rank.
        """
        groups = self.groups
        old_stats = [compute_logprob_entropy(self.model, m, seq, self.cfg.loss.temperature, groups.tp,
                                             self.vocab_size) for m in minis]
        diff = torch.zeros(2, device=self.device)
        for mini, stats in zip(minis, old_stats):
            for i, mb in enumerate(mini):
                mb["old_logprob"] = stats[i][0] if groups.is_last_stage else torch.zeros_like(mb["advantages"])
                if groups.is_last_stage:
                    mask = mb["response_mask"]
                    diff += torch.stack([(stats[i][0] - mb["rollout_logprob"]).abs()[mask].sum(), mask.sum().float()])
        return old_stats, _reduce_from_last_stage(diff.to(self.dp_device), groups)

    def _weight_sync(self) -> None:
        """The updated weights into the rollout engine (woken first)."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand PyTorch's cached training memory back for vLLM
        self.engine.wake_up()
        self._sync_weights()

    def _set_lr(self, step: int):
        """The learning rate of every optimizer step of training step ``step`` (`warmup_lr`)."""
        for group in self.optimizer.param_groups:
            group["lr"] = warmup_lr(step, self.cfg.optim.lr, self.cfg.lr_warmup_steps)

    def _step_row(self, step, updates, rewards_PG, num_flat, samples, diff, reward_info) -> Dict:
        """The step's metrics row: rollout sums over DP, the mini-batch updates' metrics."""
        sums = torch.tensor([
            float(rewards_PG.sum()), float(rewards_PG.numel()), float(num_flat), float(rewards_PG.shape[0]),
            float(sum(len(s.token_ids) for group in samples for s in group)), float(reward_info.get("num_timeouts", 0)),
        ], device=self.dp_device)
        dist.all_reduce(sums, group=self.groups.dp)
        mean = lambda key: sum(u[key] for u in updates) / len(updates)  # noqa: E731
        silenced = sum(u["silenced_count"] for u in updates)
        response_tokens = sum(u["num_response_tokens"] for u in updates)
        return dict(
            kind="train", step=step + 1,
            reward_mean=float(sums[0] / sums[1]),
            flat_groups=int(sums[2]), num_prompts=int(sums[3]),
            response_len_mean=float(sums[4] / sums[1]),
            reward_timeouts=int(sums[5]),
            loss=mean("loss"), entropy_mean=mean("entropy_mean"),
            silenced_count=silenced, silenced_fraction=silenced / max(response_tokens, 1),
            tau_h=mean("tau_h"), tau_h_source=self.cfg.loss.tau_h_source,
            candidate_count=sum(u["candidate_count"] for u in updates),
            clip_fraction=mean("clip_fraction"), approx_kl=mean("approx_kl"),
            grad_norm=mean("grad_norm"), skipped=sum(u["skipped"] for u in updates),
            rollout_train_logprob_diff=float(diff[0] / diff[1]) if diff[1] > 0 else math.nan,
            lr=self.optimizer.param_groups[0]["lr"],
        )

    def _gather_silenced(self, rows) -> List:
        """Silenced-token rows of all DP ranks (from TP rank 0 of the last stage) on rank 0."""
        mine = rows if (self.groups.is_last_stage and dist.get_rank(self.groups.tp) == 0) else []
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return [r for part in gathered for r in part]

    def _save(self, step: int):
        ckpt.save_checkpoint(self.cfg.run_dir, step, self.model, self.optimizer,
                             {"data_position": step * self.cfg.prompts_per_step},
                             write_extra=self.provenance.write_checkpoint if self.provenance else None,
                             keep_last=self.cfg.keep_last)

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> List[Dict]:
        cfg = self.cfg
        start = 0
        latest = ckpt.find_latest(cfg.run_dir)
        if self.provenance:
            self.provenance.write_run()
        self._start_services()
        if latest:
            state = ckpt.load_checkpoint(latest, self.model, self.optimizer)
            start = state["step"]
            self.logger.resume_from(start)  # drop what the killed run logged past the checkpoint
            if self.rank == 0:
                print(f"resumed from {latest} (step {start})", flush=True)
        elif self.warmstart and self.warmstart.steps:
            self._warm_start_or_load()
            if self.ref_model is not None:
                reset_reference(self.ref_model, self.model.module)  # RL starts from the warm-started policy
        if latest and self.ref_model is not None and self.warmstart and self.warmstart.steps:
            self._reference_from_warm_start_cache()
        self._sync_weights()
        rows = []
        if start == 0 and cfg.eval_every:
            rows.append(self.evaluate(0))
            self._print_eval(rows[-1])
        consecutive_skips = 0
        progress = Progress(cfg.steps, start, cfg.rollout.group_size)
        for step in range(start, cfg.steps):
            row, silenced_rows = self.train_step(step)
            row.update(progress.update(row))
            rows.append(row)
            self.logger.log(row)
            silenced_rows = self._gather_silenced(silenced_rows)
            self.logger.log_silenced(step + 1, silenced_rows, lambda t: self.tokenizer.decode([t]))
            self._print_row(row)
            consecutive_skips = consecutive_skips + 1 if row["skipped"] else 0
            if consecutive_skips > cfg.max_consecutive_skips:
                raise RuntimeError(
                    f"{consecutive_skips} consecutive steps had a NaN/Inf loss or gradient (last at step "
                    f"{step + 1}); stopping. Check the learning rate and the data; the last good "
                    f"checkpoint is {ckpt.find_latest(cfg.run_dir)}"
                )
            done = step + 1
            if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
                rows.append(self.evaluate(done))
                self._print_eval(rows[-1])
            saved = bool(cfg.save_every and (done % cfg.save_every == 0 or done == cfg.steps))
            if saved:
                self._save(done)
            if done < cfg.steps and self.stop_signal.stop_now(saved, lambda: self._save(done)):
                self.stopped_at = done
                if self.rank == 0:
                    print(f"stopping after step {done} on the scheduler's warning signal; saved, "
                          f"resume by launching the run again (requeue)", flush=True)
                break
        if self.rank == 0 and os.path.exists(os.path.join(cfg.run_dir, "metrics.jsonl")):
            plot_run(cfg.run_dir)
        return rows

    def _print_row(self, r):
        if self.rank == 0:
            print(
                f"step {describe(r, self.cfg.steps)} | reward {r['reward_mean']:.3f} | entropy {r['entropy_mean']:.3f} | "
                f"silenced {r['silenced_count']} ({r['silenced_fraction']:.4%}) tau_H {r['tau_h']:.3f} | "
                f"loss {r['loss']:+.4f} clip {r['clip_fraction']:.3f} | len {r['response_len_mean']:.1f} | "
                f"rollout {r['time_rollout']:.1f}s reward {r['time_reward']:.1f}s old {r['time_old_logprob']:.1f}s "
                f"train {r['time_train']:.1f}s sync {r['time_weight_sync']:.1f}s",
                flush=True,
            )

    def _print_eval(self, r):
        if self.rank == 0:
            print(f"eval  {r['step']:>4} | held-out accuracy {r['eval_accuracy']:.3f} "
                  f"({r['eval_num']} samples, {r['time_eval']:.1f}s)", flush=True)
            for key, value in r.items():
                if key.startswith("eval/"):
                    print(f"eval  {r['step']:>4} | {key[len('eval/'):]} {value:.3f}", flush=True)

    def close(self):
        self.stop_signal.uninstall()
        if self.scorer is not None:
            self.scorer.close()
        if self.engine is not None:
            # vLLM's own shutdown would destroy the default process group (Megatron's)
            self.engine.shutdown()
        self.logger.close()


def warmup_lr(step: int, peak_lr: float, warmup_steps: int) -> float:
    """Learning rate of training step ``step`` (0-based): linear warm-up from 0 over
    ``warmup_steps`` training steps, then constant, ``peak_lr * min(1, step / warmup_steps)``.

    As veRL's constant-with-warm-up schedule (stepped once per training step, so the first step
    trains at lr 0); all PPO mini-batches (optimizer steps) of one training step share it.
    ``warmup_steps = 0``: the peak from the first step.
    """
    if warmup_steps <= 0:
        return peak_lr
    return peak_lr * min(1.0, step / warmup_steps)


def train(cfg: TrainerConfig, warmstart: Optional[WarmStartConfig] = None) -> List[Dict]:
    """Entry point (one call per process under torchrun): train, then tear down.

    A failure is recorded for `stapo_megatron.trainer.faults` before the teardown (which is when the
    other ranks notice it); a rank that only lost its peers raises a `faults.PeerFailure`
    naming the rank that failed first.

    Raises:
        StoppedForRequeue: stopped and saved on the scheduler's warning signal (exit code
            `stapo_megatron.trainer.preemption.REQUEUE_EXIT_CODE`).
    """
    trainer = None
    try:
        trainer = Trainer(cfg, warmstart)
        rows = trainer.run()
    except Exception as error:
        raise faults.failed(cfg.run_dir, error)
    finally:
        if trainer is not None:
            trainer.close()
        destroy_parallel()
    if trainer.stopped_at is not None:
        raise StoppedForRequeue(trainer.stopped_at)
    return rows
