"""STAPO on Qwen3-8B-Base with 32k-token sequences (context parallelism, `recipes/paper.py::qwen3_8b_32k`) on Slurm.

    nemo-run launch/stapo_8b_32k.py --dryrun            # render the sbatch script, submit nothing
    nemo-run launch/stapo_8b_32k.py method=justrl model.hf_dir=... model.megatron_ckpt=... \
        data.train_path=... data.eval_path=... output_dir=... run.executor.account=... --yes

Cluster settings: run.executor.<field>=... or STAPO_* variables (stapo_megatron/launch/executors.py).
"""

import nemo_run as run

from stapo_megatron.launch import entry, executors

if __name__ == "__main__":
    run.cli.main(
        entry.run_recipe,
        name="stapo_8b_32k",
        default_factory=lambda: executors.recipe_task("qwen3_8b_32k"),
        default_executor=executors.paper_slurm_executor("qwen3_8b_32k"),
    )
