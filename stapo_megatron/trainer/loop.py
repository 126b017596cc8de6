"""The STAPO training loop (docs/design.md, "One training step"), SPMD: one process per device.

Per step: (1)-(2) G rollouts of each of this DP rank's prompts, as the step's one record (`StepRollout`, from
the rollout schedule); (3) rewards; (4) group advantages, one complete `SequenceRecord` per sample, laid out as
`MicroBatch` objects by `build_minibatches`; (5) pi_old log-probs (``schedule.old_policy_pass``; MoE:
RoutingMonitor); (6) per PPO mini-batch a forward_backward and an optimizer step; (7) weight sync; (8) metrics,
evaluation (`Evaluator`), checkpoint. Warm-start: `WarmStart`. Run: ``train(config)``."""

from __future__ import annotations

import os
from functools import partial
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from stapo_megatron.bridge.hf_config import load_hf_config
from stapo_megatron.bridge.model import build_gpt_model, load_checkpoint
from stapo_megatron.config import TrainerConfig, WarmStartConfig
from stapo_megatron.config.yaml_io import dump_config
from stapo_megatron.eval.evaluator import Evaluator, eval_max_len, load_eval_sets
from stapo_megatron.rewards.functions import get_reward
from stapo_megatron.rewards.scorer import RewardScorer
from stapo_megatron.rollout.registry import build_engine, serves_adapters
from stapo_megatron.rollout.transport import Transport
from stapo_megatron.rollout.remote import RemoteEngine
from stapo_megatron.runlog.metrics import RunLogger
from stapo_megatron.runlog.plots import plot_run
from stapo_megatron.runlog.progress import Progress
from stapo_megatron.runlog.provenance import RunProvenance
from stapo_megatron.mcore import checkpoint as ckpt
from stapo_megatron.batch.microbatch import group_advantages
from stapo_megatron.batch.minibatches import MicroBatchLayout, build_minibatches
from stapo_megatron.mcore.parallel import destroy_parallel
from stapo_megatron.utils import collective_device
from stapo_megatron.batch.records import SequenceRecord, make_records
from stapo_megatron.batch.step_rollout import StepRollout
from stapo_megatron.mcore.lora import apply_lora
from stapo_megatron.mcore.reference import add_reference_logprobs, build_reference, reset_reference
from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
from stapo_megatron.mcore.step import build_optimizer, policy_update, wrap_ddp
from stapo_megatron.trainer import faults, replicas, routing
from stapo_megatron.trainer.preemption import SaveOnSignal, StoppedForRequeue
from stapo_megatron.trainer.prompts import load_prompts, step_prompt_indices
from stapo_megatron.trainer.seeds import Seeds
from stapo_megatron.trainer.lr import warmup_lr
from stapo_megatron.trainer.mismatch_metrics import rollout_mismatch
from stapo_megatron.trainer.step_metrics import SkipGuard, Timer, format_row, gather_silenced, step_row
from stapo_megatron.trainer.warmstart import WarmStart
from stapo_megatron.serve.server import engine_config
from stapo_megatron.trainer.dynamic_sampling import fill_informative
from stapo_megatron.trainer.pooled_schedules import build_schedule
from stapo_megatron.trainer.rollout_schedule import weight_sync


class Trainer:
    """Holds the model, optimizer, rollout engine and scorer of one run; ``run()`` trains."""

    def __init__(self, cfg: TrainerConfig, warmstart: Optional[WarmStartConfig] = None,
                 transport: Optional[Transport] = None):
        self.cfg, self.warmstart, self.transport = cfg, warmstart, transport
        self.seeds = Seeds(cfg.seed, warmstart.seed if warmstart else None, cfg.data.seed)
        self.groups = replicas.init_groups(cfg, self.seeds.model_init)  # TP, PP, CP, EP from cfg.model, checked
        self.rank = dist.get_rank()
        self.dp_size, self.dp_rank = dist.get_world_size(self.groups.dp), dist.get_rank(self.groups.dp)
        self.minibatch_size = cfg.minibatch_prompts // self.dp_size * cfg.rollout.group_size  # this rank's records
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
        self.hf_config = load_hf_config(cfg.model.hf_dir)
        (self.train_ids, self.train_ex), self.held_out = load_prompts(cfg.data, self.tokenizer, self.seeds.data_split,
                                                                      bool(cfg.eval.sets))
        self.eval_sets = load_eval_sets(cfg.eval, self.tokenizer, cfg.data.max_prompt_len, cfg.data.use_chat_template)
        self._build_model()
        self.logger = RunLogger(cfg.run_dir, enabled=self.rank == 0, logging=cfg.logging, config=cfg,
                                plot_every_eval=True)
        # config, git commit, command, versions: into the run folder and every checkpoint (rank 0)
        self.provenance = (RunProvenance(dump_config(cfg, warmstart), cfg.run_dir, cfg.model.hf_dir)
                           if self.rank == 0 else None)
        self.stop_signal = SaveOnSignal().install()  # Slurm's time-limit warning: save at the next step boundary, stop
        self.stopped_at: Optional[int] = None
        self.engine = self.scorer = self.evaluator = None

    def _build_model(self) -> None:
        """The policy (DDP-wrapped), its optimizer and, for a KL term, the frozen reference."""
        cfg = self.cfg
        build = partial(build_gpt_model, self.hf_config, params_dtype=torch.bfloat16 if cfg.model.bf16 else torch.float32,
                        calculate_per_token_loss=True, bf16=cfg.model.bf16, **cfg.model.memory_settings(),
                        **cfg.model.context_parallel_settings(), moe_enable_routing_replay=cfg.rollout.routing_replay,
                        use_te=False if cfg.lora else None,  # LoRA adapts megatron-core's own linears: the local spec
                        core_attention="sdpa" if cfg.packing != "padded" else None)  # packed (and CP): SDPAttention
        model = build()
        # lengths: sequence parallelism splits them over TP, context parallelism into 2 x CP chunks
        self.seq_multiple, self.seq_align = replicas.seq_multiple(cfg.model), replicas.seq_align(cfg.model)
        if cfg.model.megatron_ckpt:
            load_checkpoint(model, cfg.model.megatron_ckpt)
        self.vocab_size = model.qwen_spec.vocab_size  # the output layer is padded (128 x TP): not for the softmax
        if cfg.lora is not None:  # the base frozen: DDP's buffers and the optimizer hold only the adapters
            apply_lora(model, cfg.lora)
        self.ref_model = build_reference(model, build, cfg.loss.kl_coef)  # GRPO's KL: a frozen copy or LoRA's base
        # Device rule: batches on the model's device, DP collectives' tensors on the backend's (NCCL: CUDA, gloo: CPU)
        self.device = next(model.parameters()).device
        self.dp_device = collective_device(self.groups.dp)
        self.batch_layout = MicroBatchLayout(  # how a step's records become micro-batches (batch/minibatches.py)
            cfg.packing, cfg.micro_batch_size, cfg.max_tokens_per_microbatch, self.tokenizer.pad_token_id,
            self.seq_multiple, self.seq_align, self.groups.cp_size,
            dist.get_rank(self.groups.cp) if self.groups.cp_size > 1 else 0, self.device)
        self.model = wrap_ddp(model, cfg.optim.use_distributed_optimizer, cfg.optim.overlap_grad_reduce)
        self.optimizer = build_optimizer(self.model, cfg.optim)

    def context(self, seq_length: int, model=None) -> PassContext:
        """The `PassContext` of a pass of the policy (or ``model``) over ``seq_length`` tokens; the
        policy's replay the rollout's routes with ``rollout.routing_replay``, the reference's never."""
        return PassContext(model if model is not None else self.model, seq_length, self.cfg.loss.temperature,
                           self.groups, self.vocab_size, replay_routes=model is None and self.cfg.rollout.routing_replay)

    def _start_services(self) -> None:
        """The reward scorer, the rollout engine, its schedule and the evaluator that samples with it."""
        cfg, r, timeout = self.cfg, self.cfg.rollout, self.cfg.rollout_timeout()
        reward = get_reward(cfg.reward.name)  # before the engine: a bad name fails fast
        self.routing = routing.RoutingMonitor(r, self.hf_config, self.model)  # MoE: the engine records its routes
        if self.transport is not None:  # separate placement: the engines run on the job's last ranks
            asks = self.groups.mp is None or dist.get_rank(self.groups.mp) == 0
            self.engine = RemoteEngine(self.transport, asks, timeout, r.separate.weight_bucket_mb, serves_adapters(r.engine))
        else:
            self.engine = build_engine(r.engine, cfg.model.hf_dir, engine_config(r, self.seeds.engine(self.dp_rank),
                self.routing.enabled, cfg.longest_sequence(), cfg.model.bf16, None if cfg.lora is None else cfg.lora.rank))
        per_rank = cfg.prompts_per_step // self.dp_size * r.group_size  # this rank's samples of a step
        self.schedule = build_schedule(r, self.engine, self.groups, self._indexed_prompts,
                                       lambda index: self.train_ex[index].answer,
                                       lambda step: self.seeds.rollout(step, self.dp_rank, per_rank),
                                       weight_sync(self.model, self.hf_config, self.groups), cfg.steps, timeout,
                                       order_log=os.path.join(cfg.run_dir, "rollout_order.jsonl"))
        self.scorer = RewardScorer(num_workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s,
                                   score_fn=reward.score_fn, failure_reward=reward.failure_reward)
        self.evaluator = Evaluator(cfg.eval, self.held_out, self.eval_sets, self.engine, self.scorer, self.groups,
                                   self.seeds.evaluation, self.logger, cfg.steps,
                                   eval_max_len(cfg.eval, r.max_response_len), timeout, cfg.logging.num_samples)

    def train_step(self, step: int) -> Tuple[Dict, List]:
        """One training step, one line per phase (docs/design.md, "One training step").

        Returns the metrics row and this rank's silenced-token rows (label id, log p, H, A,
        log p_rollout, mismatch-flagged).
        """
        timer = Timer()
        for group in self.optimizer.param_groups:
            group["lr"] = warmup_lr(step, self.cfg.optim.lr, self.cfg.lr_warmup_steps)
        with timer("rollout"):
            rollout = self.schedule.samples(step)  # the step's one record (batch/step_rollout.py)
        with timer("reward"):
            rewards_PG, reward_info = self._score(rollout)
        filtered = {}
        if self.cfg.rollout.streaming.filter_groups:  # DAPO's dynamic sampling: uniform groups replaced
            with timer("filter"):
                rollout, rewards_PG, reward_info, filtered = fill_informative(
                    rollout, rewards_PG, reward_info, partial(self.schedule.replace, step), self._score,
                    self.cfg.rollout.streaming.filter_rounds, self.groups.dp, self.dp_device)
        self.engine.sleep()  # GPU: vLLM's memory goes to training until the weight sync
        adv_PG, num_flat = group_advantages(rewards_PG)
        records = self._records(rollout, adv_PG)
        minis, seq = build_minibatches(records, self.batch_layout, self.minibatch_size,
                                       partial(self.seeds.microbatches, step), self.groups.dp)
        ctx = self.context(seq)
        with timer("old_logprob"):
            old_policy_pass(ctx, minis)
            mismatch = rollout_mismatch(minis, self.cfg.loss.rollout_correction, self.groups, self.dp_device)
            if self.ref_model is not None:
                add_reference_logprobs(self.context(seq, self.ref_model), minis)
        mismatch.update(self.routing.measure(rollout, minis))  # {} unless MoE (its own time_routing)
        with timer("train"):
            updates = [policy_update(ctx, self.optimizer, mini, self.cfg.loss) for mini in minis]
        with timer("weight_sync"):
            self.schedule.after_update(step)
        row = step_row(step, [u.metrics for u in updates], rewards_PG, num_flat, rollout.response_tokens, mismatch,
                       reward_info, self.cfg.loss.tau_h_source, self.optimizer.param_groups[0]["lr"], self.groups,
                       self.dp_device)
        row.update(timer.seconds)
        row.update(self.schedule.metrics(rollout, self.dp_device))
        row.update(filtered)
        return row, [r for u in updates for r in u.silenced_tokens]

    def _indexed_prompts(self, step: int) -> List[Tuple[int, List[int]]]:
        """(training-set index, token ids) of this DP rank's prompts of ``step``."""
        return [(i, self.train_ids[i]) for i in step_prompt_indices(
            step, self.cfg.prompts_per_step, self.seeds.data_order, len(self.train_ids), self.dp_size, self.dp_rank)]

    def _score(self, rollout: StepRollout) -> Tuple[torch.Tensor, Dict]:
        """Rewards [P, G] of the step's samples against their prompts' answers, and the scorer's info."""
        rewards, info = self.scorer.score(rollout.texts, rollout.answers)
        return torch.tensor(rewards, dtype=torch.float32).view(rollout.num_prompts, rollout.group_size), info

    def _records(self, rollout: StepRollout, adv_PG: torch.Tensor) -> List[SequenceRecord]:
        """This rank's samples of the step as sequence records, flat in (prompt, sample) order:
        each response's version is its oldest token's policy (steps trained) x mini-batches per
        step RL optimizer updates (`stapo_megatron.trainer.rollout_schedule.RolloutSchedule`), with their MoE routes when the step carries
        them and (partial rollouts, an option) the tokens older than the token-level bound left
        out of the loss."""
        with_routes = self.routing.step_routes(rollout)  # MoE: replayed and/or measured
        updates_per_step = self.cfg.prompts_per_step // self.cfg.minibatch_prompts
        return make_records(rollout, adv_PG, updates_per_step, self.cfg.rollout.token_age_bound, with_routes)

    def _save(self, step: int):
        ckpt.save_checkpoint(self.cfg.run_dir, step, self.model, self.optimizer,
                             {"data_position": step * self.cfg.prompts_per_step, **self.schedule.state_dict()},
                             self.provenance.write_checkpoint if self.provenance else None, self.cfg.keep_last)

    def _begin(self) -> int:
        """Resume from the newest checkpoint or warm-start; the step to start from."""
        latest = ckpt.find_latest(self.cfg.run_dir)
        warm = WarmStart(self.cfg, self.warmstart, self.seeds, self.tokenizer, self.train_ids, self.train_ex,
                         self.seq_multiple) if self.warmstart and self.warmstart.steps else None
        if latest:
            state = ckpt.load_checkpoint(latest, self.model, self.optimizer)
            start = state["step"]
            self.schedule.load_state_dict(state)  # partial rollouts: the pools' prompts in flight, sent again
            self.logger.resume_from(start)  # drop what the killed run logged past the checkpoint
            if self.rank == 0:
                print(f"resumed from {latest} (step {start})", flush=True)
            if warm and self.ref_model is not None:
                warm.load_reference(self.ref_model)
            return start
        if warm:
            warm.apply(self.context(0), self.optimizer)
            if self.ref_model is not None:
                reset_reference(self.ref_model, self.model.module)  # RL starts from the warm-started policy
        return 0

    def run(self) -> List[Dict]:
        cfg = self.cfg
        if self.provenance:
            self.provenance.write_run()
        self._start_services()
        start = self._begin()
        self.schedule.start(start)  # the first sync; separate placement: the first requests
        rows = [self.evaluator.evaluate(0)] if start == 0 and self.evaluator.should_evaluate(0) else []
        skips = SkipGuard(cfg.max_consecutive_skips, cfg.run_dir)
        progress = Progress(cfg.steps, start, cfg.rollout.group_size)
        for step in range(start, cfg.steps):
            row, silenced_rows = self.train_step(step)
            row.update(progress.update(row))
            rows.append(row)
            self.logger.log(row)
            self.logger.log_silenced(step + 1, gather_silenced(silenced_rows, self.groups),
                                     lambda t: self.tokenizer.decode([t]))
            if self.rank == 0:
                print(format_row(row, cfg.steps), flush=True)
            skips.check(row, step)
            done = step + 1
            if self.evaluator.should_evaluate(done):
                rows.append(self.evaluator.evaluate(done))
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

    def close(self):
        self.stop_signal.uninstall()
        if self.scorer is not None:
            self.scorer.close()
        if self.engine is not None:
            # vLLM's own shutdown would destroy the default process group (Megatron's)
            self.engine.shutdown()
        self.logger.close()


def train(cfg: TrainerConfig, warmstart: Optional[WarmStartConfig] = None,
          transport: Optional[Transport] = None) -> List[Dict]:
    """Entry point (one call per process under torchrun): train, then tear down.

    A failure is recorded for `stapo_megatron.trainer.faults` before the teardown (which is when
    the other ranks notice it); a rank that only lost its peers raises a `faults.PeerFailure`
    naming the rank that failed first.

    Raises:
        StoppedForRequeue: stopped and saved on the scheduler's warning signal (exit code
            `stapo_megatron.trainer.preemption.REQUEUE_EXIT_CODE`).
    """
    trainer = None
    try:
        trainer = Trainer(cfg, warmstart, transport)
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
