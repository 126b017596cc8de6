"""STAPO on Qwen3-8B-Base with streaming rollouts (`recipes/paper.py::qwen3_8b_stream`;
docs/async.md) on Slurm: 4 nodes, the first trains (TP=4, DP=2, no recomputation), the last 3 run
24 vLLM engines (TP=1) that never drain: groups admitted while the KV cache has room and at most
eta = 3 updates ahead, weights loaded between two decode iterations; tau_H from the pi_old pass
(``loss.tau_h_source=old``: exact for the first of a step's 4 mini-batches). The simulator puts it
at 1.74x the colocated recipe's tokens/s/GPU (benchmarks/RESULTS.md, "Where the streaming recipe
pays"); ``loss.tau_h_source=exact`` restores the paper's threshold at 1.35x.

    nemo-run launch/stapo_8b_stream.py --dryrun      # render the sbatch script, submit nothing
    nemo-run launch/stapo_8b_stream.py model.hf_dir=... model.megatron_ckpt=... \
        data.train_path=... data.eval_path=... output_dir=... run.executor.account=... --yes

Not the paper's protocol (it trains on samples a few updates old); the paper's is launch/stapo_8b.py.
Cluster settings: run.executor.<field>=... or STAPO_* variables (stapo_megatron/launch/executors.py).
"""

import nemo_run as run

from stapo_megatron.launch import entry, executors

if __name__ == "__main__":
    run.cli.main(
        entry.run_recipe,
        name="stapo_8b_stream",
        default_factory=lambda: executors.recipe_task("qwen3_8b_stream"),
        default_executor=executors.paper_slurm_executor("qwen3_8b_stream"),
    )
