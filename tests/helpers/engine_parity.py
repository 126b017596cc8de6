"""Megatron against a rollout engine on a tiny Qwen3: O(1)-logit random weights, fixed sequences,
both sides' log-probs, the module-scoped vLLM engine fixtures and the TP=2 worker the engine tests
share.

Tolerance LOGPROB_ATOL = 1e-4 (absolute, per token): both sides are fp32 with different
kernels (vLLM's CPU attention / fused RMSNorm vs Megatron's local spec); measured differences
are ~1e-6 at O(1) logits, while one misplaced head or swapped gate/up moves log-probs by
O(0.1 - 1) (weights A vs B differ by ~1.5).
"""

import math

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from tests.helpers.dist_utils import one_rank_parallel

LOGPROB_ATOL = 1e-4
"""See the module docstring."""

VARIANT = "qwen3"
TEMPERATURE = 0.7
ENGINE_KW = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**26)


MISMATCH_PROMPTS = [[5, 17, 200, 3], [42] * 6, [1, 2, 3, 4, 5, 6, 7, 8, 9], [100, 101, 102]]
"""The prompts the engine/trainer mismatch tests sample (token ids of the tiny vocabulary)."""


def mismatch_minibatch(prompts, samples, group_size: int, seq: int, seed: int):
    """Sampled groups as one mini-batch of two micro-batches of ``seq``-token rows, advantages +-1
    alternating: what the mismatch tests run the pi_old pass and an update on."""
    from stapo_megatron.batch.microbatch import pack_sequences, split_microbatches
    from stapo_megatron.batch.records import make_records
    from stapo_megatron.batch.step_rollout import StepRollout

    adv_PG = torch.tensor([1.0, -1.0]).repeat(len(samples) * group_size // 2).view(len(samples), group_size)
    rollout = StepRollout.of_groups(0, list(enumerate(prompts)), lambda i: "", samples, group_size, version=0)
    batch = pack_sequences(make_records(rollout, adv_PG, updates_per_step=1), 0, seq)
    return [split_microbatches(batch, batch.num_rows // 2, seed=seed)]


def fixed_sequences(vocab_size: int, num: int = 3, length: int = 20, seed: int = 0) -> torch.Tensor:
    """Prompt+response token ids shared by both sides."""
    return torch.randint(0, vocab_size, (num, length), generator=torch.Generator().manual_seed(seed))


def randomize(model, seed: int) -> None:
    """O(1)-logit random weights (Megatron's init_method_std 0.02 would make every logit ~0):
    matrices N(0, 1/fan_in), norms 1 + N(0, 0.1^2). TP-sharded parameters draw per TP rank;
    replicated ones (norms) draw the same values on every rank, as a real model has them."""
    from megatron.core import parallel_state as ps

    shared = torch.Generator().manual_seed(seed)
    own = torch.Generator().manual_seed(seed + 1000 * (1 + ps.get_tensor_model_parallel_rank()))
    with torch.no_grad():
        for p in model.parameters():
            gen = own if getattr(p, "tensor_model_parallel", False) else shared
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))


def megatron_logprobs(model, tokens_BS: torch.Tensor, tp_group, temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[next token], ``[B, S-1]``, over the real (unpadded) vocabulary,
    from vocab-sharded logits through the trainer's op."""
    from stapo_megatron.conversion.verify import _megatron_forward
    from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy

    with torch.no_grad():
        logits_BSV = _megatron_forward(model, tokens_BS)
    v_local = logits_BSV.shape[-1]
    start = (torch.distributed.get_rank(tp_group) if tp_group is not None else 0) * v_local
    # Megatron's padding rows are not tokens; vLLM's softmax never sees them.
    padding_V = torch.arange(start, start + v_local) >= model.qwen_spec.vocab_size
    logits_BSV = logits_BSV.masked_fill(padding_V, torch.finfo(torch.float32).min)
    logp, _ = vocab_parallel_logprob_entropy(logits_BSV[:, :-1], tokens_BS[:, 1:], tp_group, temperature)
    return logp


def vllm_prompt_logprobs(engine, tokens_BS: torch.Tensor) -> torch.Tensor:
    """vLLM's (untempered) log-prob of every token of each sequence given its prefix, ``[B, S-1]``."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = engine.llm.generate([{"prompt_token_ids": row.tolist()} for row in tokens_BS], params, use_tqdm=False)
    return torch.tensor([[out.prompt_logprobs[t][int(row[t])].logprob for t in range(1, len(row))]
                         for out, row in zip(outs, tokens_BS)])


def engine_tokenizer(engine):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(engine.llm.llm_engine.model_config.tokenizer)


def recompute_samples(model, prompts, samples, tp_group, temperature):
    """Megatron log-probs of each sampled response (one sequence at a time)."""
    out = []
    for prompt, group in zip(prompts, samples):
        for s in group:
            seq = torch.tensor([list(prompt) + s.token_ids])
            out.append(megatron_logprobs(model, seq, tp_group, temperature)[0, len(prompt) - 1:])
    return out


def _tp2_worker(hf_dir: str, tokens_BS: torch.Tensor, prompts: list, vllm_tp: int) -> dict:
    """One of two ranks: Megatron TP=2 with weights B and an external-launcher engine: its own
    (vllm_tp=1) or one vLLM TP=2 engine spanning both ranks."""
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.vllm_engine import VLLMEngine
    from stapo_megatron.rollout.weight_sync import sync_weights

    groups = init_parallel(2, 1)
    model = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32)
    randomize(model, seed=7)
    model.eval()
    engine = VLLMEngine(hf_dir, RolloutConfig(tensor_parallel_size=vllm_tp, **ENGINE_KW))
    before = vllm_prompt_logprobs(engine, tokens_BS)
    stats = sync_weights(model, tiny_config(VARIANT), groups, engine)
    samples = engine.generate(prompts, n=2, temperature=TEMPERATURE, top_p=1.0, max_tokens=8, seed=11)
    after = vllm_prompt_logprobs(engine, tokens_BS)
    engine.shutdown()
    assert torch.distributed.is_initialized()  # the trainer's default group survives the engine
    return dict(
        before=before, after=after, stats=stats,
        megatron=megatron_logprobs(model, tokens_BS, groups.tp, 1.0),
        samples=[[(s.token_ids, s.logprobs) for s in g] for g in samples],
        recomputed=recompute_samples(model, prompts, samples, groups.tp, TEMPERATURE),
    )


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from stapo_megatron.data.tokenizer import build_char_tokenizer

    path = str(tmp_path_factory.mktemp("rollout") / "hf_a")
    save_tiny_hf_model(path, VARIANT, dtype=torch.float32, seed=0)
    # 100 character tokens for a 300-row model: ids past the tokenizer decode to nothing.
    build_char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tp1(hf_dir):
    """This process as a 1-rank Megatron job with one engine, synced to Megatron weights B."""
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.vllm_engine import VLLMEngine
    from stapo_megatron.rollout.weight_sync import sync_weights

    with one_rank_parallel() as groups:
        engine = VLLMEngine(hf_dir, RolloutConfig(**ENGINE_KW))
        model = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32)
        randomize(model, seed=3)
        model.eval()
        tokens_BS = fixed_sequences(300)
        before = vllm_prompt_logprobs(engine, tokens_BS)
        stats = sync_weights(model, tiny_config(VARIANT), groups, engine)
        yield dict(engine=engine, model=model, groups=groups, tokens=tokens_BS, before=before, stats=stats)
        engine.shutdown()


def hf_logprobs(engine, tokens_BS: torch.Tensor) -> torch.Tensor:
    """The engine model's untempered log-prob of every token given its prefix, ``[B, S-1]``."""
    with torch.no_grad():
        logits_BSV = engine.model(tokens_BS.to(engine.device)).logits.float().cpu()
    return torch.log_softmax(logits_BSV[:, :-1], -1).gather(-1, tokens_BS[:, 1:, None])[..., 0]
