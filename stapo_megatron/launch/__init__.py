"""Launching with NeMo-Run: the ``nemo-run`` command (`cli`, with `arguments`, `preflight` and
`paths`, `timing`, `requeue`, `shipping`, `jobs`), executors and tasks for ``launch/*.py``
(`executors`) and the function every worker runs (`entry`).

`executors`, `cli`, `preflight`, `shipping` and `jobs` import nemo_run (installed by the Makefile, or ``pip install -e .[launch]``);
`entry` does not. ``import stapo_megatron`` never imports this subpackage.
"""
