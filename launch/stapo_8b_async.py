"""STAPO on Qwen3-8B-Base with separate placement and one-step-off rollouts
(`recipes/paper.py::qwen3_8b_async`; docs/async.md) on Slurm: 4 nodes, the
first 2 train, the last 2 run 4 vLLM engines (TP=4) that generate step s + 1 while step s trains.

    nemo-run launch/stapo_8b_async.py --dryrun      # render the sbatch script, submit nothing
    nemo-run launch/stapo_8b_async.py model.hf_dir=... model.megatron_ckpt=... \
        data.train_path=... data.eval_path=... output_dir=... run.executor.account=... --yes

Not the paper's protocol (it trains on samples one update old); the paper's is launch/stapo_8b.py.
Cluster settings: run.executor.<field>=... or STAPO_* variables (stapo_megatron/launch/executors.py).
"""

import nemo_run as run

from stapo_megatron.launch import entry, executors

if __name__ == "__main__":
    run.cli.main(
        entry.run_recipe,
        name="stapo_8b_async",
        default_factory=lambda: executors.recipe_task("qwen3_8b_async"),
        default_executor=executors.paper_slurm_executor("qwen3_8b_async"),
    )
