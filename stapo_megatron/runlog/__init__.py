"""Run logging: what a run writes about itself.

- ``metrics``: `RunLogger` (metrics.jsonl, silenced tokens, samples) and reading metrics back.
- ``tracking``: TensorBoard, W&B, MLflow; ``plots``: metrics.png and ``stapo-plot``.
- ``progress``: ETA and throughput fields; ``provenance``: config, commit, versions of a run.
- ``report`` / ``compare``: the generated blocks of docs/results.md and the method comparison's summary.
- ``config``: `LoggingConfig`.
"""
