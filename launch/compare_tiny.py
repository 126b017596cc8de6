"""The method comparison at CPU scale: stapo, justrl, entropy20 and random, 5 seeds each.

    nemo-run launch/compare_tiny.py --yes                        # = make compare; writes runs/compare
    nemo-run launch/compare_tiny.py seeds=[1,2] steps=10 output_dir=runs/compare-small --yes
    nemo-run launch/compare_tiny.py --dryrun
    nemo-run launch/compare_tiny.py "methods=['stapo','justrl']" "objectives=['cispo']" output_dir=runs/compare-cispo --yes
                                                                # S2T on CISPO vs CISPO (quoted list items)

One local process drives the comparison (`stapo_megatron.runlog.compare.compare_tiny`); it launches each
run exactly as `make demo` launches the demo (`nemo-run launch/stapo_tiny.py` with the run's
method, objective, seed and the comparison's overrides) and writes summary.md and curves.png at the end.
"""

import os

import nemo_run as run

from stapo_megatron.runlog import compare
from stapo_megatron.launch import executors

if __name__ == "__main__":
    run.cli.main(
        compare.compare_tiny,
        name="compare_tiny",
        # relative to where nemo-run is started, whatever directory the job runs in
        default_factory=lambda: run.Partial(compare.compare_tiny, output_dir=os.path.abspath("runs/compare")),
        default_executor=run.Config(run.LocalExecutor, env_vars=dict(executors.LOCAL_ENV)),
    )
