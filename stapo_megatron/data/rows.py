"""The one row reader of prompt data: a file's rows as `Example`s, whatever the layout.

Training sets (``data.train_path``), held-out sets, benchmarks (``eval.sets``, ``stapo-eval``)
and ``scripts/prepare_data.py`` all read rows here:

- ``read_rows``: the rows of a JSONL file, a parquet file or an HF dataset folder;
- ``example_from_row``: one row as an `Example`. The question is a named field
  (``prompt_field``), else the first of `QUESTION_FIELDS` (a string, or chat messages whose last
  user turn counts, DAPO-Math-17k's "Answer:" wrapper removed); the answer a named field
  (``answer_field``), else the first of `ANSWER_FIELDS` (a string, a number, or a list of them
  as OlympiadBench's ``final_answer``; a ``solution`` found there is a worked solution whose
  last ``\\boxed{}`` is the answer, as in MATH; a named field is taken as it stands); the id
  the first of `ID_FIELDS`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterator, Sequence

# DAPO-Math-17k wraps every problem in an "Answer: $Answer" instruction. It contradicts the boxed
# SUFFIX above, so the wrapper is removed and only the problem text is kept.
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_POSTFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


QUESTION_FIELDS = ("prompt", "problem", "question")
"""Where a row's question is looked for when ``prompt_field`` does not name it, in this order."""
ANSWER_FIELDS = ("answer", "reward_model.ground_truth", "final_answer", "solution")
"""Where a row's answer is looked for when ``answer_field`` does not name it, in this order."""
ID_FIELDS = ("id", "extra_info.index", "unique_id", "idx")
"""Where a row's id is looked for; without one it is ``<file stem>-<row number>``."""

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


def _present(row: dict, field: str) -> bool:
    """Whether the (possibly dotted) ``field`` exists in ``row``."""
    value: Any = row
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return True


def _answer(row: dict, where: str, field: str, named: bool) -> str:
    value = field_value(row, field, where, "answer_field")
    if field == "solution" and not named:  # a worked solution (MATH): its last box is the answer
        from stapo_megatron.rewards.answers import extract_boxed

        boxed = extract_boxed(str(value))
        if boxed is None:
            raise ValueError(f"{where}: `{field}` has no \\boxed{{}} final answer")
        return boxed
    return answer_from_value(value, where, field)


def example_from_row(row: dict, where: str, default_id: str, prompt_field: str = "",
                     answer_field: str = "") -> Example:
    """One row as an `Example` (the module docstring says where each part is looked for).

    Raises:
        ValueError: naming ``where``, when the question or the answer is missing or malformed
            (with the fields the row has), or a named field is absent.
    """
    question_field = prompt_field or next((f for f in QUESTION_FIELDS if f in row), "")
    if not question_field:
        raise ValueError(f"{where}: no question: expected one of {', '.join(QUESTION_FIELDS)} (or name its field "
                         f"with prompt_field); fields present: {sorted(row)}")
    value = field_value(row, question_field, where, "prompt_field")
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"{where}: no question: `{question_field}` is empty")
    question = question_from_value(value, where, question_field)
    named = bool(answer_field)  # a named field is the answer as it stands
    answer_field = answer_field or next((f for f in ANSWER_FIELDS if _present(row, f)), "")
    if not answer_field:
        raise ValueError(f"{where}: no answer: expected one of {', '.join(ANSWER_FIELDS)} (or name its field "
                         f"with answer_field); fields present: {sorted(row)}")
    id_field = next((f for f in ID_FIELDS if _present(row, f)), "")
    row_id = field_value(row, id_field, where, "id") if id_field else default_id
    return Example(prompt=question, answer=_answer(row, where, answer_field, named), id=str(row_id))
