"""A small resumable training run for the checkpoint tests (torchrun, 2 ranks: DP=2).

Trains a tiny GPTModel with the STAPO loss on synthetic rollouts, saving a checkpoint after every
step and resuming from the newest complete one on start. Appends ``{"step", "loss", "resumed"}``
rows to ``<run_dir>/losses.jsonl`` (rank 0).

    torchrun --nproc-per-node 2 tests/ckpt_train_script.py RUN_DIR STEPS
"""

import json
import os
import sys

import torch

from stapo_megatron import checkpoint as ckpt
from stapo_megatron.loss import LossConfig, compute_logprob_entropy
from stapo_megatron.parallel import destroy_parallel, init_parallel
from stapo_megatron.step import OptimConfig, policy_update, wrap_model_and_optimizer
from stapo_megatron.synthetic import build_tiny_gpt, synthetic_rollouts, tiny_gpt_config

VOCAB, PROMPT, RESPONSE = 384, 4, 12


def main(run_dir: str, steps: int) -> None:
    groups = init_parallel(1, 1)
    rank = torch.distributed.get_rank()
    dp, dp_rank = torch.distributed.get_world_size(groups.dp), torch.distributed.get_rank(groups.dp)
    model = build_tiny_gpt(tiny_gpt_config(), VOCAB, PROMPT + RESPONSE)
    model, optimizer = wrap_model_and_optimizer(model, OptimConfig(lr=1e-2))
    start, resumed = 0, None
    latest = ckpt.find_latest(run_dir)
    if latest:
        start = ckpt.load_checkpoint(latest, model, optimizer)["step"]
        resumed = os.path.basename(latest)
    for step in range(start, steps):
        mbs, _ = synthetic_rollouts(4, 4, PROMPT, RESPONSE, VOCAB, seed=step, micro_batch_size=2)
        mine = mbs[dp_rank::dp]
        stats = compute_logprob_entropy(model, mine, PROMPT + RESPONSE)
        for mb, (logprob, _) in zip(mine, stats):
            mb["old_logprob"] = logprob
        # a random number drawn each step: resumed RNG state must reproduce it
        noise = torch.rand(1).item()
        metrics = policy_update(model, optimizer, mine, LossConfig(tau_p=0.003), groups, PROMPT + RESPONSE, stats)
        ckpt.save_checkpoint(run_dir, step + 1, model, optimizer, {"note": "test"})
        if rank == 0:
            with open(os.path.join(run_dir, "losses.jsonl"), "a") as f:
                f.write(json.dumps({"step": step + 1, "loss": metrics["loss"], "noise": noise,
                                    "grad_norm": metrics["grad_norm"], "resumed": resumed}) + "\n")
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
