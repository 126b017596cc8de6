"""Tier a: what every rollout engine shares: the arguments of ``generate`` no engine can sample
with (refused, naming them), and whether an HF folder carries a tokenizer."""

import pytest

from stapo_megatron.rollout.base import TOKENIZER_FILES, Sample, check_generate_args, has_tokenizer


@pytest.mark.parametrize("args, message", [
    (dict(n=0), r"^n \(0\) and max_tokens \(8\) must be >= 1$"),
    (dict(max_tokens=0), r"^n \(2\) and max_tokens \(0\) must be >= 1$"),
    (dict(temperature=-0.5), r"^need temperature >= 0 and 0 < top_p <= 1, got -0.5, 1.0$"),
    (dict(top_p=0.0), r"^need temperature >= 0 and 0 < top_p <= 1, got 1.0, 0.0$"),
    (dict(top_p=1.5), r"^need temperature >= 0 and 0 < top_p <= 1, got 1.0, 1.5$"),
    (dict(prompt_token_ids=[[1, 2], []]), r"^prompt 1 is empty$"),
])
def test_arguments_no_engine_can_sample_with_are_named(args, message):
    kwargs = dict(prompt_token_ids=[[1, 2], [3]], n=2, temperature=1.0, top_p=1.0, max_tokens=8) | args
    with pytest.raises(ValueError, match=message):
        check_generate_args(**kwargs)


def test_greedy_and_full_nucleus_are_valid():
    check_generate_args([[5]], n=1, temperature=0.0, top_p=1.0, max_tokens=1)


def test_a_folder_carries_a_tokenizer_if_it_has_any_tokenizer_file(tmp_path):
    assert not has_tokenizer(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert not has_tokenizer(str(tmp_path))
    for name in TOKENIZER_FILES:
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_text("{}")
        assert has_tokenizer(str(folder)), name


def test_a_sample_is_unrouted_and_of_one_policy_by_default():
    sample = Sample(token_ids=[4, 2], logprobs=[-0.1, -0.7], text="", finish_reason="length")
    assert sample.routed_experts is None and sample.versions is None
