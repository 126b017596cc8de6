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
upstream code unchanged. The ``Tensor.cuda`` / ``Tensor.type`` shims are not process-wide: they
are active only while the upstream methods that need them run (`cuda_tensor_names`). ``apply()``
is called by the helpers that build models and process groups (``stapo_megatron.mcore.parallel``);
library users on CPU may call it themselves.
"""

from __future__ import annotations

import contextlib
import functools
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


_ORIG_TENSOR_CUDA = torch.Tensor.cuda
_ORIG_TENSOR_TYPE = torch.Tensor.type
_cuda_names_depth = 0


def _cpu_tensor_type(self, dtype=None, non_blocking=False, **kwargs):
    """``Tensor.type()`` that reports a CPU tensor by its CUDA name ("torch.cuda.FloatTensor")."""
    if dtype is None and not kwargs and self.device.type == "cpu":
        return _ORIG_TENSOR_TYPE(self).replace("torch.", "torch.cuda.", 1)
    return _ORIG_TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def cuda_tensor_names():
    """Inside: ``Tensor.cuda()`` returns the tensor itself and ``Tensor.type()`` names a CPU tensor
    as its CUDA type; outside, both are torch's. Re-entrant (the scoped upstream calls nest:
    ``DistributedOptimizer.__init__`` calls ``_build_model_and_main_param_groups``)."""
    global _cuda_names_depth
    if _cuda_names_depth == 0:
        torch.Tensor.cuda = lambda self, *a, **k: self
        torch.Tensor.type = _cpu_tensor_type
    _cuda_names_depth += 1
    try:
        yield
    finally:
        _cuda_names_depth -= 1
        if _cuda_names_depth == 0:
            torch.Tensor.cuda = _ORIG_TENSOR_CUDA
            torch.Tensor.type = _ORIG_TENSOR_TYPE


# The upstream methods that call ``.cuda()`` on a tensor or compare ``.type()`` with CUDA type
# names (the same call sites in megatron-core 0.16.1 and 0.19.2); only while they run is
# `cuda_tensor_names` active, so the rest of the process sees torch's own Tensor methods.
_CUDA_NAME_METHODS = (
    # language_module.py: the tied embedding goes ``.cuda()`` before its PP all-reduce
    ("megatron.core.models.common.language_module.language_module", "LanguageModule",
     "setup_embeddings_and_output_layer"),
    # optimizer.py: asserts ``param.type() == 'torch.cuda.FloatTensor'`` (mixed precision) and
    # moves offloaded state back with ``.cuda()``
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params", "__init__"),
    ("megatron.core.optimizer.optimizer", "MegatronOptimizer", "restore_from_cpu"),
    # distrib_optimizer.py: the same ``.type()`` tests, and ``send_tensor.cuda()`` when gathering state
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "_build_model_and_main_param_groups"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "__init__"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "get_parameter_state_dp_zero"),
)
# Functions, rebound in every module that imported them by name.
_CUDA_NAME_FUNCTIONS = (
    # clip_grads.py: ``assert param.grad.type() == 'torch.cuda.FloatTensor'``
    ("clip_grad_by_total_norm_fp32", ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer")),
    # tensor_parallel/data.py: ``data[key].cuda()``
    ("broadcast_data", ("megatron.core.tensor_parallel.data", "megatron.core.tensor_parallel")),
)


def _with_cuda_tensor_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cuda_tensor_names():
            return fn(*args, **kwargs)

    return wrapper


def _scope_cuda_tensor_names() -> None:
    """Wrap each of `_CUDA_NAME_METHODS` and `_CUDA_NAME_FUNCTIONS` in `cuda_tensor_names`."""
    for module, cls_name, name in _CUDA_NAME_METHODS:
        cls = getattr(importlib.import_module(module), cls_name)
        attr = cls.__dict__[name]
        if isinstance(attr, classmethod):
            setattr(cls, name, classmethod(_with_cuda_tensor_names(attr.__func__)))
        else:
            setattr(cls, name, _with_cuda_tensor_names(attr))
    for name, modules in _CUDA_NAME_FUNCTIONS:
        wrapped = _with_cuda_tensor_names(getattr(importlib.import_module(modules[0]), name))
        for module in modules:
            setattr(importlib.import_module(module), name, wrapped)


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
    _scope_cuda_tensor_names()

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
    _torch_delta_rule()


def _torch_l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, output_dtype=None) -> torch.Tensor:
    """fla's ``l2norm`` (x / sqrt(sum x^2 + eps) over the last dim) in torch, in fp32."""
    y = x.float() * torch.rsqrt(x.float().pow(2).sum(dim, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def _torch_delta_rule() -> None:
    """ssm/gated_delta_net.py (megatron-core 0.16.1; 0.19.2's gated_delta_net/ package) calls
    flash-linear-attention's Triton kernels (``l2norm``, ``chunk_gated_delta_rule``, from 0.18
    ``causal_conv1d``) and refuses to build a GatedDeltaNet without the package. fla 0.6.0
    launches nothing without a GPU ("0 active drivers", also under ``TRITON_INTERPRET=1``), so on
    the CPU fla is not installed (installed, transformers' Qwen3.5 picks its kernels too and fails
    the same way) and `stapo_megatron.mcore.delta_rule` (the same chunked recurrence in torch,
    vectorised within a chunk, taking fla's varlen ``cu_seqlens``; the module's own
    ``torch_chunk_gated_delta_rule`` stays for comparison), a torch L2 norm and a torch causal
    convolution stand in for them. Each is set in every module the layer reads it from
    (`mcore_versions.delta_net_modules`: 0.19.2's ``gdn.py`` binds the kernel by name at import and
    picks it at construction, so the names must be set before a model is built)."""
    from stapo_megatron.mcore import delta_rule
    from stapo_megatron.mcore.mcore_versions import delta_net_modules, delta_net_takes_packed

    for module in delta_net_modules():
        module.l2norm = _torch_l2norm
        module.chunk_gated_delta_rule = delta_rule.chunk_gated_delta_rule  # the CPU's delta-rule kernel
        module.HAVE_FLA = True
        if delta_net_takes_packed():  # 0.16 and 0.17 convolve with torch's nn.Conv1d without causal_conv1d_fn
            module.causal_conv1d = _torch_causal_conv1d


def _segments(cu_seqlens, total: int) -> list:
    """(start, end) of each non-empty sequence of fla's ``cu_seqlens`` (the whole axis without it)."""
    bounds = [0, total] if cu_seqlens is None else cu_seqlens.tolist()
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _torch_causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None, **kwargs):
    """fla's ``causal_conv1d`` (``fla.modules.convolution``) in torch: the depthwise causal
    convolution of x [B, T, D] with weight [D, W], then SiLU for ``activation`` "silu"/"swish";
    with ``cu_seqlens`` each sequence is convolved alone (zeros before its first token). Returns
    (y [B, T, D], None): megatron-core asks for no final state."""
    assert initial_state is None and not output_final_state and activation in (None, "silu", "swish"), activation
    width = weight.shape[-1]
    outs = [torch.nn.functional.conv1d(torch.nn.functional.pad(x[:, a:b].transpose(1, 2), (width - 1, 0)),
                                       weight.unsqueeze(1), bias, groups=weight.shape[0])
            for a, b in _segments(cu_seqlens, x.shape[1])]
    y = torch.cat(outs, dim=-1).transpose(1, 2)
    return (torch.nn.functional.silu(y) if activation else y), None


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

