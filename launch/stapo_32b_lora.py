"""STAPO with LoRA on Qwen3-32B (`recipes/lora.py::qwen3_32b_lora`) on Slurm, one node of 8 GPUs.

    nemo-run launch/stapo_32b_lora.py --dryrun       # layout, memory per GPU, step time; the sbatch script
    nemo-run launch/stapo_32b_lora.py model.hf_dir=... model.megatron_ckpt=... \
        data.train_path=... data.eval_path=... output_dir=... run.executor.account=... --yes

The adapters: lora.rank / lora.alpha / lora.target_modules; their learning rate optim.lr (docs/lora.md).
Cluster settings: run.executor.<field>=... or STAPO_* variables (stapo_megatron/launch/executors.py).
"""

import nemo_run as run

from stapo_megatron.launch import entry, executors

if __name__ == "__main__":
    run.cli.main(
        entry.run_recipe,
        name="stapo_32b_lora",
        default_factory=lambda: executors.recipe_task("qwen3_32b_lora"),
        default_executor=executors.paper_slurm_executor("qwen3_32b_lora"),
    )
