"""CPU compatibility shims for megatron-core code that assumes CUDA.

megatron-core targets NVIDIA GPUs; a handful of places allocate on ``device="cuda"``,
query ``torch.cuda.current_device()``, or compare ``Tensor.type()`` with CUDA type names.
On a CPU-only machine (the CI box, a laptop) these are the only obstacles to running the
real GPTModel, pipeline schedules and optimizer on gloo. Every patch below names the
upstream file it works around (written against megatron-core 0.16.1 and checked against 0.19.2
by `make test-mcore019`, which runs the CPU suite with 0.19.2's sources; 0.19 added one call
site on every gradient sync: `param_and_grad_buffer.py` `start_grad_sync` asks for
``torch.cuda.current_stream()`` to wait on CUDA-graph events).

``apply()`` is idempotent and does nothing when CUDA is available, so GPU runs always use
upstream code unchanged. It is called by the helpers that build models and process groups
(``stapo_megatron.train.parallel``); library users on CPU may call it themselves.
"""

from __future__ import annotations

import contextlib
import importlib
import types

import torch

_APPLIED = False

# Modules whose module-level ``torch`` name is swapped for a proxy that maps
# ``device="cuda"`` to the CPU in the tensor factories. Each allocates small bookkeeping
# tensors (counters, masks, norms) directly on "cuda".
_CUDA_ALLOCATING_MODULES = (
    "megatron.core.transformer.utils",  # get_default_causal_mask: torch.ones(..., device="cuda")
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens = torch.zeros(..., device="cuda")
    "megatron.core.optimizer.optimizer",  # found_inf / _scale_one / _scale on "cuda"
    "megatron.core.optimizer.clip_grads",  # total_norm_cuda, dummy_overflow_buf on "cuda"
    "megatron.core.optimizer.grad_scaler",  # loss-scale tensors on "cuda"
    "megatron.core.distributed.param_and_grad_buffer",  # warm-up tensor on "cuda"
    "megatron.core.tensor_parallel.data",  # broadcast_data size tensor on "cuda"
    "megatron.core.utils",  # local_multi_tensor_l2_norm (no TE/apex) returns a "cuda" tensor
    # MoE (0.16.1 and 0.19.2): the alltoall dispatcher creates a device-to-host copy stream
    # (token_dispatcher.py MoEAlltoAllTokenDispatcher.__init__ ``torch.cuda.Stream()``) and runs
    # its split-size copies on it (``_maybe_dtoh_and_synchronize``: current_stream, stream(),
    # record_event, event.synchronize); moe_utils.py ``save_to_aux_losses_tracker`` allocates
    # the per-layer aux-loss tracker on "cuda".
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.moe_utils",
)

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like")


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


class _NullEvent:
    """An event on the CPU's one stream: already complete."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _NullStream:
    """The CPU's one "stream": every operation is already ordered, so waits and records do nothing."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None):
        return _NullEvent() if event is None else event

    def synchronize(self) -> None:
        pass


_NULL_STREAM = _NullStream()


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as the shimmed modules see it: streams are `_NullStream` (megatron-core
    0.19 ``param_and_grad_buffer.py`` calls ``torch.cuda.current_stream()`` on every gradient
    sync); everything else is the real ``torch.cuda``."""

    def __init__(self):
        super().__init__("torch.cuda")

    def current_stream(self, device=None) -> _NullStream:
        return _NULL_STREAM

    def Stream(self, *args, **kwargs) -> _NullStream:  # noqa: N802 (torch.cuda's spelling)
        return _NULL_STREAM

    def stream(self, stream=None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """Stands in for ``torch`` inside one upstream module; redirects CUDA allocations."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        if name == "cuda":
            return _CPU_CUDA
        attr = getattr(torch, name)
        if name in _FACTORIES:

            def factory(*args, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                return attr(*args, **kwargs)

            return factory
        return attr


_CPU_CUDA = _CpuCuda()


class _CpuRNGStatesTracker:
    """CPU replacement for megatron.core.tensor_parallel.random.CudaRNGStatesTracker.

    Upstream forks the CUDA generator for model-parallel dropout; on CPU we fork the CPU
    generator with the same add/fork/get_states/set_states/reset contract.
    """

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def apply() -> None:
    """Install the shims if CUDA is absent (idempotent)."""
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    _APPLIED = True

    # torch.cuda.current_device() is used as an allocation device all over megatron.core
    # (pipeline_parallel/p2p_communication.py, tensor_parallel/layers.py, ...).
    torch.cuda.current_device = lambda: torch.device("cpu")
    # pipeline_parallel/p2p_communication.py calls torch.cuda.synchronize() after p2p ops.
    torch.cuda.synchronize = lambda *a, **k: None
    # models/common/language_module/language_module.py moves the tied embedding to
    # .cuda() before its PP all-reduce; on CPU that must stay a CPU tensor.
    torch.Tensor.cuda = lambda self, *a, **k: self

    # optimizer/clip_grads.py and optimizer/optimizer.py assert
    # ``param.type() == 'torch.cuda.FloatTensor'``; report CPU tensors by their CUDA name.
    orig_type = torch.Tensor.type

    def _type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return orig_type(self).replace("torch.", "torch.cuda.", 1)
        return orig_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = _type

    proxy = _CpuTorch()
    for name in _CUDA_ALLOCATING_MODULES:
        importlib.import_module(name).torch = proxy

    # fusions/fused_softmax.py imported get_default_causal_mask by name; rebind it to the
    # (now CPU-allocating) function object, which resolves ``torch`` in transformer.utils.
    from megatron.core.tensor_parallel import random as mp_random

    # tensor_parallel/random.py: the CUDA RNG tracker calls torch.cuda.get_rng_state.
    mp_random.CudaRNGStatesTracker = _CpuRNGStatesTracker
    mp_random._CUDA_RNG_STATE_TRACKER = None
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    mp_random.torch = _CpuTorchCudaSeed()

    # transformer/moe/token_dispatcher.py (0.16.1 and 0.19.2) gets the alltoall split sizes
    # through moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True), which converts only CUDA
    # tensors; a CPU tensor stays a tensor and all_to_all_single refuses it as split sizes.
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _tensor_to_cpu


def _tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """moe_utils.maybe_move_tensor_to_cpu for tensors already on the CPU: numpy when asked."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


class _CpuTorchCudaSeed(_CpuTorch):
    """``torch`` for tensor_parallel/random.py: torch.cuda.manual_seed becomes a no-op."""

    def __getattr__(self, name):
        if name == "cuda":
            return types.SimpleNamespace(
                manual_seed=lambda seed: None,
                manual_seed_all=lambda seed: None,
                is_available=lambda: False,
                current_device=torch.cuda.current_device,
                device_count=lambda: 0,
                get_rng_state=torch.get_rng_state,
                # _get_all_rng_states (activation recomputation's CheckpointFunction) saves
                # the "CUDA" state through torch.cuda.random; on CPU that is a placeholder (the
                # matching _set_cuda_rng_state is deferred by torch.cuda._lazy_call, never run).
                random=types.SimpleNamespace(get_rng_state=lambda device=None: torch.get_rng_state()),
                CUDAGraph=torch.cuda.CUDAGraph,
            )
        return super().__getattr__(name)


def define_missing_te_names() -> None:
    """megatron-core 0.16.1 ``transformer/moe/moe_utils.py`` imports ``te_general_gemm`` (and the
    fused MoE kernels) only when transformer-engine imports, yet the router's
    ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None`` unconditionally: without
    transformer-engine (the CPU, or a GPU with a plain pip install) every MoE forward fails with
    NameError. 0.19.2 binds the names to None in that case; this does the same for 0.16.1.
    Not a CUDA shim, so it is applied with or without CUDA (by `bridge.model.build_gpt_model`
    for MoE models), and only fills names that are missing."""
    from megatron.core.transformer.moe import moe_utils

    if getattr(moe_utils, "HAVE_TE", True):
        return
    for name in ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                 "fused_topk_with_score_function", "fused_unpermute"):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
