"""Prompt data: reading problems, generating them, turning them into prompt tokens.

- ``rows``: the one row reader (`read_rows`, `example_from_row`): JSONL, parquet and HF-dataset
  rows of training, held-out and benchmark files as `Example`s.
- ``examples``: `load_examples` (a file, deduplicated on request), the reasoning-gym split,
  prompt templates, `tokenize_prompts`.
- ``tokenizer``: the offline character-level tokenizer of the tiny demo model.
- ``config``: `DataConfig`.
"""
