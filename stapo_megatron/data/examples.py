"""Prompt data: loading prompt/answer datasets, offline reasoning-gym splits, prompt formatting.

Owns the path from a file (or an offline generator) to token ids of prompts the rollout engine
samples from:

- ``load_examples``: JSONL or parquet files, or HF dataset folders (``read_rows``), in the plain
  layout (``prompt`` + ``answer``), in DAPO-Math-17k's layout (chat-message ``prompt``, answer in
  ``reward_model.ground_truth``), or with named fields (``prompt_field`` / ``answer_field``);
- ``reasoning_gym_split``: a fixed, disjoint train / held-out split of an offline reasoning-gym
  task (the embedded default trains on ``basic_arithmetic``);
- ``format_prompt`` / ``tokenize_prompts``: the tokenizer's chat template around the question plus
  the paper's instruction ``SUFFIX`` (STAPO follows JustRL here), and the max-prompt-length filter.

An ``Example`` always holds the raw question text, never a template: the template belongs to the
tokenizer of the policy being trained, and evaluation formats the same way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from typing import Any, Iterator, Sequence

SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
DEFAULT_PROMPT_TEMPLATE = "{question} " + SUFFIX
"""The user turn of a question: question, a space, the suffix (``DataConfig.prompt_template``)."""
JUSTRL_PROMPT_TEMPLATE = "{question}\n" + SUFFIX
"""JustRL's wrapper, which STAPO follows: question, a newline, the suffix (the paper recipes)."""

# DAPO-Math-17k wraps every problem in an "Answer: $Answer" instruction. It contradicts the boxed
# SUFFIX above, so the wrapper is removed and only the problem text is kept.
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_POSTFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

# reasoning_gym_split stops looking for new unique questions after this many generated items per
# requested example: small task spaces (few distinct questions) then fail loudly instead of looping.
_MAX_DRAWS_PER_EXAMPLE = 20


@dataclasses.dataclass
class Example:
    """One prompt with its reference answer."""

    prompt: str
    """The raw question text, without chat template or instruction suffix."""

    answer: str
    """The reference final answer (compared by the run's reward, ``stapo_megatron.rewards``)."""

    id: str
    """A stable identifier: the row's own id when it has one, else ``<file stem>-<row number>``."""


def read_rows(path: str) -> Iterator[tuple[str, dict]]:
    """Yield (location, row) for every row of a JSONL file, a parquet file or an HF dataset folder.

    Location is ``file:line`` (JSONL), ``file:row N`` (parquet) or ``folder:row N`` (dataset
    folder). A dataset folder is what ``datasets.Dataset.save_to_disk`` writes (see
    ``_hf_dataset_tables``); it is read with pyarrow, so the ``datasets`` package is not needed.
    """
    if os.path.isdir(path):
        rows = (row for table in _hf_dataset_tables(path) for row in table.to_pylist())
        for i, row in enumerate(rows, start=1):
            yield f"{path}:row {i}", row
        return
    if not os.path.isfile(path):
        raise ValueError(f"dataset file {path!r} does not exist")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq  # only parquet users need pyarrow loaded

        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield f"{path}:row {i}", row
        return
    if not path.endswith(".jsonl"):
        raise ValueError(f"dataset file {path!r}: expected a .jsonl or .parquet file or an HF dataset folder")
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{i}: invalid UTF-8 ({e.reason} at byte {e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: invalid JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
            yield f"{path}:{i}", row


def _hf_dataset_tables(folder: str) -> list:
    """The pyarrow tables of a ``datasets.Dataset.save_to_disk`` folder, in order.

    That layout is ``state.json`` (its ``_data_files`` list names the shards), the shards
    ``data-0000i-of-0000n.arrow`` (Arrow IPC streams) and ``dataset_info.json``. A
    ``DatasetDict`` folder (``dataset_dict.json`` and one such folder per split) is refused with
    the split folders to choose from.
    """
    import pyarrow as pa  # only dataset-folder users need pyarrow loaded

    splits_file = os.path.join(folder, "dataset_dict.json")
    if os.path.isfile(splits_file):
        with open(splits_file, encoding="utf-8") as f:
            splits = json.load(f).get("splits", [])
        raise ValueError(f"{folder!r} is an HF DatasetDict with splits {splits}: give one split's folder, "
                         f"e.g. {os.path.join(folder, splits[0] if splits else 'train')!r}")
    state_file = os.path.join(folder, "state.json")
    if not os.path.isfile(state_file):
        raise ValueError(f"{folder!r} is a folder but not an HF dataset folder (no state.json, as "
                         "datasets.Dataset.save_to_disk writes); give a .jsonl or .parquet file or such a folder")
    with open(state_file, encoding="utf-8") as f:
        files = [entry["filename"] for entry in json.load(f).get("_data_files", [])]
    if not files:
        raise ValueError(f"{state_file}: lists no data files (_data_files)")
    tables = []
    for name in files:
        shard = os.path.join(folder, name)
        if not os.path.isfile(shard):
            raise ValueError(f"{state_file} names {name!r}, which is not in {folder!r}")
        with pa.memory_map(shard) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    return tables


def field_value(row: dict, field: str, where: str, setting: str) -> Any:
    """The value of ``field`` in ``row``; a dotted name (``reward_model.ground_truth``) reads a
    nested object.

    Raises:
        ValueError: naming the location, the setting that named the field and the fields present.
    """
    value: Any = row
    for i, part in enumerate(field.split(".")):
        if not isinstance(value, dict) or part not in value:
            inner = ".".join(field.split(".")[:i])
            present = sorted(value) if isinstance(value, dict) else f"none ({inner} is a {type(value).__name__})"
            raise ValueError(f"{where}: no field {field!r} ({setting} = {field!r}); fields present"
                             f"{' in ' + repr(inner) if inner else ''}: {present}")
        value = value[part]
    return value


def _question_from_messages(messages: Sequence[Any], where: str) -> str:
    """The problem text of a DAPO-style chat prompt: the last user message, wrapper removed."""
    user = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not user or not isinstance(user[-1].get("content"), str):
        raise ValueError(f"{where}: chat-message `prompt` has no user message with string content")
    text = user[-1]["content"]
    if text.startswith(DAPO_PREFIX):
        text = text[len(DAPO_PREFIX):]
    if text.endswith(DAPO_POSTFIX):
        text = text[: -len(DAPO_POSTFIX)]
    return text


def answer_to_str(value: Any, where: str, field: str) -> str:
    """A reference answer as text: numbers (AIME answers are often ints) become strings.

    Raises:
        ValueError: if the value is missing, empty, NaN/infinite (parquet's and pandas' missing
            value, which would otherwise become the answer "nan"), or not a string/number.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: `{field}` must be a string or number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: `{field}` is {value} (a missing value), not an answer")
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # amc23 publishes 12 as 12.0; a boxed "12" must match it as text too
    text = str(value).strip()
    if not text:
        raise ValueError(f"{where}: `{field}` is empty")
    return text


def question_from_value(prompt: Any, where: str, field: str = "prompt") -> str:
    """The question text of a prompt value: a string, or chat messages (the last user turn,
    DAPO's wrapper removed). ValueError naming ``field`` if it is neither or empty."""
    if isinstance(prompt, str):
        question = prompt
    elif isinstance(prompt, (list, tuple)):
        question = _question_from_messages(prompt, where)
    else:
        raise ValueError(f"{where}: `{field}` must be a string or a list of chat messages, "
                         f"got {type(prompt).__name__}")
    if not question.strip():
        raise ValueError(f"{where}: `{field}` is empty")
    return question


def answer_from_value(value: Any, where: str, field: str) -> str:
    """``answer_to_str`` that also takes a list of answers (OlympiadBench's ``final_answer`` for
    multi-part questions), joined with ", " with each item's ``$...$`` removed (``["$2$", "$-2$"]``
    -> ``"2, -2"``, the form a boxed answer takes)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{where}: `{field}` is an empty list")
        value = ", ".join(answer_to_str(v, where, field).strip("$").strip() for v in value)
    return answer_to_str(value, where, field)


def _example_from_row(row: dict, where: str, default_id: str, prompt_field: str = "",
                      answer_field: str = "") -> Example:
    """Parse one row: named fields, else the plain or the DAPO-Math-17k layout (see ``load_examples``)."""
    if prompt_field:
        question = question_from_value(field_value(row, prompt_field, where, "prompt_field"), where, prompt_field)
    elif "prompt" not in row:
        raise ValueError(f"{where}: missing field `prompt` (fields present: {sorted(row)}; name another "
                         "question field with prompt_field)")
    else:
        question = question_from_value(row["prompt"], where)

    if answer_field:
        answer = answer_from_value(field_value(row, answer_field, where, "answer_field"), where, answer_field)
    elif "answer" in row:
        answer = answer_to_str(row["answer"], where, "answer")
    elif isinstance(row.get("reward_model"), dict) and "ground_truth" in row["reward_model"]:
        answer = answer_to_str(row["reward_model"]["ground_truth"], where, "reward_model.ground_truth")
    else:
        raise ValueError(f"{where}: no answer: expected `answer` or `reward_model.ground_truth` (or name the "
                         "answer field with answer_field)")

    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    row_id = row.get("id", extra.get("index", default_id))
    return Example(prompt=question, answer=answer, id=str(row_id))


def load_examples(path: str, dedupe: bool = False, prompt_field: str = "",
                  answer_field: str = "") -> list[Example]:
    """Load prompt/answer examples from a JSONL or parquet file or an HF dataset folder.

    Accepted row layouts (one object per JSONL line, parquet row or dataset row):

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
        example = _example_from_row(row, where, f"{stem}-{n}", prompt_field, answer_field)
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
