"""The embedded default main job: STAPO RL on a 2-core CPU (torchrun, 2 processes, DP=2).

    .venv/bin/python examples/prepare_tiny_model.py runs/demo/model
    .venv/bin/torchrun --nproc-per-node 2 examples/demo_rl.py [method]

Writes runs/demo/metrics.jsonl, metrics.png, silenced_tokens.jsonl, tensorboard/ and
checkpoints/ (a rerun resumes from the last complete checkpoint).
"""

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from stapo_megatron.recipes import tiny_demo  # noqa: E402

from stapo_megatron.trainer import train  # noqa: E402

if __name__ == "__main__":
    method = sys.argv[1] if len(sys.argv) > 1 else "stapo"
    cfg, warmstart = tiny_demo(method=method)
    train(cfg, warmstart)
