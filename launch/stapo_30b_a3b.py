"""STAPO on Qwen3-30B-A3B-Base (mixture of experts, `recipes/paper.py::qwen3_30b_a3b`) on Slurm.

    nemo-run launch/stapo_30b_a3b.py --dryrun            # render the sbatch script, submit nothing
    nemo-run launch/stapo_30b_a3b.py method=justrl model.hf_dir=... model.megatron_ckpt=... \
        data.train_path=... data.eval_path=... output_dir=... run.executor.account=... --yes

The layout (TP=4, EP=16, ETP=1 on 4 nodes) comes from the memory model (the memory table of docs/recipes.md).
Mixture-of-experts conversion and expert-parallel training land with the MoE bridge;
until then this file renders the job but the trainer refuses the model.

Cluster settings: run.executor.<field>=... or STAPO_* variables (stapo_megatron/launch/executors.py).
"""

import nemo_run as run

from stapo_megatron.launch import entry, executors

if __name__ == "__main__":
    run.cli.main(
        entry.run_recipe,
        name="stapo_30b_a3b",
        default_factory=lambda: executors.recipe_task("qwen3_30b_a3b"),
        default_executor=executors.paper_slurm_executor("qwen3_30b_a3b"),
    )
