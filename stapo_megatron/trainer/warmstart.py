"""The warm-start component: a supervised warm-start before RL, trained once and reused by every
run of a recipe (`WarmStart`, which the trainer asks once before RL; `cached_path` its cache).

The CPU demo starts RL from a tiny model warm-started on worked answers (``recipes/tiny.py``).
Trained from the same seeds, on the same data and parallel layout, the warm-start gives the
same weights every time, so it is trained once and kept in ``WarmStartConfig.cache_dir``
(git-ignored ``.cache/warmstart`` in the demo) under a key that hashes everything that
determines it. The recipe is the source of truth and the cache only saves time: a changed recipe
gives a new key (a new folder), and deleting the folder retrains the same weights.

Written like every model-only save (`checkpoint.save_model_only`): to a temporary sibling,
renamed when complete, so an interrupted warm-start never leaves a folder that looks cached.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from typing import List, Optional, Tuple

import torch.distributed as dist

from stapo_megatron.bridge.model import load_checkpoint
from stapo_megatron.config import TrainerConfig, WarmStartConfig
from stapo_megatron.mcore import checkpoint as ckpt
from stapo_megatron.batch.microbatch import MicroBatch
from stapo_megatron.batch.minibatches import MicroBatchLayout, build_minibatches
from stapo_megatron.batch.records import records_from_lists
from stapo_megatron.mcore.schedule import PassContext
from stapo_megatron.mcore.sft import sft_step
from stapo_megatron.mcore.step import build_optimizer
from stapo_megatron.trainer.replicas import seq_align
from stapo_megatron.trainer.prompts import step_prompt_indices
from stapo_megatron.trainer.seeds import Seeds
from stapo_megatron.utils import load_dotted

_FORMAT = 1
"""Bumped when what the key covers or the folder layout changes."""


def _file_digest(path: str) -> str:
    if not os.path.exists(path):
        return "absent"
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def cache_key(cfg: TrainerConfig, warmstart: WarmStartConfig, seed: int, data_seed: int, world_size: int) -> str:
    """A short hash of what determines the warm-started weights.

    Covers the warm-start config (but not where it is cached or copied), its seed, the data
    config and its seed, the model folder's ``config.json`` and tokenizer, the parallel layout
    and world size, the micro-batch size and the optimizer settings the SFT inherits (all but
    the learning rate and weight decay, which the warm-start sets itself).
    """
    ws = dataclasses.asdict(dataclasses.replace(warmstart, cache_dir="", save_to="", seed=None))
    optim = {k: v for k, v in dataclasses.asdict(cfg.optim).items() if k not in ("lr", "weight_decay")}
    model = dict(tp=cfg.model.tensor_model_parallel_size, pp=cfg.model.pipeline_model_parallel_size,
                 bf16=cfg.model.bf16, config=_file_digest(os.path.join(cfg.model.hf_dir, "config.json")),
                 tokenizer=_file_digest(os.path.join(cfg.model.hf_dir, "tokenizer.json")),
                 megatron_ckpt=cfg.model.megatron_ckpt)
    if cfg.packing != "padded":  # packing trains on the SDPA core attention (padded keys stay as they were)
        model["core_attention"] = "sdpa"
    if cfg.model.context_parallel_size > 1:  # packed, split SFT batches (CP = 1 keys stay as they were)
        model["cp"] = cfg.model.context_parallel_size
    data = dataclasses.asdict(dataclasses.replace(cfg.data, seed=None))
    payload = dict(format=_FORMAT, warmstart=ws, seed=seed, data=data, data_seed=data_seed, model=model,
                   optim=optim, micro_batch_size=cfg.micro_batch_size, world_size=world_size)
    if cfg.lora is not None:  # LoRA: the warm-start trains the adapters (full fine-tuning keys stay as they were)
        payload["lora"] = dataclasses.asdict(cfg.lora)
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_path(cfg: TrainerConfig, warmstart: Optional[WarmStartConfig], seed: int, data_seed: int,
                world_size: int) -> Optional[str]:
    """``<cache_dir>/warmstart-<key>`` when the warm-start is cached, else None."""
    if warmstart is None or not warmstart.steps or not warmstart.cache_dir:
        return None
    key = cache_key(cfg, warmstart, seed, data_seed, world_size)
    return os.path.join(warmstart.cache_dir, f"warmstart-{key}")


def is_complete(path: str) -> bool:
    """A cached warm-start is complete once its folder exists (it is renamed into place whole)."""
    return os.path.isfile(os.path.join(path, ".metadata"))


class WarmStart:
    """Supervised warm-start on the training prompts (a fresh AdamW, discarded afterwards), or
    its cached weights when a run with the same key made them."""

    def __init__(self, cfg: TrainerConfig, config: WarmStartConfig, seeds: Seeds, tokenizer,
                 train_ids: List[List[int]], train_examples: List, seq_multiple: int):
        self.cfg, self.config, self.seeds, self.tokenizer = cfg, config, seeds, tokenizer
        self.train_ids, self.train_examples, self.seq_multiple = train_ids, train_examples, seq_multiple
        self.cached = cached_path(cfg, config, seeds.model_init, seeds.data_split, dist.get_world_size())
        """The cache folder of this warm-start (None: not cached)."""
        self.rank = dist.get_rank()

    def _log(self, text: str) -> None:
        if self.rank == 0:
            print(f"[warm-start] {text}", flush=True)

    def train(self, ctx: PassContext) -> None:
        """``config.steps`` SFT steps of ``ctx.model`` on ``config.prompts_per_step`` prompts each."""
        ws, groups = self.config, ctx.groups
        eos = self.tokenizer.eos_token_id
        optimizer = build_optimizer(ctx.model, dataclasses.replace(self.cfg.optim, lr=ws.lr, weight_decay=0.0))
        target = (load_dotted(ws.target_fn, "warmstart.target_fn") if ws.target_fn
                  else lambda ex: ws.target_template.format(answer=ex.answer))
        dp_size, dp_rank = dist.get_world_size(groups.dp), dist.get_rank(groups.dp)
        for step in range(ws.steps):
            idx = step_prompt_indices(step, ws.prompts_per_step, self.seeds.warmstart_order, len(self.train_ids),
                                      dp_size, dp_rank)
            prompts = [self.train_ids[i] for i in idx]
            targets = [self.tokenizer.encode(target(self.train_examples[i]), add_special_tokens=False) + [eos]
                       for i in idx]
            mbs, seq = self._microbatches(step, prompts, targets, groups, next(ctx.model.parameters()).device)
            nll = sft_step(dataclasses.replace(ctx, seq_length=seq), optimizer, mbs, ws.label_smoothing)
            if step % 10 == 0 or step == ws.steps - 1:
                self._log(f"step {step}/{ws.steps} nll {nll:.4f}")

    def _microbatches(self, step: int, prompts, targets, groups, device) -> Tuple[List[MicroBatch], int]:
        """The SFT micro-batches of one step and their length: padded rows of
        ``micro_batch_size`` sequences, or under context parallelism the same sequences packed
        and split over CP (CP trains packed rows only)."""
        records = records_from_lists(prompts, targets, [0.0] * len(prompts), [[0.0] * len(t) for t in targets])
        cp = groups.cp_size
        layout = MicroBatchLayout("fixed" if cp > 1 else "padded", self.cfg.micro_batch_size,
                             pad_id=self.tokenizer.pad_token_id, seq_multiple=self.seq_multiple,
                             seq_align=seq_align(self.cfg.model), cp_size=cp,
                             cp_rank=dist.get_rank(groups.cp) if cp > 1 else 0, device=device)
        seed = self.seeds.warmstart_microbatches(step)
        (mbs,), seq = build_minibatches(records, layout, microbatch_seed=lambda first, dp_rank: seed)
        return mbs, seq

    def apply(self, ctx: PassContext, rl_optimizer) -> None:
        """Warm-start ``ctx.model`` (DDP-wrapped), or load the cached weights; then tell the RL
        optimizer: with bf16 its fp32 main parameters still hold the initial weights and would
        overwrite the warm-start at the first step."""
        if self.cached and is_complete(self.cached):
            load_checkpoint(ctx.model.module, self.cached)
            self._log(f"loaded the cached warm-start {self.cached}")
        else:
            self.train(ctx)
            if self.cached:
                ckpt.save_model_only(ctx.model, self.cached)
                self._log(f"cached in {self.cached}")
        if self.config.save_to:
            ckpt.save_model_only(ctx.model, self.config.save_to)
        rl_optimizer.reload_model_params()
        if self.cfg.lora is not None and self.cfg.loss.kl_coef > 0:
            warnings.warn("LoRA with a warm-start and loss.kl_coef > 0: the warm-start trained the adapters, and the "
                          "KL reference is the base model without them (the model before the warm-start)")

    def load_reference(self, reference) -> None:
        """On resume: the KL reference is the warm-started policy RL began from, read back from
        the cache; without a cache it keeps the pre-warm-start weights (warned). With LoRA the
        reference is the policy's base, which the warm-start did not train: nothing to load."""
        if self.cfg.lora is not None:
            return
        if self.cached and is_complete(self.cached):
            load_checkpoint(reference, self.cached)
            return
        warnings.warn("resumed with a warm-start and loss.kl_coef > 0 but no cached warm-start: the KL reference "
                      "holds the weights before the warm-start (model.megatron_ckpt or the random init)")
