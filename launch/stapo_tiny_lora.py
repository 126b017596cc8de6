"""The tiny CPU demo with LoRA (`recipes/tiny.py::tiny_lora_demo`), 2 local processes (torchrun).

    make demo-lora                                      # writes the warm-started base, then runs/demo-lora
    nemo-run launch/stapo_tiny_lora.py --yes            # the RL part alone, once the base exists
    nemo-run launch/stapo_tiny_lora.py --dryrun         # the torchrun command, nothing runs

The frozen base is the full-weight demo's warm-started model (``model.megatron_ckpt``, written by
``make demo-lora``'s first command); the run trains only the adapters (docs/lora.md).
"""

import nemo_run as run

from stapo_megatron.launch import entry, executors

if __name__ == "__main__":
    run.cli.main(
        entry.run_recipe,
        name="stapo_tiny_lora",
        default_factory=lambda: executors.recipe_task("tiny_lora"),
        default_executor=executors.local_executor(nproc_per_node=2),
    )
