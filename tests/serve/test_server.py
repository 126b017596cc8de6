"""`stapo_megatron.serve.server.serve` with the real HF engine on a tiny model and the
real transport groups, three ranks as threads of this process (trainer 0, trainer 1, one engine):
an engine holding both asking replicas' slices of a request generates them in one engine call
(one tail for the request), each slice with the samples it has when generated alone."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from stapo_megatron.bridge.tiny import save_tiny_hf_model
from stapo_megatron.data.tokenizer import build_char_tokenizer
from stapo_megatron.recipes.tiny import tiny_demo
from stapo_megatron.rollout.rollout_modes import SeparatePlacement
from stapo_megatron.rollout.config import RolloutConfig, RolloutSampling, SamplingSettings
from stapo_megatron.rollout.hf_engine import HFEngine
from stapo_megatron.rollout.remote import HEADER, RemoteEngine, plan_chunks
from stapo_megatron.rollout.transport import broadcast_object, connect, receive
from stapo_megatron.serve import server
from tests.helpers.dist_utils import rank_threads

PROMPTS = {0: [[5, 17, 20, 3], [42] * 6, [1, 2, 3]], 1: [[9, 8, 7, 6, 5], [11, 12]]}
"""Each trainer rank's prompts (rank 1's first prompt longer than any of rank 0's: padding differs
between the merged batch and the slices alone)."""
SEEDS = {0: 1000, 1: 5000}
N, MAX_TOKENS = 2, 6


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("server") / "tiny")
    save_tiny_hf_model(path, "qwen3", dtype=torch.float32, seed=0)
    build_char_tokenizer(path)
    return path


def _config(hf_dir: str):
    cfg, _ = tiny_demo(run_dir="unused")
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, hf_dir=hf_dir),
        rollout=dataclasses.replace(cfg.rollout, engine="hf", mode="separate", separate=SeparatePlacement(1, 0),
                                    group_size=N, max_response_len=MAX_TOKENS))


def _serve_one_request(hf_dir, monkeypatch):
    """Trainer 0 sends one generate request holding both ranks' slices (as `RemoteEngine.submit`
    builds it), then stop; returns each trainer's reply and the engine's generate calls."""
    cfg = _config(hf_dir)
    weights = HFEngine(hf_dir, RolloutConfig(dtype="float32")).model.state_dict()
    calls = []
    build = server.build_engine

    def build_counting(*args, **kwargs):
        engine = build(*args, **kwargs)
        generate = engine.generate

        def counted(prompts, *a, **k):
            calls.append(len(prompts))
            return generate(prompts, *a, **k)

        engine.generate = counted
        return engine

    monkeypatch.setattr(server, "build_engine", build_counting)
    store = dist.HashStore()
    plan = plan_chunks([len(PROMPTS[0]), len(PROMPTS[1])], 1)
    jobs = [(c, PROMPTS[c.dest][c.start:c.end], SamplingSettings(N, 1.0, 1.0, MAX_TOKENS, SEEDS[c.dest]).skip(c.start))
            for c in plan]

    def rank_main(rank):
        transport = connect(store, rank, 3, 1, 1, samples_timeout_s=120)
        if rank == 2:
            return server.serve(cfg.rollout, cfg.model, cfg.longest_sequence(), transport, seed=0, return_routes=False)
        if rank == 0:  # the folder's weights first (the engine starts from dummy ones), then the request
            RemoteEngine(transport, asks=True, timeout_s=120, bucket_mb=1).update_weights(iter(weights.items()))
            broadcast_object(transport.control, ("generate", 0, jobs, None))
        reply = receive(transport.data, 2, len(HEADER), 120)
        if rank == 0:
            broadcast_object(transport.control, ("stop",))
        return reply

    replies = rank_threads(rank_main, 3, timeout=300)
    return replies, calls


def test_both_replicas_slices_are_one_engine_call_with_each_slices_own_samples(hf_dir, monkeypatch):
    replies, calls = _serve_one_request(hf_dir, monkeypatch)
    assert replies[2] == 1  # one request served
    assert calls == [len(PROMPTS[0]) + len(PROMPTS[1])]  # one call for both slices: one tail
    cfg = _config(hf_dir)
    alone = HFEngine(hf_dir, server.engine_config(cfg.rollout, 0, False, cfg.longest_sequence(), cfg.model.bf16))
    alone.update_weights(iter(HFEngine(hf_dir, RolloutConfig(dtype="float32")).model.state_dict().items()))
    tokens = {}
    for rank in (0, 1):
        header, samples = replies[rank]
        got = dict(zip(HEADER, header))
        assert (got["ticket"], got["chunk"]) == (0, 0) and got["generate_us"] > 0
        expected = alone.generate(PROMPTS[rank], N, 1.0, 1.0, MAX_TOKENS, seed=SEEDS[rank])
        # the same seeds give the same tokens; log-probs agree up to the float rounding of a
        # differently padded batch (fp32, the tiny model: rounding of 1e-6 relative)
        assert [[s.token_ids for s in g] for g in samples] == [[s.token_ids for s in g] for g in expected]
        for group, ref in zip(samples, expected):
            for s, r in zip(group, ref):
                assert s.logprobs == pytest.approx(r.logprobs, rel=1e-5, abs=1e-5)
        tokens[rank] = sum(len(s.token_ids) for g in samples for s in g)
    assert len(set(tokens.values()) | {0}) > 1  # both replies carry samples


def test_the_engine_reserves_the_runs_lora_rank():
    """`engine_config` carries the run's ``lora.rank`` into `RolloutConfig.max_lora_rank`, which the
    adapter-serving engine rounds up to vLLM's next accepted ``max_lora_rank``; a full run has none,
    and that engine refuses to start without it."""
    from stapo_megatron.rollout.vllm_lora import VLLMLoraEngine, vllm_max_lora_rank

    rollout = RolloutSampling()
    assert server.engine_config(rollout, 0, False, 256, True).max_lora_rank is None
    config = server.engine_config(rollout, 0, False, 256, True, lora_rank=96)
    assert config.max_lora_rank == 96
    assert vllm_max_lora_rank(config.max_lora_rank) == 128  # 64 < 96 <= 128 (VLLM_LORA_RANKS)
    assert [vllm_max_lora_rank(r) for r in (1, 4, 16, 17, 512)] == [1, 8, 16, 32, 512]
    with pytest.raises(ValueError, match=r"lora.rank 513 is above vLLM's largest max_lora_rank 512"):
        vllm_max_lora_rank(513)
    with pytest.raises(ValueError, match=r"RolloutConfig.max_lora_rank is None: the trainer sets it from lora.rank"):
        VLLMLoraEngine("unused", server.engine_config(rollout, 0, False, 256, True))
    with pytest.raises(ValueError, match=r"RolloutConfig.max_lora_rank must be >= 1 \(the run's lora.rank\), got 0"):
        RolloutConfig(max_lora_rank=0)
