"""The tiny recipe's trainer with the transformers rollout engine (no vLLM), on one process.

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=... \\
        python tests/helpers/hf_engine_trainer_script.py RUN_DIR MODEL_DIR STEPS

Runs on CUDA when there is one (the GPU test), else on the CPU. A second call with more STEPS
resumes from RUN_DIR's latest checkpoint. Cut for time: a 2-step warm-start (cached in RUN_DIR's
parent, so the warm-start path runs without training the recipe's 250 steps), no evaluation,
one reward worker. The heavy imports sit under ``__main__``: the reward pool spawns its workers,
which import this main module, and would otherwise each import torch, Megatron and transformers.
Prints ``[phase] NAME at T s`` lines (seconds since the process started) for the test's message.
"""

import time

START = time.perf_counter()


def phase(name: str) -> None:
    print(f"[phase] {name} at {time.perf_counter() - START:.1f} s", flush=True)


if __name__ == "__main__":
    import dataclasses
    import os
    import sys

    import torch

    from stapo_megatron.recipes import tiny_demo
    from stapo_megatron.trainer.loop import train

    phase("imports")
    run_dir, model_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(f"device {'cuda' if torch.cuda.is_available() else 'cpu'}", flush=True)
    cfg, warmstart = tiny_demo(run_dir=run_dir)
    cfg = dataclasses.replace(
        cfg, steps=steps, prompts_per_step=8, minibatch_prompts=4, micro_batch_size=16,
        eval=dataclasses.replace(cfg.eval, every=0), save_every=1,
        model=dataclasses.replace(cfg.model, hf_dir=model_dir),
        data=dataclasses.replace(cfg.data, num_train=100, num_eval=10),
        rollout=dataclasses.replace(cfg.rollout, engine="hf"),
        reward=dataclasses.replace(cfg.reward, workers=1),
        loss=dataclasses.replace(cfg.loss, tau_p=0.2),  # loose: S2T silences tokens of a barely trained model
    )
    cache_dir = os.path.join(os.path.dirname(os.path.abspath(run_dir)), "warmstart-cache")
    train(cfg, dataclasses.replace(warmstart, steps=2, cache_dir=cache_dir))
    phase("done")
