"""Tier b: `iter_hf_weights` at TP=2 x PP=2 equals the converter's export, tensor for tensor: the
multi-process and end-to-end tests (the single-process ones are in
``tests/rollout/test_weight_sync.py``)."""

import json
import os
import pytest
import torch
from stapo_megatron.conversion.mcore_to_hf import convert_mcore_to_hf
from stapo_megatron.conversion.safetensors_io import index_checkpoint, read_rows
from stapo_megatron.bridge import hf_shapes, spec_from_hf_config
from stapo_megatron.bridge.tiny import tiny_config
from tests.helpers.dist_utils import run_distributed


VARIANTS = ("qwen3", "qwen2.5")


def _stream_worker(save_root: str) -> dict:
    """Every variant on this rank: Megatron save, then the streamed HF tensors."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.rollout.weight_sync import iter_hf_weights
    from tests.helpers.engine_parity import randomize

    groups = init_parallel(2, 2)
    out = {}
    for variant in VARIANTS:
        model = build_gpt_model(tiny_config(variant), params_dtype=torch.float32)
        randomize(model, seed=11)
        path = os.path.join(save_root, variant)
        if dist.get_rank() == 0:
            os.makedirs(path)
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), path)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        out[variant] = [(name, t.clone()) for name, t in iter_hf_weights(ddp, tiny_config(variant), groups)]
    return out


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    root = tmp_path_factory.mktemp("sync")
    return root, run_distributed(4, _stream_worker, str(root / "saved"))


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_iter_hf_weights_equals_converter_export(streamed, variant):
    root, per_rank = streamed
    side = root / f"{variant}-config"
    side.mkdir()
    (side / "config.json").write_text(json.dumps(tiny_config(variant)))
    out = str(root / f"{variant}-hf")
    convert_mcore_to_hf(str(root / "saved" / variant), out, hf_config_dir=str(side))
    exported = {name: read_rows(info) for name, info in index_checkpoint(out).items()}
    expected_names = set(hf_shapes(spec_from_hf_config(tiny_config(variant))))
    assert set(exported) == expected_names
    for rank, result in enumerate(per_rank):
        pairs = result[variant]
        names = [n for n, _ in pairs]
        assert len(names) == len(set(names)) and set(names) == expected_names, f"rank {rank}"
        # HF checkpoint order, layer-major: embedding first, then layer 0 complete, ...
        assert names[0] == "model.embed_tokens.weight" and names[1].startswith("model.layers.0.")
        for name, tensor in pairs:
            assert torch.equal(tensor, exported[name]), f"rank {rank}: {name}"
