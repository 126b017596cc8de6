"""Prompt data: loading prompt/answer datasets, offline reasoning-gym splits, prompt formatting.

Owns the path from a file (or an offline generator) to token ids of prompts the rollout engine
samples from:

- ``load_examples``: JSONL or parquet files, or HF dataset folders, read row by row by
  `stapo_megatron.data.rows` (plain ``prompt`` + ``answer``, DAPO-Math-17k's chat messages and
  ``reward_model.ground_truth``, the benchmarks' layouts, or named fields), deduplicated on request;
- ``reasoning_gym_split``: a fixed, disjoint train / held-out split of an offline reasoning-gym
  task (the embedded default trains on ``basic_arithmetic``);
- ``format_prompt`` / ``tokenize_prompts``: the tokenizer's chat template around the question plus
  the paper's instruction ``SUFFIX`` (STAPO follows JustRL here), and the max-prompt-length filter.

An ``Example`` always holds the raw question text, never a template: the template belongs to the
tokenizer of the policy being trained, and evaluation formats the same way.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Sequence

from stapo_megatron.data.rows import (DAPO_POSTFIX, DAPO_PREFIX, Example, answer_from_value, answer_to_str,  # noqa: F401
                                      example_from_row, field_value, question_from_value, read_rows)

SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
DEFAULT_PROMPT_TEMPLATE = "{question} " + SUFFIX
"""The user turn of a question: question, a space, the suffix (``DataConfig.prompt_template``)."""
JUSTRL_PROMPT_TEMPLATE = "{question}\n" + SUFFIX
"""JustRL's wrapper, which STAPO follows: question, a newline, the suffix (the paper recipes)."""

# reasoning_gym_split stops looking for new unique questions after this many generated items per
# requested example: small task spaces (few distinct questions) then fail loudly instead of looping.
_MAX_DRAWS_PER_EXAMPLE = 20


def load_examples(path: str, dedupe: bool = False, prompt_field: str = "",
                  answer_field: str = "") -> list[Example]:
    """Load prompt/answer examples from a JSONL or parquet file or an HF dataset folder.

    Rows are read by `stapo_megatron.data.rows` (the one reader of training, held-out and
    benchmark files: MATH's ``problem`` / ``solution``, OlympiadBench's ``final_answer`` lists,
    ... as well as the layouts below). Accepted row layouts (one object per JSONL line, parquet
    row or dataset row), among others:

    - plain: ``{"prompt": "<question>", "answer": "<final answer>", "id": optional}``;
    - DAPO-Math-17k: ``{"prompt": [{"role": "user", "content": ...}], "reward_model":
      {"ground_truth": ...}, "extra_info": {"index": ...}}``. The question is the last user
      message; DAPO's "Answer: $Answer" wrapper (``DAPO_PREFIX`` / ``DAPO_POSTFIX``) is removed
      because the paper's boxed ``SUFFIX`` replaces it. ``extra_info.index`` becomes the id.

    - named fields: ``prompt_field`` names the question's field (a string or chat messages, as
      above) and ``answer_field`` the answer's (a string, a number or a list of them, joined with
      ", "); a dotted name reads a nested field (``reward_model.ground_truth``). Either may be
      given alone; the other is then found as in the layouts above.

    ``answer`` wins over ``reward_model.ground_truth`` when both exist; numeric answers become
    strings. Note that the published DAPO-Math-17k parquet repeats every problem about 100 times;
    pass ``dedupe=True`` to keep the first occurrence of each question.

    Args:
        path: a ``.jsonl`` or ``.parquet`` file, or a ``datasets`` ``save_to_disk`` folder.
        dedupe: drop rows whose question text was already seen (counted in one warning).
        prompt_field: the question's field ("" = the layouts above).
        answer_field: the answer's field ("" = the layouts above).

    Returns:
        The examples in file order.

    Raises:
        ValueError: naming the file and line (or row) of the first malformed row, or the
            missing field and the fields the row has.
    """
    stem = os.path.splitext(os.path.basename(path.rstrip(os.sep)))[0]
    examples, seen, num_duplicates = [], set(), 0
    for n, (where, row) in enumerate(read_rows(path), start=1):
        line_no = where.rpartition(":")[2].removeprefix("row ")  # the file's own numbering, blank lines counted
        example = example_from_row(row, where, f"{stem}-{line_no or n}", prompt_field, answer_field)
        if dedupe:
            if example.prompt in seen:
                num_duplicates += 1
                continue
            seen.add(example.prompt)
        examples.append(example)
    if num_duplicates:
        warnings.warn(f"{path}: dropped {num_duplicates} rows whose question repeats an earlier row "
                      f"(kept {len(examples)})")
    if not examples:
        raise ValueError(f"dataset file {path!r} has no rows")
    return examples


def reasoning_gym_split(task: str, num_train: int, num_eval: int, seed: int,
                        **task_kwargs: Any) -> tuple[list[Example], list[Example]]:
    """A fixed, disjoint train / held-out split of an offline reasoning-gym task.

    reasoning-gym datasets are index-deterministic (item i depends only on seed and i), so the
    items are read in index order and de-duplicated by question text; the first ``num_eval``
    unique questions are the held-out set and the next ``num_train`` the training set. The
    held-out set therefore does not change when ``num_train`` changes, and no question appears in
    both sets.

    Args:
        task: a reasoning-gym dataset name, e.g. ``"basic_arithmetic"``.
        num_train: number of training examples.
        num_eval: number of held-out examples.
        seed: the reasoning-gym dataset seed.
        **task_kwargs: the task's config fields, e.g. ``min_terms=2, max_terms=2, max_digits=2``.

    Returns:
        (train, held_out) lists of ``Example`` with ids ``<task>-<seed>-<index>``.

    Raises:
        ValueError: for negative counts, or if the task cannot produce enough unique questions.
    """
    import reasoning_gym  # heavy import (many task modules); only generator users pay for it

    if num_train < 0 or num_eval < 0:
        raise ValueError(f"num_train and num_eval must be >= 0, got {num_train} and {num_eval}")
    num_wanted = num_train + num_eval
    max_draws = max(1, num_wanted) * _MAX_DRAWS_PER_EXAMPLE
    dataset = reasoning_gym.create_dataset(task, size=max_draws, seed=seed, **task_kwargs)
    unique: list[Example] = []
    seen: set[str] = set()
    for index in range(max_draws):
        if len(unique) == num_wanted:
            break
        item = dataset[index]
        if item["question"] in seen:
            continue
        seen.add(item["question"])
        unique.append(Example(prompt=item["question"], answer=str(item["answer"]),
                              id=f"{task}-{seed}-{index}"))
    if len(unique) < num_wanted:
        raise ValueError(
            f"reasoning-gym task {task!r} ({task_kwargs}) gave only {len(unique)} unique questions "
            f"in {max_draws} draws; asked for num_train + num_eval = {num_wanted}")
    return unique[num_eval:], unique[:num_eval]


def format_prompt(tokenizer: Any, question: str, use_chat_template: bool = True,
                  template: str = DEFAULT_PROMPT_TEMPLATE) -> str:
    """The prompt text the policy sees: question + the paper's ``SUFFIX``, in the chat template.

    Args:
        tokenizer: a Hugging Face tokenizer (its ``chat_template`` is used).
        question: the raw question text (``Example.prompt``).
        use_chat_template: wrap as one user turn with ``add_generation_prompt=True``; if False,
            return the plain user turn (for base models used without a template).
        template: the user turn, ``{question}`` replaced by the question (rstripped);
            `DEFAULT_PROMPT_TEMPLATE` or `JUSTRL_PROMPT_TEMPLATE`.

    Returns:
        The formatted prompt string (special tokens included as text when templated).

    Raises:
        ValueError: if ``use_chat_template`` is set and the tokenizer has no chat template.
    """
    content = template.replace("{question}", question.rstrip())
    if not use_chat_template:
        return content
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat "
                         "template; use plain prompts (data.use_chat_template=False in a config, --no-chat-template "
                         "with stapo-eval)")
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


def tokenize_prompts(tokenizer: Any, examples: Sequence[Example], max_prompt_len: int,
                     use_chat_template: bool = True,
                     template: str = DEFAULT_PROMPT_TEMPLATE) -> tuple[list[list[int]], list[Example], int]:
    """Format and tokenize prompts, dropping those longer than ``max_prompt_len`` tokens.

    Special tokens are not added again: the chat template already contains them (Qwen has no BOS).

    Args:
        tokenizer: a Hugging Face tokenizer.
        examples: the examples to tokenize.
        max_prompt_len: the longest prompt kept, in tokens (the paper uses 1024).
        use_chat_template, template: see ``format_prompt``.

    Returns:
        (token ids of kept prompts, the kept examples in the same order, number dropped). One
        ``warnings.warn`` reports the number dropped, if any.

    Raises:
        ValueError: if ``max_prompt_len`` is not positive, or if every prompt is longer (an empty
            training or held-out set would only show up later as no data or a NaN accuracy).
    """
    if max_prompt_len <= 0:
        raise ValueError(f"max_prompt_len must be positive, got {max_prompt_len}")
    if not examples:
        return [], [], 0
    texts = [format_prompt(tokenizer, e.prompt, use_chat_template, template) for e in examples]
    all_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    kept_ids, kept, dropped_ids = [], [], []
    for example, ids in zip(examples, all_ids):
        if len(ids) > max_prompt_len:
            dropped_ids.append(example.id)
            continue
        kept_ids.append(list(ids))
        kept.append(example)
    if not kept:
        lengths = [len(ids) for ids in all_ids]
        raise ValueError(f"all {len(examples)} prompts are longer than max_prompt_len={max_prompt_len} tokens "
                         f"(shortest {min(lengths)}, longest {max(lengths)}; first ids {dropped_ids[:3]}); "
                         "raise data.max_prompt_len")
    if dropped_ids:
        warnings.warn(f"dropped {len(dropped_ids)} of {len(examples)} prompts longer than "
                      f"max_prompt_len={max_prompt_len} tokens (first ids: {dropped_ids[:5]})")
    return kept_ids, kept, len(dropped_ids)
