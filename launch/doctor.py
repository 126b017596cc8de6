"""stapo-doctor on one or two Slurm nodes, before the first long job: every GPU component checked
alone (`stapo_megatron.doctor`), NCCL measured over the job's GPUs (between the nodes on two).

    nemo-run launch/doctor.py --dryrun                       # render the sbatch script, submit nothing
    nemo-run launch/doctor.py run.executor.account=... --yes # one node, 8 GPUs
    nemo-run launch/doctor.py run.executor.nodes=2 --yes     # two nodes: the inter-node bandwidth
    nemo-run launch/doctor.py moe=true skip=stapo_steps,te_spec --yes

Every rank joins the collectives row; rank 0 then runs the other checks and prints the report in
the job's log. Cluster settings: run.executor.<field>=... or STAPO_* variables
(stapo_megatron/launch/executors.py). No requeue: a doctor that fails should be read, not retried.
"""

import nemo_run as run

from stapo_megatron.doctor import cli
from stapo_megatron.launch import executors

if __name__ == "__main__":
    run.cli.main(
        cli.run_from_launch,
        name="doctor",
        default_factory=lambda: run.Partial(cli.run_from_launch),
        default_executor=executors.slurm_executor(nodes=1, retries=0),
    )
