"""The tiny CPU recipe with separate placement and one-step-off rollouts: 3 local processes, the
first 2 train (DP=2), the last runs the rollout engine (docs/async.md).

    nemo-run launch/stapo_tiny_async.py --yes           # = make demo-async; writes runs/demo-async
    nemo-run launch/stapo_tiny_async.py rollout.separate.max_staleness=0 loss.rollout_correction.mode=none \
        output_dir=runs/demo-sep0 --yes
    nemo-run launch/stapo_tiny_async.py rollout.mode=streaming rollout.separate.max_staleness=2 \
        output_dir=runs/demo-stream --yes               # streaming rollouts, eta 2
    nemo-run launch/stapo_tiny_async.py --dryrun        # the torchrun command, nothing runs

While the trainers train step s the engine generates step s + 1 with the policy of step s (one
update old), corrected for the policy that sampled them (``loss.rollout_correction.mode=tis``);
``rollout.separate.max_staleness=0 loss.rollout_correction.mode=none`` gives the colocated demo's samples
and metrics on separate ranks.
"""

import nemo_run as run

from stapo_megatron.launch import entry, executors

if __name__ == "__main__":
    run.cli.main(
        entry.run_recipe,
        name="stapo_tiny_async",
        default_factory=lambda: executors.recipe_task(
            "tiny", output_dir="runs/demo-async",
            rollout=run.Config(entry.section, mode="separate",
                               separate=run.Config(entry.section, engine_ranks=1, max_staleness=1)),
            # samples one update old: each token's surrogate weighted by min(pi_old / pi_rollout, 2)
            loss=run.Config(entry.section, rollout_correction=run.Config(entry.section, mode="tis"))),
        default_executor=executors.local_executor(nproc_per_node=3),
    )
