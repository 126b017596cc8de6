"""What differs between the megatron-core releases this package supports (0.16 to 0.19), in one place.

Each difference is an explicit check of ``megatron.core.__version__`` (read with `packaging`),
never a test of upstream source text, with the release that changed it:

- ``router_aux_loss_token_factor``: 0.19.0's ``transformer/moe/router.py``
  (``attach_and_log_load_balancing_loss``) multiplies the per-token aux loss by the TP x CP group
  size; 0.16 to 0.18 do not.
- ``define_missing_te_names``: 0.16's ``transformer/moe/moe_utils.py`` leaves the transformer-engine
  MoE names undefined when transformer-engine does not import (0.17 binds them to None).
- ``delta_net_takes_packed``: 0.18.0's ``ssm/gated_delta_net.py`` runs packed (THD) input itself
  (``cu_seqlens`` into flash-linear-attention's varlen ``causal_conv1d`` and
  ``chunk_gated_delta_rule``), binds its delta-rule kernel at construction
  (``self.gated_delta_rule``) and has context parallelism; 0.16 and 0.17 refuse packed input and
  call the kernels by module name in ``forward``.
- ``delta_net_modules``: 0.19.0 made ``ssm/gated_delta_net.py`` a package (``common.py``: the
  base class, ``l2norm``, ``HAVE_FLA``; ``gdn.py``: ``GatedDeltaNet`` and the kernels it binds),
  each module holding its own references to fla's kernels. Read from the classes' ``__module__``
  (where their methods look names up), not from the version.
- ``delta_net_has_context_parallel``: 0.19.0's ``gated_delta_net/gdn.py`` runs context parallelism
  on packed (THD) input, with the load-balanced split of every sequence (all-to-all to head
  shards, one permutation folding the undoing of the split, conv weights sliced per CP rank).

Also the one use of a private torch call, `in_backward`: torch 2.13 has no public API that tells a
forward run inside a backward pass (activation recomputation) from an ordinary forward.
"""

from __future__ import annotations

import functools

import torch
from packaging.version import Version

ROUTER_TOKEN_FACTOR_SINCE = (0, 19)
"""First megatron-core release whose router pre-multiplies the aux loss by the TP x CP size."""

TE_MOE_NAMES_BOUND_SINCE = (0, 17)
"""First megatron-core release that binds moe_utils' transformer-engine names to None without TE."""

DELTA_NET_PACKED_SINCE = (0, 18)
"""First megatron-core release whose GatedDeltaNet takes packed (THD) input and binds its kernel at construction."""

DELTA_NET_CP_SINCE = (0, 19)
"""First megatron-core release whose GatedDeltaNet the Qwen3.5 model here runs with context parallelism."""

_TE_MOE_NAMES = ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                 "fused_topk_with_score_function", "fused_unpermute")


@functools.lru_cache(maxsize=None)
def mcore_release() -> tuple:
    """(major, minor, patch) of the installed megatron-core; a pre-release (0.19.0rc1) counts as its
    release, since the behaviour changes named here land before the final tag."""
    import megatron.core

    return Version(megatron.core.__version__).release[:3]


def router_aux_loss_token_factor(router) -> int:
    """What megatron-core multiplies the aux loss by per routed token under
    ``calculate_per_token_loss``: 1 up to 0.18, the router's TP x CP group size from 0.19.0
    (``attach_and_log_load_balancing_loss``: ``aux_loss * num_local_tokens * tp_cp_group.size()``)."""
    if mcore_release() >= ROUTER_TOKEN_FACTOR_SINCE:
        return router.tp_cp_group.size()
    return 1


def define_missing_te_names() -> None:
    """megatron-core 0.16 ``transformer/moe/moe_utils.py`` imports ``te_general_gemm`` (and the
    fused MoE kernels) only when transformer-engine imports, yet the router's
    ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None`` unconditionally: without
    transformer-engine (the CPU, or a GPU with a plain pip install) every MoE forward fails with
    NameError. 0.17 and later bind the names to None in that case; this does the same for 0.16.
    Applied with or without CUDA (by `bridge.model.build_gpt_model` for MoE models); it only
    fills names that are missing."""
    if mcore_release() >= TE_MOE_NAMES_BOUND_SINCE:
        return
    from megatron.core.transformer.moe import moe_utils

    if getattr(moe_utils, "HAVE_TE", True):
        return
    for name in _TE_MOE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def delta_net_takes_packed() -> bool:
    """Whether megatron-core's GatedDeltaNet runs packed sequences itself (0.18.0 and later: one
    call over the row, the convolution and the recurrence restarting at each ``cu_seqlens``
    boundary); before 0.18 its forward raises NotImplementedError for ``packed_seq_params``."""
    return mcore_release() >= DELTA_NET_PACKED_SINCE


def delta_net_has_context_parallel() -> bool:
    """Whether Qwen3.5's delta-net layers run with context parallelism here (megatron-core 0.19.0
    and later, `bridge.hybrid.packed_delta_net`): 0.19's GatedDeltaNet takes a packed row split
    over the CP ranks as `batch.context_parallel` splits it (chunks r and 2 CP - 1 - r of every
    sequence, the global ``cu_seqlens``), exchanges it all-to-all for whole sequences of 1 / CP of
    this TP rank's heads (``_build_thd_cp_a2a_perm`` undoes the split in the same permutation),
    convolves them with its CP rank's slice of the conv weights (``get_parameter_local_cp``) and
    runs the delta rule per sequence, then exchanges back. 0.16 and 0.17 have no context
    parallelism; 0.18's is not built on here."""
    return mcore_release() >= DELTA_NET_CP_SINCE


def delta_net_modules() -> tuple:
    """The megatron-core modules whose globals GatedDeltaNet's methods read fla's names from
    (``l2norm``, ``chunk_gated_delta_rule``, ``causal_conv1d``, ``HAVE_FLA``): the module of the
    class and of each megatron-core base it inherits methods from. Up to 0.18 that is
    ``ssm/gated_delta_net.py`` alone; 0.19's package has ``gdn.py`` (``GatedDeltaNet``, which binds
    ``chunk_gated_delta_rule`` by name at import) and ``common.py`` (``_GDNBase``: ``l2norm``, the
    ``HAVE_FLA`` check). A shim that replaces a kernel sets it in each of them."""
    import sys

    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    names = dict.fromkeys(cls.__module__ for cls in GatedDeltaNet.__mro__
                          if cls.__module__.startswith("megatron.core.ssm.gated_delta_net"))
    return tuple(sys.modules[name] for name in names)


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread, i.e. a forward now is
    a recomputation inside backward. torch (checked with 2.13) has no public API for this;
    ``torch._C._current_graph_task_id`` is what torch's own FSDP uses (-1 outside backward)."""
    return torch._C._current_graph_task_id() != -1


def checkpoint_writer_queue():
    """megatron-core's checkpoint-writer results queue (a Manager process started from the
    ``spawn`` context at the first save): ``_get_write_results_queue()`` in 0.16,
    ``get_write_results_queue(mp_mode)`` from 0.17 (0.19.2's ``filesystem_async.py``), both
    caching it in the module's ``_results_queue``."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if mcore_release() >= (0, 17, 0):
        return filesystem_async.get_write_results_queue()
    return filesystem_async._get_write_results_queue()
