"""Tier a: the held-out prompts file is read with its own field mapping."""

import pytest


def test_held_out_file_has_its_own_field_mapping(tmp_path):
    """DAPO-Math-17k-style training rows next to a benchmark file with `problem` / `solution`."""
    import dataclasses as dc
    import json as js

    from stapo_megatron.data.config import DataConfig
    from stapo_megatron.data.tokenizer import build_char_tokenizer
    from stapo_megatron.trainer.prompts import load_prompts

    train, held_out = tmp_path / "train.jsonl", tmp_path / "aime.jsonl"
    train.write_text("".join(js.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(3)))
    held_out.write_text("".join(js.dumps({"problem": f"{i}*2", "solution": str(2 * i)}) + "\n" for i in range(2)))
    tokenizer = build_char_tokenizer(str(tmp_path / "tok"))
    data = DataConfig(train_path=str(train), eval_path=str(held_out), use_chat_template=False)
    with pytest.raises(ValueError, match="aime.jsonl:1"):
        load_prompts(data, tokenizer, 0, eval_sets=False)  # the training file's mapping: no `prompt`
    data = dc.replace(data, eval_prompt_field="problem", eval_answer_field="solution")
    (_, train_kept), (_, held_kept) = load_prompts(data, tokenizer, 0, eval_sets=False)
    assert [e.answer for e in train_kept] == ["1", "2", "3"]
    assert [(e.prompt, e.answer) for e in held_kept] == [("0*2", "0"), ("1*2", "2")]
