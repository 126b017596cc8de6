"""The tiny MoE job: STAPO on a tiny Qwen3-MoE (4 experts, top-2), 2 local processes (torchrun),
expert parallelism 2 over gloo, HF-engine rollouts with routing disagreement (recipes/tiny.py,
``tiny_moe_demo``).

    nemo-run launch/stapo_tiny_moe.py --yes                         # writes runs/demo-moe
    nemo-run launch/stapo_tiny_moe.py steps=2 output_dir=runs/moe2 --yes
    nemo-run launch/stapo_tiny_moe.py --dryrun                      # the torchrun command, nothing runs
"""

import nemo_run as run

from stapo_megatron.launch import entry, executors

if __name__ == "__main__":
    run.cli.main(
        entry.run_recipe,
        name="stapo_tiny_moe",
        default_factory=lambda: executors.recipe_task("tiny_moe"),
        default_executor=executors.local_executor(nproc_per_node=2),
    )
