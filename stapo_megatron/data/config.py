"""`DataConfig`: the prompts of training and of the held-out set."""

from __future__ import annotations

import dataclasses
from typing import Optional

from stapo_megatron.data.examples import DEFAULT_PROMPT_TEMPLATE
from stapo_megatron.utils import check_at_least

@dataclasses.dataclass
class DataConfig:
    """Prompts for training and the held-out set."""

    train_path: Optional[str] = None
    """JSONL/parquet file or HF dataset folder (``save_to_disk``) with `prompt` and `answer` (or
    DAPO-Math-17k's layout, or the fields below); None = generate."""
    eval_path: Optional[str] = None
    """Held-out JSONL/parquet file or HF dataset folder; None = generate."""
    prompt_field: str = ""
    """Field of the question in the training file ("" = `prompt`, as a string or chat messages);
    a dotted name reads a nested field. Also the held-out file's unless `eval_prompt_field`."""
    answer_field: str = ""
    """Field of the reference answer in the training file ("" = `answer`, else
    `reward_model.ground_truth`); a dotted name reads a nested field. Also the held-out file's
    unless `eval_answer_field`."""
    eval_prompt_field: Optional[str] = None
    """Field of the question in the held-out file (e.g. `problem` for a benchmark next to
    DAPO-Math-17k's `prompt`); None = `prompt_field`, "" = `prompt`."""
    eval_answer_field: Optional[str] = None
    """Field of the reference answer in the held-out file; None = `answer_field`, "" = `answer`,
    else `reward_model.ground_truth`."""
    dedupe: bool = False
    """Keep one copy of repeated training problems (the published DAPO-Math-17k parquet repeats
    each problem about 100 times)."""
    reasoning_gym_task: str = "basic_arithmetic"
    """reasoning-gym task used when no paths are given (offline generator)."""
    reasoning_gym_kwargs: dict = dataclasses.field(default_factory=dict)
    """Extra arguments of the reasoning-gym task."""
    num_train: int = 2000
    """Generated training prompts."""
    num_eval: int = 100
    """Generated held-out prompts."""
    max_prompt_len: int = 1024
    """Longer prompts are dropped (counted, warned)."""
    use_chat_template: bool = True
    """Wrap questions in the tokenizer's chat template (plus the paper's suffix)."""
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    """The user turn made from a question: ``{question}`` is replaced by it (plain replacement,
    so other braces such as the suffix's ``\\boxed{}`` stay). The paper recipes use JustRL's
    wrapper, `stapo_megatron.data.examples.JUSTRL_PROMPT_TEMPLATE` (question, newline, suffix)."""
    seed: Optional[int] = None
    """Seeds the generated train / held-out split; None = ``TrainerConfig.seed``. Fixed in the
    demo so that runs of every seed share the held-out problems and one warm-start."""

    def __post_init__(self):
        check_at_least(self, 0, "num_train", "num_eval")
        check_at_least(self, 1, "max_prompt_len")
        if "{question}" not in self.prompt_template:
            raise ValueError(f"DataConfig.prompt_template must contain {{question}}, got {self.prompt_template!r}")

    def training_fields(self) -> dict:
        """The training file's field mapping (`examples.load_examples` arguments)."""
        return dict(prompt_field=self.prompt_field, answer_field=self.answer_field)

    def held_out_fields(self) -> dict:
        """The held-out file's field mapping: its own (``eval_prompt_field`` /
        ``eval_answer_field``) where set, else the training file's."""
        return dict(prompt_field=self.prompt_field if self.eval_prompt_field is None else self.eval_prompt_field,
                    answer_field=self.answer_field if self.eval_answer_field is None else self.eval_answer_field)
