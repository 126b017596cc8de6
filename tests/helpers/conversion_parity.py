"""What the conversion tests share: a bit-exact comparison of two HF folders, the tiny fp32
models of each Qwen variant converted to Megatron checkpoints (a module fixture), and one group of
4 gloo processes that loads them at (TP, PP) = (1,1), (2,1), (1,2), (2,2) (spare ranks are
data-parallel replicas taking a share of the prompts, so the tier costs one spawn)."""

import os

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from stapo_megatron.conversion.cli import main
from stapo_megatron.conversion.safetensors_io import index_checkpoint, read_rows
from stapo_megatron.conversion.verify import fixed_prompts
from tests.helpers.dist_utils import run_distributed


def _tensors(hf_dir):
    return {name: read_rows(info) for name, info in index_checkpoint(hf_dir).items()}


def _assert_bit_exact(a_dir, b_dir):
    a, b = _tensors(a_dir), _tensors(b_dir)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        # Compare bit patterns, not values (NaN-safe and sign-of-zero exact).
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]

VARIANTS = ["qwen2", "qwen2.5", "qwen3", "qwen3-tied"]

SAVED_BY_MEGATRON = ("qwen3", "qwen2.5")  # untied and tied: re-saved by Megatron at TP=2 PP=2


def _parity_worker(jobs, tokens_BS, save_root):
    """Every layout x every variant on this rank; returns logits shares and a few facts."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    from stapo_megatron.conversion.verify import _megatron_forward
    from stapo_megatron.bridge import build_gpt_model, load_checkpoint
    from stapo_megatron.mcore.parallel import init_parallel

    out = {"logits": {}, "keys": {}, "inv_freq": {}, "plain_load_equal": {}}
    for tp, pp in LAYOUTS:
        init_parallel(tp, pp)
        for variant, ckpt in jobs:
            model = build_gpt_model(tiny_config(variant), params_dtype=torch.float32, parallel_output=False)
            load_checkpoint(model, ckpt)
            model.eval()
            dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            ids = list(range(dp_rank, tokens_BS.shape[0], dp))
            with torch.no_grad():
                logits = _megatron_forward(model, tokens_BS[ids])
            if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
                out["logits"][(variant, tp, pp)] = (ids, logits[..., : model.qwen_spec.vocab_size])
            if (tp, pp) == (2, 1):
                # Megatron's own loader (no bridge helper, strict) reads the same weights.
                plain = build_gpt_model(tiny_config(variant), params_dtype=torch.float32)
                plain.load_state_dict(dist_checkpointing.load(plain.sharded_state_dict(), ckpt), strict=True)
                out["plain_load_equal"][(variant, dist.get_rank())] = all(
                    torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
            if (tp, pp) == (1, 1) and dist.get_rank() == 0:
                sharded = model.sharded_state_dict()
                apply_factories(sharded)  # linear_fc1's SwiGLU factory -> its ShardedTensors
                out["keys"][variant] = {
                    v.key: tuple(v.global_shape) for v in nested_values(sharded) if isinstance(v, ShardedTensor)
                }
                out["inv_freq"][variant] = model.rotary_pos_emb.inv_freq.clone()
            if (tp, pp) == (2, 2) and variant in SAVED_BY_MEGATRON:
                # What a trainer does: Megatron's own sharded save of the model (4 ranks).
                path = os.path.join(save_root, variant, "iter_0000003")
                if dist.get_rank() == 0:
                    os.makedirs(path)
                dist.barrier()
                dist_checkpointing.save(model.sharded_state_dict(), path)
            del model
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """fp32 tiny HF models of each variant and their converted checkpoints."""
    root = tmp_path_factory.mktemp("parity")
    jobs = []
    for variant in VARIANTS:
        hf, ckpt = str(root / variant / "hf"), str(root / variant / "ckpt")
        save_tiny_hf_model(hf, variant, dtype=torch.float32)
        assert main(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt]) == 0
        jobs.append((variant, hf, ckpt))
    return root, jobs


@pytest.fixture(scope="module")
def megatron_run(converted):
    root, jobs = converted
    tokens_BS = fixed_prompts(300, num_prompts=4, seq_len=24)
    results = run_distributed(4, _parity_worker, [(v, c) for v, _, c in jobs], tokens_BS, str(root / "saved"))
    merged = {"logits": {}, "keys": {}, "inv_freq": {}, "plain_load_equal": {}}
    for r in results:
        merged["plain_load_equal"].update(r["plain_load_equal"])
        merged["keys"].update(r["keys"])
        merged["inv_freq"].update(r["inv_freq"])
        for key, (ids, logits) in r["logits"].items():
            merged["logits"].setdefault(key, {}).update(zip(ids, logits))
    return tokens_BS, merged
