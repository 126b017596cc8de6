"""The engine side of separate placement's weight transfer: the buckets trainer 0 streams
(`stapo_megatron.rollout.remote.RemoteEngine.update_weights`: a manifest on ``Transport.control``,
the bytes on ``Transport.weights``) received on the engine's main thread, the one that runs vLLM,
when the engine reaches the transfer in its command queue, and streamed into the engine's
``load_weights`` as they arrive (`receive_weights`): bucket i + 1 travels while bucket i is
loaded, and bucket i + 2 is not received before bucket i is let go, so the receiver holds at most
two buckets of the transfer, never the whole model (with vLLM's reload, the buckets trainer 0
cuts between reload layers and the layer being materialised: `stapo_megatron.rollout.
weight_buckets`).

Receiving on the main thread's current stream (vLLM's own stream) orders the NCCL receive before
the loads that read the buffer, and a freed buffer is reused only by work queued after them on
the same stream (no ``record_stream``, no device-wide synchronisation); and the weights
communicator never runs beside vLLM's TP communicators (one thread issues both, one after the
other). Why not receive earlier, while the engine still generates: ``docs/design.md``.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from stapo_megatron.rollout.transport import Transport, broadcast_object
from stapo_megatron.rollout.remote import bucket_bytes, unpack_bucket

Named = Tuple[str, torch.Tensor]


def _post(transport: Transport, device: torch.device) -> Optional[tuple]:
    """The next bucket's manifest, and its receive posted into a new buffer on ``device``
    (None: the transfer's end)."""
    manifest = broadcast_object(transport.control)
    if manifest is None:
        return None
    flat = torch.empty(bucket_bytes(manifest), dtype=torch.uint8, device=device)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return manifest, flat, transport.weights.broadcast([flat], options)


def receive_weights(transport: Transport, device: torch.device) -> Iterator[Named]:
    """One transfer's ``(HF name, tensor)`` pairs as they arrive, views into their bucket's
    buffer on ``device`` (`stream_buckets` over the transport's buckets)."""
    return stream_buckets(lambda: _post(transport, device))


def stream_buckets(post: Callable[[], Optional[tuple]]) -> Iterator[Named]:
    """The tensors of the buckets ``post`` delivers (``(manifest, buffer, work)``: the next
    bucket's receive posted into a new buffer, ``work.wait()`` until its bytes are there; None:
    the end), in order. Bucket i + 1 is posted once the consumer has taken bucket i's first tensor
    and asks for the next, and bucket i is let go when bucket i + 1's first tensor is handed out:
    at most two buckets are held here, the one being loaded and the one travelling (vLLM's
    reload keeps more where a layer straddles buckets: `stapo_megatron.rollout.weight_buckets`)."""
    following = post()
    while following is not None:
        manifest, flat, work = following
        following = None
        work.wait()  # NCCL: the current stream waits for the bytes; gloo: they are here
        tensors = unpack_bucket(manifest, flat)
        assert tensors, "trainer 0 sends no empty bucket"
        del flat
        for index, named in enumerate(tensors):
            yield named
            if index == 0:
                following = post()
