"""The trainer's prompts: loading and tokenizing them, choosing each step's.

Training and held-out prompts come from files or a reasoning-gym generator (`load_prompts`);
each step (and each warm-start step) takes a seeded permutation's next slice, split over DP
(`step_prompt_indices`).
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from stapo_megatron.data import examples as data
from stapo_megatron.data.config import DataConfig


def pad_to(n: int, multiple: int = 8) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return (n + multiple - 1) // multiple * multiple


def load_prompts(config: DataConfig, tokenizer, split_seed: int,
                 eval_sets: bool) -> List[Tuple[List[List[int]], List]]:
    """[(prompt token ids, examples) of the training set, the same of the held-out set].

    ``split_seed``: the seed of the generated (reasoning-gym) split (`Seeds.data_split`);
    ``eval_sets``: whether ``eval.sets`` name the evaluation (then a training file needs no
    held-out file)."""
    if config.train_path:
        train = data.load_examples(config.train_path, dedupe=config.dedupe, **config.training_fields())
        if config.eval_path:
            held_out = data.load_examples(config.eval_path, **config.held_out_fields())
        elif eval_sets:  # the named sets are the evaluation; no held-out split of the training data
            held_out = []
        else:
            raise ValueError("data.train_path is set but data.eval_path is not: give a held-out file, "
                             "or name the evaluation sets in eval.sets")
    else:
        train, held_out = data.reasoning_gym_split(
            config.reasoning_gym_task, config.num_train, config.num_eval, split_seed, **config.reasoning_gym_kwargs,
        )
    out = []
    for examples in (train, held_out):
        ids, kept, _ = data.tokenize_prompts(
            tokenizer, examples, config.max_prompt_len, config.use_chat_template, config.prompt_template
        )
        out.append((ids, kept))
    return out


def step_prompt_indices(step: int, count: int, seed: int, num_prompts: int, dp_size: int, dp_rank: int) -> List[int]:
    """Indices of this DP rank's ``count // dp_size`` prompts of a step: positions
    ``step * count ...`` of a seeded permutation per epoch of the ``num_prompts`` prompts."""
    first = step * count
    idx, perms = [], {}
    for pos in range(first, first + count):
        epoch, offset = divmod(pos, num_prompts)
        if epoch not in perms:
            perms[epoch] = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed + epoch))
        idx.append(int(perms[epoch][offset]))
    per_rank = count // dp_size
    return idx[dp_rank * per_rank : (dp_rank + 1) * per_rank]
