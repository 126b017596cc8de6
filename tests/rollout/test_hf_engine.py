"""The transformers rollout engine (no vLLM) against Megatron, fp32 on the CPU.

As tests/rollout/test_vllm_engine.py does for vLLM: a tiny Qwen3 HF folder (random weights A, the
character tokenizer) loads into `HFEngine`; a Megatron GPTModel with different random weights
B is synced into it through `sync_weights`; then the engine's log-probs of fixed sequences and
of its own samples must equal Megatron's.

Tolerance LOGPROB_ATOL = 1e-4 (absolute, per token), as for vLLM: both sides are fp32 with
different kernels (HF's SDPA attention and RMSNorm vs Megatron's local spec); one misplaced head
or swapped gate/up moves log-probs by O(0.1 - 1).
"""

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from tests.helpers.dist_utils import one_rank_parallel
from tests.helpers.engine_parity import fixed_sequences, hf_logprobs, megatron_logprobs, randomize, recompute_samples

LOGPROB_ATOL = 1e-4
"""See the module docstring."""

VARIANT = "qwen3"
TEMPERATURE = 0.7
PROMPTS = [[5, 17, 200, 3], [42] * 6, [1, 2, 3, 4, 5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    """This process as a 1-rank Megatron job with an HF engine, synced to Megatron weights B."""
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.hf_engine import HFEngine
    from stapo_megatron.rollout.weight_sync import sync_weights
    from stapo_megatron.data.tokenizer import build_char_tokenizer

    hf_dir = str(tmp_path_factory.mktemp("hf_engine") / "hf_a")
    save_tiny_hf_model(hf_dir, VARIANT, dtype=torch.float32, seed=0)
    build_char_tokenizer(hf_dir)
    with one_rank_parallel() as groups:
        engine = HFEngine(hf_dir, RolloutConfig(dtype="float32", seed=0))
        model = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32)
        randomize(model, seed=3)
        model.eval()
        tokens_BS = fixed_sequences(300)
        before = hf_logprobs(engine, tokens_BS)
        stats = sync_weights(model, tiny_config(VARIANT), groups, engine)
        yield dict(engine=engine, model=model, groups=groups, tokens=tokens_BS, before=before, stats=stats)
        engine.shutdown()


def test_logprobs_equal_megatron_after_sync(synced):
    megatron = megatron_logprobs(synced["model"], synced["tokens"], synced["groups"].tp, 1.0)
    after = hf_logprobs(synced["engine"], synced["tokens"])
    assert (synced["before"] - megatron).abs().max() > 0.1  # weights A really differ from B
    assert (after - megatron).abs().max().item() <= LOGPROB_ATOL
    assert synced["stats"]["bytes"] > 0


def test_samples_carry_the_tempered_logprobs_and_are_reproducible(synced):
    engine, model, tp = synced["engine"], synced["model"], synced["groups"].tp
    samples = engine.generate(PROMPTS, n=4, temperature=TEMPERATURE, top_p=1.0, max_tokens=10, seed=5)
    assert [len(g) for g in samples] == [4, 4, 4]
    for g in samples:
        assert len({tuple(s.token_ids) for s in g}) > 1  # n independent draws, not copies
        for s in g:
            assert 1 <= len(s.token_ids) == len(s.logprobs) <= 10 and s.finish_reason in ("length", "stop")
            assert s.finish_reason == "length" or s.token_ids[-1] in engine.eos_ids
            assert s.text == engine.tokenizer.decode(s.token_ids, skip_special_tokens=True)
    got = [torch.tensor(s.logprobs) for g in samples for s in g]
    recomputed = recompute_samples(model, PROMPTS, samples, tp, TEMPERATURE)
    assert max((a - b).abs().max().item() for a, b in zip(got, recomputed)) <= LOGPROB_ATOL
    untempered = recompute_samples(model, PROMPTS, samples, tp, 1.0)
    assert max((a - b).abs().max().item() for a, b in zip(got, untempered)) > 0.05
    tokens = lambda out: [[s.token_ids for s in g] for g in out]  # noqa: E731
    again = engine.generate(PROMPTS, n=4, temperature=TEMPERATURE, top_p=1.0, max_tokens=10, seed=5)
    assert tokens(again) == tokens(samples)
    # prompt i's j-th sample is seeded seed + i * n + j: the same alone as in a batch
    alone = engine.generate(PROMPTS[2:], n=4, temperature=TEMPERATURE, top_p=1.0, max_tokens=10, seed=5 + 2 * 4)
    assert tokens(alone) == tokens(samples)[2:]
    assert tokens(engine.generate(PROMPTS, n=4, temperature=TEMPERATURE, top_p=1.0, max_tokens=10, seed=6)) != tokens(samples)


def test_top_p_logprobs_are_the_renormalised_nucleus(synced):
    engine, model, tp = synced["engine"], synced["model"], synced["groups"].tp
    top_p = 0.8
    samples = engine.generate(PROMPTS, n=3, temperature=1.0, top_p=top_p, max_tokens=6, seed=1)
    for prompt, group in zip(PROMPTS, samples):
        for s in group:
            seq = torch.tensor([list(prompt) + s.token_ids])
            full = megatron_logprobs_all(model, seq, tp)[0, len(prompt) - 1 :]  # [T, V]
            for t, (token, lp) in enumerate(zip(s.token_ids, s.logprobs)):
                probs = full[t].exp()
                sorted_p, order = probs.sort(descending=True)
                keep = (sorted_p.cumsum(0) - sorted_p) < top_p
                assert token in order[keep].tolist(), "sampled outside the nucleus"
                expected = full[t, token] - sorted_p[keep].sum().log()
                assert abs(lp - expected.item()) <= LOGPROB_ATOL


def megatron_logprobs_all(model, tokens_BS, tp_group) -> torch.Tensor:
    """Megatron's full log-softmax ``[B, S, V]`` over the real vocabulary (TP=1)."""
    from stapo_megatron.conversion.verify import _megatron_forward

    with torch.no_grad():
        logits_BSV = _megatron_forward(model, tokens_BS)[..., : model.qwen_spec.vocab_size]
    return torch.log_softmax(logits_BSV.float(), -1)


def test_greedy_is_argmax_with_untempered_logprobs(synced):
    engine, model, tp = synced["engine"], synced["model"], synced["groups"].tp
    samples = engine.generate(PROMPTS, n=2, temperature=0.0, top_p=1.0, max_tokens=6)
    for prompt, (a, b) in zip(PROMPTS, samples):
        assert a.token_ids == b.token_ids
        full = megatron_logprobs_all(model, torch.tensor([list(prompt) + a.token_ids]), tp)[0, len(prompt) - 1 :]
        assert a.token_ids == full[: len(a.token_ids)].argmax(-1).tolist()
        expected = full[torch.arange(len(a.token_ids)), a.token_ids]
        assert (torch.tensor(a.logprobs) - expected).abs().max().item() <= LOGPROB_ATOL


def test_update_weights_rejects_unknown_and_incomplete_streams(synced):
    engine = synced["engine"]
    params = dict(engine.model.named_parameters())
    name = "model.norm.weight"
    with pytest.raises(ValueError, match="no parameter 'nope'"):
        engine.update_weights([("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="HF shape"):
        engine.update_weights([(name, torch.zeros(3))])
    with pytest.raises(ValueError, match="did not provide"):
        engine.update_weights([(name, params[name].detach().clone())])
