"""Prompt data: reading problems, generating them, turning them into prompt tokens.

- ``examples``: `Example`, JSONL/parquet/HF-dataset readers, the reasoning-gym split, prompt
  templates, `tokenize_prompts`.
- ``tokenizer``: the offline character-level tokenizer of the tiny demo model.
- ``config``: `DataConfig`.
"""
