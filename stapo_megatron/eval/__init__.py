"""Evaluation: avg@k / pass@k of sampled responses, in training and from the command line.

- ``config``: `EvalConfig` (the trainer's ``eval`` section), `EvalSetConfig`, `Decoding` and the
  parsing of ``eval.sets`` strings (`eval_set_configs`).
- ``scoring``: loading benchmark sets, scoring responses, avg@k / pass@k, tables.
- ``evaluator``: the in-training `Evaluator` the loop asks (``should_evaluate(step)`` /
  ``evaluate(step)``).
- ``engine``: the engine ``stapo-eval`` samples with (``--tensor-parallel-size``: vLLM's own
  worker processes).
- ``cli``: ``stapo-eval``.
"""
