"""Streaming writer and slice reader for Megatron ``torch_dist`` (dist_checkpointing) checkpoints.

A ``torch_dist`` checkpoint is a PyTorch Distributed Checkpoint (DCP) directory plus
``metadata.json`` (backend name) and ``common.pt`` (non-sharded state). Each Megatron
ShardedTensor is one DCP tensor with its *global* shape, stored as any set of chunks; readers
(megatron-core's loader at any TP/PP, or `read_slice` here) read the overlap they need.

Megatron's own ``dist_checkpointing.save`` needs every tensor in memory at once. Here the DCP
write plan is built from shapes alone and each chunk's data is produced on demand when the
storage writer asks for it (``resolve_data``), so at most one chunk per writer thread is alive.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import signal
import threading
import warnings
from typing import Callable, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException
# Private, but what FileSystemReader.read_data itself uses to torch.load one stored item in place
# (present since torch 2.1).
from torch.distributed.checkpoint.filesystem import _create_file_view
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from stapo_megatron.conversion.safetensors_io import cast_checked
from stapo_megatron.bridge.model import DDP_PREFIX
from stapo_megatron.mcore.checkpoint import read_dcp_metadata

# What megatron.core.dist_checkpointing.save writes for the torch_dist backend (0.16 - 0.19).
BACKEND_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


@dataclasses.dataclass
class Chunk:
    """One stored piece of a global tensor and the function that produces its data."""

    key: str
    """DCP key (Megatron ShardedTensor key)."""
    global_shape: tuple[int, ...]
    """Shape of the whole tensor (with the layer axis for per-layer parameters)."""
    offsets: tuple[int, ...]
    """Position of this chunk in the global tensor."""
    sizes: tuple[int, ...]
    """Shape of this chunk."""
    dtype: torch.dtype
    """Stored dtype (produce() is cast to it)."""
    produce: Callable[[], torch.Tensor]
    """Returns the chunk's data (any shape with ``prod(sizes)`` elements)."""


@dataclasses.dataclass
class BytesObject:
    """A Megatron ShardedObject (stored as torch.save bytes under its unique key)."""

    key: str
    """Unique key, e.g. ``decoder.layers.mlp.linear_fc1._extra_state/shard_3_28``."""
    value: object
    """The object."""


class _StreamingSavePlanner(DefaultSavePlanner):
    """Builds the DCP write plan from `Chunk` descriptions; data is resolved lazily."""

    def __init__(self, chunks: list[Chunk], objects: list[BytesObject], on_chunk: Callable[[int], None]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {(c.key, tuple(c.offsets)): c for c in chunks}
        self._objects = {o.key: o for o in objects}
        self._on_chunk = on_chunk
        self.errors: list[BaseException] = []
        self.num_produced = 0
        self.interrupted = False
        """Set by write_checkpoint's SIGINT handler: every writer thread stops at its next chunk."""

    def create_local_plan(self) -> SavePlan:
        items = []
        for c in self._chunks.values():
            properties = TensorProperties(dtype=c.dtype)
            items.append(WriteItem(
                index=MetadataIndex(c.key, torch.Size(c.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)),
                    properties=properties,
                    size=torch.Size(c.global_shape),
                ),
            ))
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self._objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self._objects[write_item.index.fqn].value, buf)
            buf.seek(0)
            return buf
        chunk = self._chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
        try:
            if self.interrupted:
                raise KeyboardInterrupt
            name = f"{chunk.key} (chunk at {tuple(chunk.offsets)})"
            data = cast_checked(chunk.produce(), chunk.dtype, name).reshape(chunk.sizes)
        except BaseException as e:
            # torch 2.13 FileSystemWriter drops exceptions raised in its extra writer threads
            # and would still write `.metadata`; keep them so write_checkpoint can re-raise.
            self.errors.append(e)
            raise
        self.num_produced += 1
        self._on_chunk(data.nbytes)
        return data


def write_checkpoint(path: str, chunks: list[Chunk], objects: list[BytesObject] = (),
                     common: Optional[dict] = None, thread_count: int = 2,
                     on_chunk: Callable[[int], None] = lambda nbytes: None) -> None:
    """Write a torch_dist checkpoint into the (empty) directory ``path``, chunk by chunk.

    Args:
        chunks: every stored chunk; together they must tile each global tensor exactly.
        objects: ShardedObjects (e.g. the local spec's empty ``_extra_state``).
        common: the common (non-sharded) state dict, ``{}`` for model weights.
        thread_count: writer threads (each writes its own ``__0_<i>.distcp`` file).
        on_chunk: progress callback, called with the byte size of each produced chunk.
    """
    writer = FileSystemWriter(path, single_file_per_rank=True, thread_count=thread_count)
    planner = _StreamingSavePlanner(chunks, list(objects), on_chunk)
    # DCP stores each chunk with torch.save, whose per-record CRC32 took ~35% of hf-to-mcore
    # (benchmarks/bench_conversion.py) and is never read: torch.load does not check zip CRCs
    # (see torch.serialization.set_crc32_options, torch >= 2.6).
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    with contextlib.ExitStack() as stack, warnings.catch_warnings():
        stack.callback(torch.serialization.set_crc32_options, crc)
        stack.enter_context(_stoppable_writer_threads(planner))
        # DCP warns that torch.distributed is uninitialised: a single writer process is intended.
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            dcp_save({}, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as e:
            # the original error, not DCP's wrapper around its traceback: the planner's, else the
            # writer's (e.g. torch.save's RuntimeError on a full disk, which callers name)
            if planner.errors:
                raise planner.errors[0] from None
            originals = [failure[0] for failure in e.failures.values() if isinstance(failure, tuple)]
            if originals and isinstance(originals[0], Exception):
                raise originals[0] from None
            raise
    if planner.errors:
        raise planner.errors[0]
    assert planner.num_produced == len(chunks), (planner.num_produced, len(chunks))
    torch.save(common or {}, os.path.join(path, "common.pt"))
    with open(os.path.join(path, "metadata.json"), "w", encoding="utf-8") as f:
        json.dump(BACKEND_METADATA, f)


@contextlib.contextmanager
def _stoppable_writer_threads(planner: _StreamingSavePlanner):
    """Make Ctrl-C stop every DCP writer thread before the caller cleans up.

    Python delivers SIGINT to the main thread only; torch 2.13's FileSystemWriter does not join
    its extra writer threads when the main thread raises, so they would go on writing into a
    directory being deleted. Here SIGINT only sets ``planner.interrupted`` (each thread then
    raises KeyboardInterrupt at its next chunk), the threads are joined on the way out, and
    their exceptions are kept in ``planner.errors`` instead of printed as thread tracebacks.
    """
    before = set(threading.enumerate())
    in_main = threading.current_thread() is threading.main_thread()
    previous_handler = signal.getsignal(signal.SIGINT) if in_main else None
    previous_hook = threading.excepthook

    def on_sigint(signum, frame):
        planner.interrupted = True

    def keep_thread_error(args):
        if args.thread in before:
            previous_hook(args)
        else:
            planner.errors.append(args.exc_value)

    if in_main:
        signal.signal(signal.SIGINT, on_sigint)
    threading.excepthook = keep_thread_error
    try:
        yield
    finally:
        for t in set(threading.enumerate()) - before:
            t.join()
        threading.excepthook = previous_hook
        if in_main:
            signal.signal(signal.SIGINT, previous_handler)
    if planner.interrupted:
        raise KeyboardInterrupt


def is_complete(path: str) -> bool:
    """A torch_dist checkpoint is complete once DCP's ``.metadata`` (written last) exists."""
    return all(os.path.isfile(os.path.join(path, n)) for n in (".metadata", "metadata.json"))


class _SliceLoadPlanner(LoadPlanner):
    """Reads requested regions of stored tensors into caller-provided tensors."""

    def __init__(self, targets: dict[str, tuple[tuple[int, ...], torch.Tensor]]):
        self._targets = targets  # key -> (offsets in the global tensor, destination)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, (offsets, dest) in self._targets.items():
            md = self.metadata.state_dict_metadata[key]
            items += create_read_items_for_chunk_list(key, md, [ChunkStorageMetadata(torch.Size(offsets), dest.shape)])
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value):
        raise AssertionError("only tensors are read")

    def resolve_tensor(self, read_item):
        dest = self._targets[read_item.dest_index.fqn][1]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item, tensor):
        pass




def model_key_prefix(keys, probe: str = "embedding.word_embeddings.weight") -> str:
    """``""`` or `DDP_PREFIX`: the prefix under which the model tensor ``probe`` is stored."""
    for prefix in ("", DDP_PREFIX):
        if prefix + probe in keys:
            return prefix
    raise ValueError(f"checkpoint has no tensor {probe} (nor {DDP_PREFIX}{probe}): not a GPT model checkpoint")


class CheckpointReader:
    """Reads regions of tensors from a torch_dist checkpoint without loading the rest.

    Model tensors are addressed by their Megatron keys (``decoder.layers...``) whether the
    checkpoint stores them so or under Megatron DDP's ``module.`` prefix (a trainer checkpoint).
    """

    def __init__(self, path: str, probe: Optional[str] = "embedding.word_embeddings.weight"):
        """``probe``: a model tensor the checkpoint must hold (its key tells the prefix); None
        for a checkpoint without the embedding (a LoRA run's adapters only): the prefix is
        DDP's if any stored tensor has it."""
        self.path = path
        self._reader = FileSystemReader(path)
        self.metadata = read_dcp_metadata(path)
        self.metadata.storage_meta.load_id = self._reader.load_id
        self._reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        stored = [k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
        self.key_prefix = (model_key_prefix(stored, probe) if probe
                           else DDP_PREFIX if any(k.startswith(DDP_PREFIX) for k in stored) else "")

    def tensors(self) -> dict[str, TensorStorageMetadata]:
        """Stored tensors by Megatron model key (ShardedObjects and byte items excluded; in a
        DDP-prefixed checkpoint also the optimizer state, whose keys lack the prefix)."""
        p = self.key_prefix
        return {k[len(p):]: v for k, v in self.metadata.state_dict_metadata.items()
                if isinstance(v, TensorStorageMetadata) and k.startswith(p)}

    def row_boundaries(self, key: str) -> list[int]:
        """Dim-0 offsets where stored chunks of ``key`` start, plus the row count."""
        md = self.tensors()[key]
        return sorted({c.offsets[0] for c in md.chunks} | {md.size[0]})

    def read(self, requests: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """Read ``{key: (offsets, sizes)}`` regions; returns ``{key: tensor}`` (possibly views)."""
        out, rest = {}, {}
        for key, (offsets, sizes) in requests.items():
            chunk = self._containing_chunk(key, offsets, sizes)
            if chunk is None:
                rest[key] = (offsets, sizes)
                continue
            # Fast path: the region lies in one stored chunk, which is loaded and narrowed
            # instead of copied into a destination as DCP's read_data does (saves a full copy).
            tensor = self._load_chunk(key, chunk)
            for dim, (start, base, size) in enumerate(zip(offsets, chunk.offsets, sizes)):
                tensor = tensor.narrow(dim, start - base, size)
            out[key] = tensor
        if rest:
            out.update(self._read_via_dcp(rest))
        return out

    def _containing_chunk(self, key, offsets, sizes) -> Optional[ChunkStorageMetadata]:
        for c in self.tensors()[key].chunks:
            if all(co <= o and o + s <= co + cs for o, s, co, cs in zip(offsets, sizes, c.offsets, c.sizes)):
                return c
        return None

    def _load_chunk(self, key: str, chunk: ChunkStorageMetadata) -> torch.Tensor:
        info = self.metadata.storage_data[MetadataIndex(self.key_prefix + key, chunk.offsets)]
        assert not info.transform_descriptors, "compressed/transformed DCP items are not supported"
        path = os.path.join(self.path, info.relative_path)
        with open(path, "rb") as f:
            try:
                return torch.load(_create_file_view(f, info.offset, info.length), map_location="cpu",
                                  weights_only=True)
            except Exception as e:  # a truncated or damaged .distcp file
                raise ValueError(f"{path}: cannot read tensor {key} ({type(e).__name__}: {e}); "
                                 "the file is truncated or damaged") from None

    def _read_via_dcp(self, requests: dict) -> dict[str, torch.Tensor]:
        mds, p = self.tensors(), self.key_prefix
        targets = {p + k: (off, torch.empty(sizes, dtype=mds[k].properties.dtype))
                   for k, (off, sizes) in requests.items()}
        planner = _SliceLoadPlanner(targets)
        planner.set_up_planner({}, self.metadata, True)
        plan = self._reader.prepare_local_plan(planner.create_local_plan())
        try:
            self._reader.read_data(plan, planner).wait()
        except Exception as e:  # a truncated or damaged .distcp file
            raise ValueError(f"{self.path}: cannot read {sorted(requests)} ({type(e).__name__}: {e}); "
                             "a .distcp file is truncated or damaged") from None
        return {k[len(p):]: t for k, (_, t) in targets.items()}
