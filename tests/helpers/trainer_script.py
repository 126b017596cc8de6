"""A 2-step run of the real trainer (vLLM rollouts, math rewards, Megatron, DP=2) for tests.

    torchrun --nproc-per-node 2 tests/helpers/trainer_script.py RUN_DIR MODEL_DIR STEPS [WARMSTART_CACHE_DIR]
"""

import dataclasses
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from stapo_megatron.recipes import tiny_demo  # noqa: E402

from stapo_megatron.trainer.loop import train  # noqa: E402

if __name__ == "__main__":
    run_dir, model_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cache_dir = sys.argv[4] if len(sys.argv) > 4 else ""
    cfg, warmstart = tiny_demo(run_dir=run_dir)
    cfg = dataclasses.replace(
        cfg, steps=steps, prompts_per_step=16, minibatch_prompts=8, micro_batch_size=16,
        eval=dataclasses.replace(cfg.eval, every=steps), save_every=1,
        model=dataclasses.replace(cfg.model, hf_dir=model_dir),
        data=dataclasses.replace(cfg.data, num_train=200, num_eval=20),
        # a loose tau_p so that S2T silences tokens of an almost untrained model
        loss=dataclasses.replace(cfg.loss, tau_p=0.2),
    )
    # enough warm-start for some correct samples (non-zero advantages) at T=1
    train(cfg, dataclasses.replace(warmstart, steps=100, cache_dir=cache_dir))
