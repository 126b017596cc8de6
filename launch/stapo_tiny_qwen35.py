"""The tiny Qwen3.5 job: STAPO on a tiny Qwen3.5 (three gated delta-net layers, then gated full
attention), 2 local processes (torchrun, DP=2 over gloo), HF-engine rollouts (recipes/tiny.py,
``tiny_qwen35_demo``).

    nemo-run launch/stapo_tiny_qwen35.py --yes                         # writes runs/demo-qwen35
    nemo-run launch/stapo_tiny_qwen35.py steps=2 output_dir=runs/q2 --yes
    nemo-run launch/stapo_tiny_qwen35.py --dryrun                      # the torchrun command, nothing runs
"""

import nemo_run as run

from stapo_megatron.launch import entry, executors

if __name__ == "__main__":
    run.cli.main(
        entry.run_recipe,
        name="stapo_tiny_qwen35",
        default_factory=lambda: executors.recipe_task("tiny_qwen35"),
        default_executor=executors.local_executor(nproc_per_node=2),
    )
