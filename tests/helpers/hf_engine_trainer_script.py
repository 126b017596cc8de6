"""The tiny recipe's trainer with the transformers rollout engine (no vLLM), on one process.

    torchrun --nproc-per-node 1 tests/helpers/hf_engine_trainer_script.py RUN_DIR MODEL_DIR STEPS

Runs on CUDA when there is one (the GPU test), else on the CPU. A second call with more STEPS
resumes from RUN_DIR's latest checkpoint.
"""

import dataclasses
import sys

import torch

from stapo_megatron.recipes import tiny_demo
from stapo_megatron.trainer.loop import train

if __name__ == "__main__":
    run_dir, model_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(f"device {'cuda' if torch.cuda.is_available() else 'cpu'}", flush=True)
    cfg, warmstart = tiny_demo(run_dir=run_dir)
    cfg = dataclasses.replace(
        cfg, steps=steps, prompts_per_step=8, minibatch_prompts=4, micro_batch_size=16,
        eval=dataclasses.replace(cfg.eval, every=0), save_every=1,
        model=dataclasses.replace(cfg.model, hf_dir=model_dir),
        data=dataclasses.replace(cfg.data, num_train=100, num_eval=10),
        rollout=dataclasses.replace(cfg.rollout, engine="hf"),
        loss=dataclasses.replace(cfg.loss, tau_p=0.2),  # loose: S2T silences tokens of a barely trained model
    )
    train(cfg, dataclasses.replace(warmstart, steps=20))
