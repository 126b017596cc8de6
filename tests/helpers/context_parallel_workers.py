"""Context parallelism's gloo workers and their shared data: 16 uneven rollouts, the CP attention
worker, the training worker (CP=1 and CP=2 in the same processes; the tiny GPT or, for
``tests/integration/test_delta_net_context_parallel.py``, the bridge's tiny Qwen3.5), the checkpoint worker (CP=2
to CP=1 and back), the evaluation worker, and `_check_same`, which compares a CP layout's updates
with CP=1's. Used by ``tests/batch/test_context_parallel.py`` (the rollouts) and by the
multi-process tests in ``tests/integration/``.

Tolerances (fp32, CPU): the CP attention equals plain causal attention per sequence to 1e-5
absolute at O(1) outputs (`ATTN_ATOL`): the same softmax over the same keys, computed in another
grouping (queries by chunk, keys gathered), measured ~1e-7. Training (`_check_same`): counts
exact; losses, tau_H and metrics 2e-5 relative; weights 1e-6 absolute on O(0.1) weights after
lr = 0.5 SGD steps -- the gradients are the same per-token terms summed over other ranks and in
another order (the invariance test's tolerances; measured ~1e-7). The same tolerances hold for
GRPO with the seq_mask correction at CP=2: per-sequence counts are summed exactly (integers) and
the log-ratio sums differ by rounding (~1e-7) from flags 1.4e-4 away.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from stapo_megatron.batch.context_parallel import local_positions
from stapo_megatron.batch.minibatches import MicroBatchLayout, build_minibatches
from stapo_megatron.batch.records import records_from_lists

ATTN_ATOL = 1e-5
"""CP attention vs plain causal attention (values and q/k/v gradients): see the module docstring."""
VOCAB, NUM_PROMPTS, GROUP = 512, 4, 4
COUNTS = ("num_kept", "num_response_tokens", "silenced_count", "candidate_count")
VALUES = ("loss", "tau_h", "entropy_mean", "approx_kl", "grad_norm", "clip_fraction", "silenced_fraction")


def _rollouts(max_response=25, seed=7, vocab=VOCAB):
    """16 sequences of uneven lengths (prompt 3-8, response 2-24) with group advantages."""
    from stapo_megatron.batch.microbatch import group_advantages

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 9, (NUM_PROMPTS,), generator=gen)]
    seqs = [(prompts[p], torch.randint(1, vocab, (int(torch.randint(2, max_response, (1,), generator=gen)),),
                                       generator=gen).tolist())
            for p in range(NUM_PROMPTS) for _ in range(GROUP)]
    adv = group_advantages((torch.rand(NUM_PROMPTS, GROUP, generator=gen) < 0.5).float())[0].reshape(-1).tolist()
    return [p for p, _ in seqs], [r for _, r in seqs], adv, [[-0.5] * len(r) for _, r in seqs]


def _rank_microbatches(rollouts, groups, seed, layout):
    """This DP rank's micro-batches of the one mini-batch of ``rollouts``: its contiguous share of
    them, as the trainer holds them, through the trainer's builder (which moves sequences over DP)."""
    records = records_from_lists(*rollouts)
    dp_size, dp_rank = dist.get_world_size(groups.dp), dist.get_rank(groups.dp)
    share = len(records) // dp_size
    (mbs,), _ = build_minibatches(records[dp_rank * share:(dp_rank + 1) * share], layout,
                                  microbatch_seed=lambda first, rank: seed, dp_group=groups.dp)
    return mbs


def _attention_worker(cp):
    """CP attention of this rank's chunks vs plain causal attention of whole sequences."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnMaskType

    from stapo_megatron.bridge.attention import SDPAttention
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.recipes.synthetic import tiny_gpt_config

    groups = init_parallel(1, 1, context_parallel_size=cp)
    config = dataclasses.replace(tiny_gpt_config(1), context_parallel_size=cp)
    attn = SDPAttention(config, 1, AttnMaskType.causal, "self")
    heads, query_groups, dim = config.num_attention_heads, config.num_query_groups, config.kv_channels
    cu = torch.tensor([0, 8 * cp, 10 * cp, 16 * cp], dtype=torch.int32)  # 3 sequences, whole 2 x CP chunks
    gen = torch.Generator().manual_seed(0)
    T = int(cu[-1])
    q, k, v = (torch.randn(T, h, dim, generator=gen) for h in (heads, query_groups, query_groups))
    upstream = torch.randn(T, heads * dim, generator=gen)
    # reference: each whole sequence alone, causal
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    bounds = cu.tolist()
    ref = torch.cat([F.scaled_dot_product_attention(
        *(t[a:b].transpose(0, 1)[None] for t in ref_in), is_causal=True, enable_gqa=True)[0]
        for a, b in zip(bounds, bounds[1:])], dim=1).transpose(0, 1).reshape(T, -1)
    ref.backward(upstream)
    from megatron.core.packed_seq_params import PackedSeqParams

    rank = dist.get_rank(groups.cp)
    idx = local_positions(cu, cp, rank)
    mine = [t[idx].clone().requires_grad_() for t in (q, k, v)]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6 * cp,
                             max_seqlen_kv=6 * cp)
    out = attn(*mine, None, packed_seq_params=params)
    out.backward(upstream[idx])
    return dict(out=(out.detach(), ref.detach()[idx]),
                grads=[(m.grad, r.grad[idx]) for m, r in zip(mine, ref_in)])


def _loss_config(method):
    """"stapo" (S2T exercised at the 512-token vocabulary; "stapo_300" at 300 tokens), or
    "grpo_seq_mask": GRPO (sequence mean, k3 KL 0.04 to a reference model) with the ``seq_mask``
    correction, bounds exp(+-0.1) (`_sequence_inputs`)."""
    from stapo_megatron.method.config import LossConfig, method_loss_config
    from stapo_megatron.method.rollout_correction import RolloutCorrectionConfig

    if method == "stapo":
        return LossConfig(method="stapo", tau_p=0.0015)
    if method == "stapo_300":  # the tiny Qwen3.5's 300-token vocabulary: tau_p above 1 / 300, so S2T silences
        return LossConfig(method="stapo", tau_p=0.005)
    if method == "stapo_gspo":  # S2T on GSPO: a sequence-level ratio, its mean summed over CP
        return method_loss_config("stapo", objective="gspo", tau_p=0.0015)
    correction = RolloutCorrectionConfig(mode="seq_mask", seq_lower=0.9, seq_upper=1.1)
    return method_loss_config("grpo", rollout_correction=correction)


def _sequence_inputs(config, model, groups, mbs):
    """GRPO's and seq_mask's inputs, the same per token whatever the layout: ``ref_logprob`` from
    a real reference model (another tiny GPT, built after the policy, so other weights), and
    sampler log-probs log pi_old - 0.3 (label mod 3 - 1), so a sequence's mean log-ratio lies in
    [-0.3, 0.3] and the +-0.1 bounds reject some sequences and keep others (0.3 k / n for n <= 24
    response tokens stays 1.4e-4 from both bounds; fp32 rounding of the sums is ~1e-6, so the
    CP sums cannot flip a flag). Returns max |ref - old| log-prob (the KL term is exercised)."""
    from stapo_megatron.mcore.reference import add_reference_logprobs
    from stapo_megatron.mcore.schedule import PassContext
    from stapo_megatron.recipes.synthetic import build_tiny_gpt

    reference = build_tiny_gpt(config, VOCAB, 64, seed=4321, core_attention="sdpa")
    add_reference_logprobs(PassContext(reference, max(mb.tokens.shape[1] for mb in mbs), groups=groups), [mbs])
    for mb in mbs:
        mb.rollout_logprob = mb.old_logprob - 0.3 * (mb.labels % 3 - 1).float()
    return max(float((mb.ref_logprob - mb.old_logprob)[mb.response_mask.bool()].abs().max()) for mb in mbs)


def _train_worker(tp, layouts, budgets, method="stapo", architecture=None):
    """For each CP size of ``layouts`` (same processes, parallel state rebuilt): two SGD updates
    on the same mini-batch with the token budget per rank of ``budgets`` and the loss of
    `_loss_config` (``method``); the model is the tiny GPT, or with ``architecture`` (a
    `bridge.tiny` variant, e.g. "qwen3.5") that tiny model through the bridge."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
    from stapo_megatron.recipes.synthetic import build_tiny_gpt, tiny_gpt_config

    spec = None
    if architecture is not None:
        from stapo_megatron.bridge.tiny import tiny_config

        spec = tiny_config(architecture)
    prompts, responses, adv, lps = _rollouts(vocab=spec["vocab_size"] if spec else VOCAB)
    loss_config = _loss_config(method)
    out = {}
    for cp, budget in zip(layouts, budgets):
        groups = init_parallel(tp, 1, context_parallel_size=cp)
        dp_size, dp_rank = dist.get_world_size(groups.dp), dist.get_rank(groups.dp)
        config = dataclasses.replace(tiny_gpt_config(tp), context_parallel_size=cp)
        if spec is None:
            model = build_tiny_gpt(config, VOCAB, 64, core_attention="sdpa")
        else:
            from stapo_megatron.bridge import build_gpt_model

            model = build_gpt_model(spec, params_dtype=torch.float32, calculate_per_token_loss=True,
                                    core_attention="sdpa")
        model, optimizer = wrap_model_and_optimizer(
            model, OptimConfig(optimizer="sgd", lr=0.5, weight_decay=0.0, clip_grad=0.0))
        mbs = _rank_microbatches((prompts, responses, adv, lps), groups, seed=3, layout=MicroBatchLayout(
            "budget", max_tokens=budget, seq_multiple=8 * cp, seq_align=2 * cp, cp_size=cp,
            cp_rank=dist.get_rank(groups.cp)))
        ctx = PassContext(model, max(mb.tokens.shape[1] for mb in mbs), groups=groups)
        old_policy_pass(ctx, [mbs])
        ref_gap = _sequence_inputs(config, model, groups, mbs) if not method.startswith("stapo") else 0.0
        updates = [policy_update(ctx, optimizer, mbs, loss_config) for _ in range(2)]
        params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
        out[cp] = dict(history=[u.metrics for u in updates], silenced=[u.silenced_tokens for u in updates],
                       params=params, tokens=max(mb.tokens.shape[1] for mb in mbs), tp_rank=dist.get_rank(groups.tp), ref_gap=ref_gap)
        parallel_state.destroy_model_parallel()
    return out


def _silenced(results, cp, update):
    rows = sorted(tuple(r) for res in results if res[cp]["tp_rank"] == 0
                  for r in res[cp]["silenced"][update])
    return torch.tensor(rows)


def _check_same(results, cp, silencing=True):
    for res in results:
        for got, want in zip(res[cp]["history"], res[1]["history"]):
            for key in COUNTS + ("correction_rejected_count",):
                assert got[key] == want[key], (cp, key)
            for key in VALUES:
                assert got[key] == pytest.approx(want[key], rel=2e-5, abs=1e-7, nan_ok=True), (cp, key)
        for name, want in res[1]["params"].items():
            torch.testing.assert_close(res[cp]["params"][name], want, atol=1e-6, rtol=0, msg=f"cp {cp} {name}")
    if not silencing:
        return
    for update in range(2):
        got, want = _silenced(results, cp, update), _silenced(results, 1, update)
        assert got.shape == want.shape and len(want) > 0, "the S2T mask must be exercised"
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert results[0][1]["history"][1]["clip_fraction"] > 0, "the second update must be off-policy and clip"


def _checkpoint_worker(hf_dir, run_cp2, run_cp1):
    """CP=2 trains one update and saves; CP=1 (DP=2) resumes it and takes the next update, as
    CP=2 does from its own state; CP=1 saves and CP=2 resumes that. Adam: its moments must
    travel through the checkpoint too."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.bridge.tiny import tiny_config
    from stapo_megatron.method.config import LossConfig
    from stapo_megatron.mcore import checkpoint as ckpt
    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer

    spec = tiny_config("qwen3")
    data = [_rollouts(seed=s, vocab=spec["vocab_size"]) for s in (1, 2)]

    def layout(cp):
        groups = init_parallel(1, 1, context_parallel_size=cp)
        model = build_gpt_model(spec, params_dtype=torch.float32, calculate_per_token_loss=True, core_attention="sdpa")
        model, optimizer = wrap_model_and_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.0))
        return groups, model, optimizer

    def update(groups, model, optimizer, rollouts):
        cp = groups.cp_size
        mbs = _rank_microbatches(rollouts, groups, seed=0, layout=MicroBatchLayout(
            "budget", max_tokens=48 // cp, seq_multiple=8, seq_align=2 * cp, cp_size=cp,
            cp_rank=dist.get_rank(groups.cp)))
        ctx = PassContext(model, max(mb.tokens.shape[1] for mb in mbs), groups=groups)
        old_policy_pass(ctx, [mbs])
        return policy_update(ctx, optimizer, mbs, LossConfig(tau_p=0.003)).metrics["loss"]

    params = lambda model: {n: p.detach().clone() for n, p in model.module.named_parameters()}  # noqa: E731
    out = {}
    groups, model, optimizer = layout(2)
    update(groups, model, optimizer, data[0])
    ckpt.save_checkpoint(run_cp2, 1, model, optimizer, {"layout": "cp2"})
    out["saved_cp2"] = params(model)
    out["loss_cp2"] = update(groups, model, optimizer, data[1])
    out["next_cp2"] = params(model)
    parallel_state.destroy_model_parallel()

    groups, model, optimizer = layout(1)
    out["state"] = ckpt.load_checkpoint(ckpt.find_latest(run_cp2), model, optimizer)
    out["loaded_cp1"] = params(model)
    out["loss_cp1"] = update(groups, model, optimizer, data[1])
    out["next_cp1"] = params(model)
    ckpt.save_checkpoint(run_cp1, 2, model, optimizer, {"layout": "cp1"})
    parallel_state.destroy_model_parallel()

    groups, model, optimizer = layout(2)
    ckpt.load_checkpoint(ckpt.find_latest(run_cp1), model, optimizer)
    out["loaded_cp2"] = params(model)
    parallel_state.destroy_model_parallel()
    return out


EVAL_K, SET_K, EVAL_TOKENS, LOGGED = 3, 2, 6, 10


def _parity_reward(response: str, answer: str):
    """1 when the response's first character has an even code point: about half the samples of
    an untrained model score, so every count is exercised (its text never matches an answer)."""
    from stapo_megatron.rewards.answers import STATUS_OK

    return (1.0 if response and ord(response[0]) % 2 == 0 else 0.0), STATUS_OK


def _eval_worker(model_dir, held_out_path, bench_path, run_dirs):
    """The real Evaluator twice on the same engine: at CP=2 (DP=1), then each rank alone as a
    one-process run is (one-rank groups: DP = CP = 1). Returns both rows, the logged samples
    and how many prompts this rank's engine was asked to sample at CP=2."""
    import json

    import torch.distributed as dist

    from stapo_megatron.config import TrainerConfig
    from stapo_megatron.data.config import DataConfig
    from stapo_megatron.eval.config import EvalConfig
    from stapo_megatron.rollout.config import RolloutSampling
    from stapo_megatron.data.examples import load_examples, tokenize_prompts
    from stapo_megatron.eval.evaluator import Evaluator, eval_max_len, load_eval_sets
    from stapo_megatron.rewards.scorer import RewardScorer
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.hf_engine import HFEngine
    from stapo_megatron.runlog.config import LoggingConfig
    from stapo_megatron.runlog.metrics import RunLogger
    from stapo_megatron.mcore.parallel import Groups, init_parallel

    cp2 = init_parallel(1, 1, context_parallel_size=2)
    rank = dist.get_rank()
    alone = [dist.new_group([r]) for r in range(2)][rank]  # every rank creates every group
    cfg = TrainerConfig(
        eval=EvalConfig(samples=EVAL_K, temperature=1.0, max_response_len=EVAL_TOKENS,
                        sets=[{"name": "bench", "path": bench_path, "k": SET_K}]),
        rollout=RolloutSampling(max_response_len=EVAL_TOKENS),
        data=DataConfig(max_prompt_len=256, use_chat_template=False),
        logging=LoggingConfig(backends=(), num_samples=LOGGED),
    )
    # one row per generate call: no padding, so a sample does not depend on its batch-mates
    engine = HFEngine(model_dir, RolloutConfig(dtype="float32", hf_max_batch_size=1, seed=0))
    generate, asked = engine.generate, []
    engine.generate = lambda prompts, *a, **k: asked.append(len(prompts)) or generate(prompts, *a, **k)
    ids, examples, _ = tokenize_prompts(engine.tokenizer, load_examples(held_out_path), 256, use_chat_template=False)
    sets = load_eval_sets(cfg.eval, engine.tokenizer, cfg.data.max_prompt_len, cfg.data.use_chat_template)
    out = {}
    with RewardScorer(num_workers=1, score_fn=_parity_reward) as scorer:
        layouts = (("cp2", cp2), ("cp1", Groups(tp=None, dp=alone, pp=None, is_last_stage=True, pp_last_rank=rank)))
        for name, groups in layouts:
            asked.clear()
            logger = RunLogger(run_dirs[name], enabled=rank == 0, logging=cfg.logging)
            evaluator = Evaluator(cfg.eval, (ids, examples), sets, engine, scorer, groups, 11, logger, cfg.steps,
                                  eval_max_len(cfg.eval, cfg.rollout.max_response_len), cfg.rollout_timeout(),
                                  cfg.logging.num_samples)
            out[name] = evaluator.evaluate(0)
            logger.close()
            out[name + "_asked"] = sum(asked)
            if rank == 0:
                out[name + "_logged"] = [json.loads(line) for line in open(f"{run_dirs[name]}/samples.jsonl")]
    return out
