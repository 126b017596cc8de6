"""STAPO on Qwen3-14B-Base (the paper's recipe, `recipes/paper.py::qwen3_14b`) on Slurm.

    nemo-run launch/stapo_14b.py --dryrun            # render the sbatch script, submit nothing
    nemo-run launch/stapo_14b.py method=justrl model.hf_dir=... model.megatron_ckpt=... \
        data.train_path=... data.eval_path=... output_dir=... run.executor.account=... --yes

Cluster settings: run.executor.<field>=... or STAPO_* variables (stapo_megatron/launch/executors.py).
"""

import nemo_run as run

from stapo_megatron.launch import entry, executors

if __name__ == "__main__":
    run.cli.main(
        entry.run_recipe,
        name="stapo_14b",
        default_factory=lambda: executors.recipe_task("qwen3_14b"),
        default_executor=executors.paper_slurm_executor("qwen3_14b"),
    )
