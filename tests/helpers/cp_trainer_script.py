"""The tiny recipe's trainer at context parallelism 2 (2 processes, DP=1, the transformers
rollout engine, a short warm-start that trains packed, split rows).

    torchrun --nproc-per-node 2 tests/helpers/cp_trainer_script.py RUN_DIR MODEL_DIR STEPS
"""

import dataclasses
import sys

from stapo_megatron.recipes import tiny_demo
from stapo_megatron.trainer.loop import train

if __name__ == "__main__":
    run_dir, model_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg, warmstart = tiny_demo(run_dir=run_dir)
    cfg = dataclasses.replace(
        cfg, steps=steps, prompts_per_step=8, minibatch_prompts=4, save_every=1,
        eval=dataclasses.replace(cfg.eval, every=0),
        max_tokens_per_microbatch=160,  # one CP rank's tokens: a 288-token sequence fits split in two
        model=dataclasses.replace(cfg.model, hf_dir=model_dir, context_parallel_size=2),
        data=dataclasses.replace(cfg.data, num_train=100, num_eval=10),
        rollout=dataclasses.replace(cfg.rollout, engine="hf"),
        loss=dataclasses.replace(cfg.loss, tau_p=0.2),  # loose: S2T silences tokens of a barely trained model
    )
    train(cfg, dataclasses.replace(warmstart, steps=5, cache_dir=""))
