"""verify: run the Megatron model from a checkpoint and transformers from an HF folder on the
same prompts, and compare logits (max abs difference, top-1 agreement, KL).

The Megatron side runs in ``lcm(tp*pp*ep)`` spawned processes on this host (gloo on CPU, NCCL on
GPU); one process group serves several (TP, PP) layouts in turn, the spare ranks acting as
data-parallel replicas that take a share of the prompts. Both sides run in fp32. Before any rank
starts, the host memory they need is estimated (`host_bytes_needed`) and a layout that does not
fit is refused with the estimate; a rank the kernel kills anyway is reported with its signal.

Legend: ``B`` prompts, ``S`` tokens per prompt, ``V`` real vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue as queue_lib
import signal
import traceback
import warnings
from typing import Optional, Sequence

import torch

from stapo_megatron.bridge.hf_config import num_params
from stapo_megatron.utils import format_bytes, free_port, local_rank_env

FP32_LOGIT_TOL = 1e-5
"""Accepted max |logit_megatron - logit_hf| in fp32, relative to the logit scale
max(1, max |logit_hf|). Both sides compute the same function with different kernels (one fused
QKV GEMM vs three, baddbmm + softmax vs SDPA, TP partial sums reduced in another order); each
op differs by a few fp32 ulps (~1e-7 relative) and the differences add up over layers. Tiny
4-layer test models (logits up to ~5) stay below 5e-6; a deep real model may need --tol 1e-4."""

HYBRID_LOGIT_TOL = 3 * FP32_LOGIT_TOL
"""`FP32_LOGIT_TOL` for models with gated delta-net layers (Qwen3.5): the converter's few ulps per op
plus the two sides' chunked delta rules in fp32. On the CPU Megatron runs
`stapo_megatron.mcore.delta_rule` and transformers its own torch chunked rule, in different
summation orders; each is within ~6e-6 of the float64 recurrence per token
(`tests/mcore/test_delta_rule.py` bounds it at 1e-5), so the two may differ by 2e-5 per token,
which the gated output norm carries into the layer's output (measured 1.6e-5 on the tiny Qwen3.5
of `tests/bridge/test_hybrid.py` at TP = 1)."""


def default_tolerance(spec) -> float:
    """The logit tolerance `verify` is judged by when none is given: `HYBRID_LOGIT_TOL` for a model
    with delta-net layers, else `FP32_LOGIT_TOL`."""
    return HYBRID_LOGIT_TOL if spec.is_hybrid else FP32_LOGIT_TOL


RANK_OVERHEAD_BYTES = 0.75 * 2**30
"""Host memory of one verify rank before its model: Python, torch, megatron-core and DCP imported
(0.45 GiB resident measured on the CPU venv, 2026-11-25), plus the process group and load buffers."""


def host_bytes_needed(spec, layouts: Sequence[tuple[int, int]], expert_model_parallel_size: int = 1,
                      weights_on_host: bool = True) -> float:
    """Host memory the verify ranks hold together (fp32): each rank's `RANK_OVERHEAD_BYTES`, the
    dense weights once per data-parallel replica (EP is carved out of DP: at one layout the ``ep``
    ranks of an expert group each hold a TP x PP share of every dense weight) and the experts
    once per expert-parallel replica, all twice (the model and the checkpoint's read buffer).
    ``spec`` is the model's `QwenSpec`; ``weights_on_host`` False (ranks on GPUs) counts the
    per-rank overhead only."""
    ep = expert_model_parallel_size
    world = math.lcm(*(tp * pp * ep for tp, pp in layouts))
    experts = spec.num_layers * (spec.num_moe_experts or 0) * 3 * spec.hidden_size * (spec.moe_ffn_hidden_size or 0)
    dense = num_params(spec) - experts
    # layouts run one after the other; in each, world / (tp pp) replicas of the dense weights
    # and world / (tp pp ep) of the experts
    weights = max(dense * world // (tp * pp) + experts * world // (tp * pp * ep) for tp, pp in layouts)
    return world * RANK_OVERHEAD_BYTES + (2 * 4 * weights if weights_on_host else 0)


def check_host_memory(needed: float, available: float, world: int) -> None:
    """ValueError when the verify ranks would not fit the host's available memory."""
    if needed > available:
        raise ValueError(f"verify needs {world} processes on this host, about {format_bytes(needed)} of memory "
                         f"(fp32 weights and {format_bytes(RANK_OVERHEAD_BYTES)} per process), and "
                         f"{format_bytes(available)} is available: verify at a smaller --tp/--ep (any layout "
                         f"checks the conversion; --ep 2 already splits every expert tensor), or on a larger host")


@dataclasses.dataclass
class ParityRow:
    """Comparison of one (TP, PP) layout against transformers."""

    tensor_model_parallel_size: int
    """TP size the Megatron model ran with."""
    pipeline_model_parallel_size: int
    """PP size the Megatron model ran with."""
    max_abs_diff: float
    """max |logit_megatron - logit_hf| over prompts, positions and the real vocabulary."""
    top1_agreement: float
    """Fraction of positions where both argmax tokens agree."""
    max_kl: float
    """Largest per-position KL(p_hf || p_megatron) in nats."""
    logit_scale: float
    """max(1, max |logit_hf|): the scale the tolerance is relative to."""

    def ok(self, tol: float = FP32_LOGIT_TOL, min_top1: float = 1.0) -> bool:
        """Within ``tol * logit_scale`` and top-1 agreement at least ``min_top1``."""
        return self.max_abs_diff <= tol * self.logit_scale and self.top1_agreement >= min_top1


def fixed_prompts(vocab_size: int, num_prompts: int = 4, seq_len: int = 32, seed: int = 0) -> torch.Tensor:
    """Deterministic token ids ``[B, S]`` (uniform over the vocabulary, seeded)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_prompts, seq_len), generator=gen)


def hf_logits(hf_dir: str, tokens_BS: torch.Tensor) -> torch.Tensor:
    """transformers logits ``[B, S, V]`` in fp32; of a vision-language checkpoint, the
    vision-language model's own on text alone (not ``AutoModelForCausalLM``'s, which loads its
    text tower by itself)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from stapo_megatron.bridge.hf_config import load_hf_config
    from stapo_megatron.bridge.vision_language import vision_language_architecture

    auto = AutoModelForImageTextToText if vision_language_architecture(load_hf_config(hf_dir)) else AutoModelForCausalLM
    model = auto.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens_BS).logits.float()


def compare(ref_BSV: torch.Tensor, got_BSV: torch.Tensor, tp: int, pp: int) -> ParityRow:
    """Metrics of one layout (both tensors over the real vocabulary)."""
    logp_ref = torch.log_softmax(ref_BSV.double(), -1)
    logp_got = torch.log_softmax(got_BSV.double(), -1)
    kl_BS = (logp_ref.exp() * (logp_ref - logp_got)).sum(-1)
    return ParityRow(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        max_abs_diff=(ref_BSV - got_BSV).abs().max().item(),
        top1_agreement=(ref_BSV.argmax(-1) == got_BSV.argmax(-1)).float().mean().item(),
        max_kl=kl_BS.max().item(),
        logit_scale=max(1.0, ref_BSV.abs().max().item()),
    )


def format_table(rows: Sequence[ParityRow], tol: float = FP32_LOGIT_TOL) -> str:
    """A small fixed-width table."""
    lines = [f"{'TP':>3} {'PP':>3} {'max|dlogit|':>12} {'allowed':>9} {'top-1':>7} {'max KL':>10}  ok"]
    for r in rows:
        lines.append(
            f"{r.tensor_model_parallel_size:>3} {r.pipeline_model_parallel_size:>3} {r.max_abs_diff:>12.3e} "
            f"{tol * r.logit_scale:>9.1e} {r.top1_agreement * 100:>6.1f}% {r.max_kl:>10.2e}  "
            f"{'yes' if r.ok(tol) else 'NO'}"
        )
    return "\n".join(lines)


def _megatron_forward(model, tokens_BS: torch.Tensor) -> Optional[torch.Tensor]:
    """Forward one micro-batch through the pipeline; logits ``[B, S, Vp]`` on the last stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tokens_BS = tokens_BS.to(device)
    b, s = tokens_BS.shape
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)

    def forward_step(data_iterator, module):
        output = module(next(data_iterator), position_ids, attention_mask=None)
        # forward_only + collect_non_loss_data: the schedule stores what loss_func returns.
        return output, lambda out, non_loss_data=True: out.detach().float().cpu()

    store = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([tokens_BS]), model=[model], num_microbatches=1,
        seq_length=s, micro_batch_size=b, forward_only=True, collect_non_loss_data=True,
    )
    return store[0] if store else None


def megatron_worker(ckpt_dir: str, hf_config: dict, layouts: Sequence[tuple[int, int]],
                    tokens_BS: torch.Tensor, expert_model_parallel_size: int = 1) -> dict:
    """One rank: for each layout build, load, run; returns ``{(tp, pp): (prompt_ids, logits)}``
    from the ranks that hold full logits (last stage, TP rank 0). A MoE model runs its experts
    over ``expert_model_parallel_size`` of the data-parallel ranks."""
    from megatron.core import parallel_state as ps

    from stapo_megatron.bridge import build_gpt_model, load_checkpoint
    from stapo_megatron.mcore.parallel import init_parallel

    results = {}
    for tp, pp in layouts:
        init_parallel(tp, pp, expert_model_parallel_size=expert_model_parallel_size)
        model = build_gpt_model(hf_config, params_dtype=torch.float32, parallel_output=False)
        load_checkpoint(model, ckpt_dir)  # reads a trainer checkpoint's ``module.`` keys too
        model.eval()
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        ids = list(range(dp_rank, tokens_BS.shape[0], dp))
        logits = None
        if ids:
            with torch.no_grad():
                logits = _megatron_forward(model, tokens_BS[ids])
        if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
            results[(tp, pp)] = (ids, logits[..., : model.qwen_spec.vocab_size])
        ps.destroy_model_parallel()
        del model
    return results


def _spawned(rank: int, world: int, port: int, args: tuple, queue) -> None:
    os.environ.update(local_rank_env(rank, world, port))
    torch.set_num_threads(1)  # ranks share the machine's cores
    # Every rank would repeat megatron-core's and DCP's deprecation and "Apex/TE not installed"
    # warnings; the verify table is the output that matters.
    for module in ("megatron", "torch"):
        warnings.filterwarnings("ignore", category=UserWarning, module=module)
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
    try:
        queue.put((rank, "ok", megatron_worker(*args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def megatron_logits(ckpt_dir: str, hf_config: dict, layouts: Sequence[tuple[int, int]],
                    tokens_BS: torch.Tensor, timeout: float = 1800.0, expert_model_parallel_size: int = 1) -> dict:
    """Spawn the ranks; return ``{(tp, pp): logits [B, S, V]}`` reassembled over DP replicas."""
    import torch.multiprocessing as mp

    # EP is carved out of DP: every layout needs tp x pp x ep ranks (expert TP = TP)
    world = math.lcm(*(tp * pp * expert_model_parallel_size for tp, pp in layouts))
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    worker_args = (ckpt_dir, hf_config, list(layouts), tokens_BS, expert_model_parallel_size)
    procs = [ctx.Process(target=_spawned, args=(r, world, port, worker_args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    gathered, error = {}, None
    try:
        for _ in range(world):
            rank, status, value = _next_result(queue, procs, timeout)
            if status == "error":
                error = value if rank < 0 else f"rank {rank}:\n{value}"
                break
            for layout, (ids, logits) in value.items():
                gathered.setdefault(layout, {}).update(zip(ids, logits))
    finally:
        for p in procs:
            p.join(timeout=5 if error else 60)
            if p.is_alive():
                p.kill()
    if error:
        raise RuntimeError("Megatron verify worker failed\n" + error)
    return {layout: torch.stack([rows[i] for i in range(tokens_BS.shape[0])]) for layout, rows in gathered.items()}


def killed_ranks(procs) -> list[str]:
    """"rank R: killed by SIGNAME" for each process that ended on a signal (exitcode -N)."""
    return [f"rank {r}: killed by {signal.Signals(-p.exitcode).name}" for r, p in enumerate(procs)
            if p.exitcode is not None and p.exitcode < 0]


def _next_result(queue, procs, timeout: float) -> tuple:
    """The next rank's (rank, status, value); a rank killed by a signal (the kernel's OOM killer
    sends SIGKILL) is named at once rather than surfacing as its peers' "Connection closed by peer"."""
    waited = 0.0
    while True:
        try:
            return queue.get(timeout=1.0)
        except queue_lib.Empty:
            waited += 1.0
        killed = killed_ranks(procs)
        if killed:
            return (-1, "error", "; ".join(killed) + " (out of host memory? see `dmesg`; verify at a smaller --tp/--ep)")
        if waited >= timeout:
            raise TimeoutError(f"verify ranks gave no result within {timeout:.0f} s")


def verify(hf_dir: str, ckpt_dir: str, layouts: Sequence[tuple[int, int]], num_prompts: int = 4,
           seq_len: int = 32, seed: int = 0, expert_model_parallel_size: int = 1,
           check_memory: bool = True) -> list[ParityRow]:
    """Compare the checkpoint under each (TP, PP) layout with transformers on fixed prompts
    (a MoE checkpoint with its experts over ``expert_model_parallel_size`` ranks). With
    ``check_memory``, a layout whose ranks would not fit this host's available memory
    (`host_bytes_needed`) is refused (ValueError) before any rank starts."""
    from stapo_megatron.conversion.dcp_io import CheckpointReader
    from stapo_megatron.conversion.hf_to_mcore import load_spec
    from stapo_megatron.conversion.mcore_to_hf import resolve_checkpoint_dir
    from stapo_megatron.bridge.transformer_config import check_parallel_sizes

    hf_config, spec = load_spec(hf_dir)
    for tp, pp in layouts:
        check_parallel_sizes(spec, tp, pp, expert_model_parallel_size)
    world = math.lcm(*(tp * pp * expert_model_parallel_size for tp, pp in layouts))
    if check_memory:
        import psutil

        needed = host_bytes_needed(spec, layouts, expert_model_parallel_size, weights_on_host=not torch.cuda.is_available())
        check_host_memory(needed, psutil.virtual_memory().available, world)
    ckpt_dir = resolve_checkpoint_dir(ckpt_dir)
    CheckpointReader(ckpt_dir)  # a clear error for a damaged or non-GPT checkpoint before any rank starts
    tokens_BS = fixed_prompts(spec.vocab_size, num_prompts, seq_len, seed)
    # The reference runs (and is freed) before the Megatron ranks start, to keep peak memory low.
    ref_BSV = hf_logits(hf_dir, tokens_BS)
    got = megatron_logits(ckpt_dir, hf_config, layouts, tokens_BS, expert_model_parallel_size=expert_model_parallel_size)
    return [compare(ref_BSV, got[(tp, pp)], tp, pp) for tp, pp in layouts]
