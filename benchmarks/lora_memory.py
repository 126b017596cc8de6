"""Measured memory of one LoRA training step on the CPU against `stapo_megatron.recipes.memory`'s
estimate for the same model, with full fine-tuning measured and modelled the same way beside it.

    .venv/bin/python benchmarks/lora_memory.py
    .venv/bin/python benchmarks/lora_memory.py --rank 64 --seq-len 512

One process (gloo, world 1) builds a small Qwen3-shaped Megatron GPTModel in bf16 (the local
layer spec LoRA uses), wraps it as the trainer does (Megatron DDP with fp32 gradient buffers,
the distributed optimizer: `stapo_megatron.mcore.step.wrap_model_and_optimizer`), runs one
warm-up update so that Adam's moments exist, and then measures a second STAPO update
(`policy_update`: forward, backward, the loss on the logits, the optimizer step):

- **state**: the bytes of every distinct storage held by the model's parameters, the DDP
  buffers and the optimizer (fp32 master shards, Adam's moments) between updates: the model's
  ``weights + grads + optimizer``;
- **step peak**: the most bytes of tensors created during the update that were alive at once
  (`LiveTensorBytes`, a dispatch mode that adds each new storage an aten op returns and
  subtracts it when the storage is freed): the model's ``activations + logits``. The CPU is not
  the GPU the model describes: the local spec's attention keeps its fp32 [heads, s, s] scores
  and probabilities (flash attention keeps none), and the loss runs its torch path, which keeps
  the fp32 softmax of the logits (the Triton kernels keep [N]-sized statistics); both are
  counted from the shapes (``cpu_only``) and shown apart, not added to the model.

Bytes freed inside a kernel (a temporary an op allocates and releases before returning) are
not seen, as on a GPU ``max_memory_allocated`` would see them; this harness stands in for that
counter, which the CPU has not.
"""

from __future__ import annotations

import argparse
import gc
import os
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MiB = 2**20


class LiveTensorBytes(TorchDispatchMode):
    """The bytes of tensor storages created under this mode that are still alive (``current``)
    and the most at any moment (``peak``): each storage an aten op returns is counted once,
    until it is freed (a weak reference's callback)."""

    def __init__(self):
        super().__init__()
        self.current = self.peak = 0
        self._sizes, self._refs = {}, {}

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._sizes or storage.nbytes() == 0:
            return
        self._sizes[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)

        def freed(_ref, key=key):
            self.current -= self._sizes.pop(key, 0)
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                self._track(value)
        return out


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer counted once)."""
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def state_tensors(ddp_model, optimizer):
    """Every tensor the run keeps between updates: parameters (views into DDP's parameter
    buffer), the DDP buffers, and each optimizer's fp32 master shards and Adam moments."""
    tensors = list(ddp_model.module.parameters())
    for buffer in ddp_model.buffers:
        tensors += [buffer.param_data, buffer.grad_data] if buffer.param_data is not None else [buffer.grad_data]
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.optimizer.param_groups:
            tensors += list(group["params"])
        for state in opt.optimizer.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v) and v.numel() > 1]
    return tensors


def cpu_only(spec, seq_len: int) -> int:
    """The CPU path's transient bytes that the GPU model leaves out, from the shapes: per layer
    the local attention's fp32 scores and probabilities [heads, s, s] (kept for the backward),
    and the torch loss's fp32 softmax over the logits [s, V]."""
    scores = spec.num_layers * 2 * 4 * spec.num_attention_heads * seq_len * seq_len
    from stapo_megatron.bridge.transformer_config import padded_vocab_size

    return scores + 4 * seq_len * padded_vocab_size(spec.vocab_size, 1)


def measure(groups, spec, seq_len: int, lora_rank: int) -> dict:
    """The second update of ``spec`` (bf16, distributed optimizer, two sequences of ``seq_len``
    tokens, one per micro-batch) with LoRA adapters of ``lora_rank`` (0: full fine-tuning), in
    this process's one-rank parallel state (``groups``): bytes of the state, the forward and
    backward's peak, the optimizer step's transient peak, and the base's fp32 parameters."""
    from stapo_megatron.bridge.model import build_gpt_model
    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.lora import apply_lora
    from stapo_megatron.mcore.lora_config import LoraConfig
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
    from stapo_megatron.method.config import LossConfig
    from stapo_megatron.recipes.synthetic import synthetic_rollouts

    model = build_gpt_model(spec, params_dtype=torch.bfloat16, bf16=True, use_te=False,
                            calculate_per_token_loss=True, use_cpu_initialization=True)
    if lora_rank:
        apply_lora(model, LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank))
    ddp, optimizer = wrap_model_and_optimizer(model, OptimConfig(lr=1e-3, use_distributed_optimizer=True))
    prompt = seq_len // 8
    ctx = PassContext(ddp, seq_len, groups=groups)
    for step in range(2):  # the first creates Adam's moments; the second is measured
        mbs, _ = synthetic_rollouts(1, 2, prompt, seq_len - prompt, spec.vocab_size, seed=step, micro_batch_size=1)
        old_policy_pass(ctx, [mbs])
        gc.collect()
        live = LiveTensorBytes()
        optimizer.prepare_grads = _split_at_optimizer(optimizer.prepare_grads, live, peaks := {})
        with live:
            policy_update(ctx, optimizer, mbs, LossConfig(tau_p=0.003))
        del optimizer.prepare_grads  # the instance's wrapper: the class's method again
        peaks["optimizer_peak"] = live.peak - peaks.pop("optimizer_start")
    state = storage_bytes(state_tensors(ddp, optimizer))
    # the local spec's RMSNorm weights stay fp32 in a bf16 model (the model counts every base
    # parameter in bf16, and a trained fp32 one needs no fp32 master copy)
    fp32 = sum(p.numel() for n, p in ddp.module.named_parameters() if p.dtype == torch.float32 and ".lora." not in n)
    # Megatron's distributed-optimizer buffers align each parameter to 64 values and each bucket
    # to 128 (param_and_grad_buffer.py): elements no parameter owns, absent from the model
    padding = sum((b.grad_data.numel() - sum(p.numel() for p in b.params))
                  * (b.grad_data.element_size() + b.param_data.element_size()) for b in ddp.buffers)
    return dict(state=state, fp32_base_params=fp32, buffer_padding=padding, **peaks)


def _split_at_optimizer(prepare_grads, live: LiveTensorBytes, peaks: dict):
    """``optimizer.prepare_grads`` (where `policy_update` turns from the backward to the
    optimizer) recording the forward and backward's peak (``backward_peak``) and restarting the
    peak from what is alive then (``optimizer_start``)."""
    def wrapped(*args, **kwargs):
        peaks["backward_peak"] = live.peak
        live.peak = peaks["optimizer_start"] = live.current
        return prepare_grads(*args, **kwargs)

    return wrapped


def one_rank_parallel():
    """This process as a one-rank gloo job: Megatron's parallel state, its `Groups`."""
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.utils import free_port, local_rank_env

    os.environ.update(local_rank_env(0, 1, free_port()))
    return init_parallel(1, 1)


def modelled(spec, seq_len: int, lora_rank: int):
    """`memory_estimate` of one GPU holding the whole model (TP = PP = DP = 1, no recomputation),
    one sequence of ``seq_len`` tokens per micro-batch."""
    from stapo_megatron.mcore.config import ModelConfig
    from stapo_megatron.recipes import memory

    layout = memory.ParallelLayout(num_nodes=1, gpus_per_node=1, model=ModelConfig(), vllm_tensor_parallel_size=1,
                                   vllm_gpu_memory_utilization=0.0, seq_len=seq_len, lora_rank=lora_rank)
    return memory.memory_estimate(spec, layout)


def modelled_state(estimate, measured: dict, lora: bool) -> float:
    """The model's ``weights + grads + optimizer`` for the run ``measured`` describes: its base
    keeps ``fp32_base_params`` parameters in fp32 (the model counts 2 bytes each: a trained fp32
    parameter is its own master copy, +2 bytes and -4; a frozen one weighs 2 bytes more), and its
    buffers hold ``buffer_padding`` bytes of alignment."""
    fp32 = (2 if lora else -2) * measured["fp32_base_params"]
    return estimate.weights + estimate.grads + estimate.optimizer + fp32 + measured["buffer_padding"]


def benchmark_spec(num_layers: int = 4, hidden_size: int = 256, vocab_size: int = 4096):
    """A small Qwen3 shape (GQA 4:2, head dim 64, SwiGLU 3h): big enough that the weights and
    the activations outweigh the per-tensor bookkeeping, small enough for a 2-core CPU."""
    from stapo_megatron.bridge.tiny import tiny_qwen3_spec

    return tiny_qwen3_spec(num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=3 * hidden_size,
                           vocab_size=vocab_size, num_attention_heads=4, num_query_groups=2,
                           kv_channels=hidden_size // 4, max_position_embeddings=4096)


def rows(groups, spec, seq_len: int, lora_rank: int):
    """(label, measured state, modelled state, measured forward/backward peak, modelled
    activations + logits, CPU-only bytes, the optimizer step's transient bytes) for full
    fine-tuning and LoRA."""
    out = []
    for label, rank in (("full", 0), (f"LoRA r={lora_rank}", lora_rank)):
        got = measure(groups, spec, seq_len, rank)
        est = modelled(spec, seq_len, rank)
        out.append((label, got["state"], modelled_state(est, got, bool(rank)), got["backward_peak"],
                    est.activations + est.logits, cpu_only(spec, seq_len), got["optimizer_peak"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    spec = benchmark_spec(args.layers, args.hidden)
    print(f"Qwen3 shape: {spec.num_layers} layers, hidden {spec.hidden_size}, vocabulary {spec.vocab_size}; "
          f"bf16, distributed optimizer, one sequence of {args.seq_len} tokens per micro-batch\n")
    print("| run | state measured / model (MiB) | ratio | forward + backward peak measured (MiB) | model: "
          "activations + logits | CPU-only terms | measured / (model + CPU-only) | optimizer step's transient "
          "(MiB) |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, state, state_m, peak, peak_m, cpu, opt in rows(one_rank_parallel(), spec, args.seq_len, args.rank):
        print(f"| {label} | {state / MiB:.2f} / {state_m / MiB:.2f} | {state / state_m:.3f} | {peak / MiB:.2f} | "
              f"{peak_m / MiB:.2f} | {cpu / MiB:.2f} | {peak / (peak_m + cpu):.3f} | {opt / MiB:.2f} |")


if __name__ == "__main__":
    main()
