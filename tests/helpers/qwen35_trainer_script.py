"""A short run of the real trainer on a tiny Qwen3.5 (``tiny_qwen35_demo``: HF-engine rollouts, math
rewards, Megatron with delta-net layers) for tests.

    torchrun --nproc-per-node N tests/helpers/qwen35_trainer_script.py RUN_DIR MODEL_DIR STEPS WARMSTART_STEPS [KEY=VALUE ...]

Each KEY=VALUE after them overrides the config as on the launchers (``rollout.engine=vllm``).
"""

import sys

from stapo_megatron.config.overrides import apply_overrides
from stapo_megatron.launch.entry import parse_arguments
from stapo_megatron.recipes.tiny import tiny_qwen35_demo
from stapo_megatron.trainer.loop import train

if __name__ == "__main__":
    import dataclasses

    run_dir, model_dir, steps, warmstart_steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cfg, warmstart = tiny_qwen35_demo(run_dir=run_dir)
    cfg = apply_overrides(cfg, {
        "steps": steps, "prompts_per_step": 8, "minibatch_prompts": 4, "micro_batch_size": 16,
        "eval.every": 0, "save_every": steps, "model.hf_dir": model_dir, "data.num_train": 64, "data.num_eval": 8,
        # a loose tau_p so that S2T silences tokens of an almost untrained model, and a reward it can earn
        "loss.tau_p": 0.2, "reward.name": "tests.helpers.digit_reward.starts_with_digit"})
    cfg = apply_overrides(cfg, parse_arguments(sys.argv[5:]))
    train(cfg, dataclasses.replace(warmstart, steps=warmstart_steps, cache_dir=""))
