"""STAPO on Qwen3.5-27B (dense, hybrid delta-net layers; `recipes/paper.py::qwen35_27b`, layout in `recipes/qwen35.py`) on Slurm.

    nemo-run launch/stapo_qwen35_27b.py --dryrun            # render the sbatch script, submit nothing
    nemo-run launch/stapo_qwen35_27b.py method=justrl model.hf_dir=... model.megatron_ckpt=... \
        data.train_path=... data.eval_path=... output_dir=... run.executor.account=... --yes

The layout (TP=4, PP=2, DP=8 on 8 nodes, no context parallelism: the delta-net layers have none)
comes from the memory model (the memory table of docs/recipes.md).

Cluster settings: run.executor.<field>=... or STAPO_* variables (stapo_megatron/launch/executors.py).
"""

import nemo_run as run

from stapo_megatron.launch import entry, executors

if __name__ == "__main__":
    run.cli.main(
        entry.run_recipe,
        name="stapo_qwen35_27b",
        default_factory=lambda: executors.recipe_task("qwen35_27b"),
        default_executor=executors.paper_slurm_executor("qwen35_27b"),
    )
