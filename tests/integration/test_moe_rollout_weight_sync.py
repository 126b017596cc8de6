"""The streamed weight sync of a Qwen3-MoE policy at EP=2 (tier b), and the routing disagreement: the
multi-process and end-to-end tests (the single-process ones are in
``tests/rollout/test_moe_weight_sync.py``)."""

import json
import pytest
import torch
from stapo_megatron.bridge import hf_shapes, spec_from_hf_config
from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from stapo_megatron.conversion.mcore_to_hf import convert_mcore_to_hf
from stapo_megatron.conversion.safetensors_io import index_checkpoint, read_rows
from tests.helpers.dist_utils import run_distributed
from tests.helpers.moe_sync_workers import LOGPROB_ATOL, VARIANT, _ep2_worker, _tp2_worker  # noqa: F401


@pytest.mark.slow
def test_ep2_sync_and_routing_agreement(tmp_path):
    hf_dir = str(tmp_path / "hf_a")
    save_tiny_hf_model(hf_dir, VARIANT, dtype=torch.float32, seed=0)
    tokens_BS = torch.randint(0, 300, (3, 20), generator=torch.Generator().manual_seed(0))
    (tmp_path / "saved").mkdir()
    results = run_distributed(2, _ep2_worker, hf_dir, tokens_BS, str(tmp_path / "saved"))
    routed = sum(r["routed_tokens"] for r in results)
    # the stream equals the converter's export of the same weights (EP=2 dist checkpoint), bit for bit
    side = tmp_path / "config"
    side.mkdir()
    (side / "config.json").write_text(json.dumps(tiny_config(VARIANT)))
    convert_mcore_to_hf(str(tmp_path / "saved"), str(tmp_path / "exported"), hf_config_dir=str(side))
    exported = {name: read_rows(info) for name, info in index_checkpoint(str(tmp_path / "exported")).items()}
    assert set(exported) == set(hf_shapes(spec_from_hf_config(tiny_config(VARIANT))))
    for rank, r in enumerate(results):
        assert set(r["streamed"]) == set(exported), rank
        for name, tensor in r["streamed"].items():
            assert torch.equal(tensor, exported[name]), f"rank {rank}: {name}"
    for rank, r in enumerate(results):
        assert r["local_experts"] == ["0", "1"]  # 2 of the 4 experts live on each rank
        assert (r["before"] - r["megatron"]).abs().max() > 0.1, rank  # weights A really differ from B
        assert (r["after"] - r["megatron"]).abs().max().item() <= LOGPROB_ATOL, rank
        assert r["stats"]["bytes"] > 0
        differ_L, missed_L, tokens_L = r["counts"]
        assert tokens_L.tolist() == [routed] * 4  # every forwarded token of both ranks, each of 4 layers
        assert differ_L.sum() == 0 and missed_L.sum() == 0, rank


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2-sp", "pp2"])
def test_routing_counts_under_tp_and_pp(tmp_path, layout):
    """Every (token, layer) is counted exactly once over the model-parallel ranks (TP ranks
    holding halves of each sequence under sequence parallelism; PP stages holding 2 layers
    each), and the synced engine routes as Megatron does."""
    hf_dir = str(tmp_path / "hf")
    save_tiny_hf_model(hf_dir, VARIANT, dtype=torch.float32, seed=0)
    tokens_BS = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    results = run_distributed(2, _tp2_worker, hf_dir, tokens_BS, layout)
    # both ranks synced the same full weights and sampled the same tokens
    assert torch.equal(results[0]["logprobs"], results[1]["logprobs"])
    for r in results:
        if r["megatron"] is not None:  # TP=2: the gathered expert-TP shards are the right weights
            assert (r["logprobs"] - r["megatron"]).abs().max().item() <= LOGPROB_ATOL
        differ_L, missed_L, tokens_L = r["counts"]
        assert tokens_L.tolist() == [r["routed_tokens"]] * 4
        assert differ_L.sum() == 0 and missed_L.sum() == 0
