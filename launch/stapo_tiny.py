"""The embedded default main job: STAPO on the tiny CPU recipe, 2 local processes (torchrun).

    nemo-run launch/stapo_tiny.py --yes                 # = make demo; writes runs/demo
    nemo-run launch/stapo_tiny.py method=justrl output_dir=runs/demo-justrl steps=20 --yes
    nemo-run launch/stapo_tiny.py --dryrun              # the torchrun command, nothing runs
"""

import nemo_run as run

from stapo_megatron.launch import entry, executors

if __name__ == "__main__":
    run.cli.main(
        entry.run_recipe,
        name="stapo_tiny",
        default_factory=lambda: executors.recipe_task("tiny"),
        default_executor=executors.local_executor(nproc_per_node=2),
    )
