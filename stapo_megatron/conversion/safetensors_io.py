"""Streaming safetensors I/O: validated lazy reads and a writer that never holds a whole shard.

Reads use plain ``readinto`` on a freshly opened file rather than safetensors' mmap, so
resident memory is exactly the tensors currently alive (mapped file pages would count towards
RSS and stay resident until the mapping closes), and so concurrent writer threads need no lock.

File format (https://github.com/huggingface/safetensors): 8-byte little-endian header length
N, N bytes of JSON ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": ...}``,
then the data; offsets are relative to the end of the header.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Iterable, Optional

import torch

DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
UNSUPPORTED_DTYPES = {
    "F8_E4M3": "FP8 (E4M3)", "F8_E5M2": "FP8 (E5M2)", "F8_E8M0": "FP8 scales (E8M0)", "F4": "FP4",
    "F6_E2M3": "FP6", "F6_E3M2": "FP6", "C64": "complex64", "U16": "uint16", "U32": "uint32", "U64": "uint64",
}
"""safetensors dtypes that are valid but not converted here (a quantised checkpoint needs its
scales applied first: convert the model's bf16 release instead)."""
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a safetensors file."""

    path: str
    """File holding the tensor."""
    dtype: torch.dtype
    """Stored dtype."""
    shape: tuple[int, ...]
    """Stored shape."""
    offset: int
    """Absolute byte offset of the first element in the file."""

    @property
    def nbytes(self) -> int:
        """Size of the stored data."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header; raise ValueError naming the problem."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path}: corrupt safetensors header (declares {n} header bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    infos, data_start, end_max = {}, 8 + n, 0
    for name, entry in header.items():
        stored = entry.get("dtype") if isinstance(entry, dict) else None
        if stored in UNSUPPORTED_DTYPES:
            raise ValueError(
                f"{path}: tensor {name!r} has dtype {stored} ({UNSUPPORTED_DTYPES[stored]}), which is not "
                f"supported: only {', '.join(sorted(DTYPES))} are read (for a quantised checkpoint, "
                "convert the unquantised bf16/fp16 release of the model)")
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: corrupt safetensors header entry {name!r} ({e!r})") from None
        info = TensorInfo(path, dtype, shape, data_start + begin)
        if end - begin != info.nbytes:
            raise ValueError(f"{path}: corrupt header entry {name!r}: {end - begin} bytes for shape {shape} {dtype}")
        infos[name], end_max = info, max(end_max, end)
    if data_start + end_max > size:
        raise ValueError(
            f"{path}: truncated safetensors file: header needs {data_start + end_max} bytes, file has {size}"
        )
    return infos


def index_checkpoint(hf_dir: str) -> dict[str, TensorInfo]:
    """All tensors of an HF folder (sharded with an index, or a single model.safetensors)."""
    index_path = os.path.join(hf_dir, INDEX_NAME)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                index = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{index_path}: not valid JSON ({e})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index_path}: no 'weight_map' object (tensor name -> shard file)")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(hf_dir, SINGLE_NAME)):
        weight_map, files = None, [SINGLE_NAME]
    else:
        raise FileNotFoundError(f"{hf_dir}: neither {INDEX_NAME} nor {SINGLE_NAME} found (only safetensors is read)")
    infos: dict[str, TensorInfo] = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{hf_dir}: shard {name} listed in {INDEX_NAME} is missing")
        infos.update(read_header(path))
    if weight_map is not None:
        missing = sorted(n for n, f in weight_map.items() if n not in infos)
        if missing:
            raise ValueError(f"{hf_dir}: tensors listed in {INDEX_NAME} not found in their shards: {missing[:5]}")
    return infos


def read_rows(info: TensorInfo, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
    """Rows ``[start, stop)`` (first dim) of a stored tensor, read with one ``readinto``."""
    stop = info.shape[0] if stop is None else stop
    row_shape = info.shape[1:]
    out = torch.empty((stop - start, *row_shape), dtype=info.dtype)
    row_bytes = math.prod(row_shape) * out.element_size()
    with open(info.path, "rb") as f:
        f.seek(info.offset + start * row_bytes)
        got = f.readinto(memoryview(out.view(-1).view(torch.uint8).numpy()))
    if got != out.nbytes:
        raise ValueError(f"{info.path}: truncated while reading ({got} of {out.nbytes} bytes)")
    return out


def cast_checked(tensor: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """``tensor.to(dtype)``; raise ValueError naming ``name`` if finite values overflow to inf
    (float16's range ends at 65504, bfloat16's and float32's at ~3.4e38)."""
    out = tensor.to(dtype)
    if dtype == torch.float16 and tensor.dtype != torch.float16:
        overflow = out.isinf() & ~tensor.isinf()
        if overflow.any():
            raise ValueError(
                f"tensor {name}: {int(overflow.sum())} values (largest |x| = {tensor.abs().max().item():.4g}) "
                f"overflow float16 (max 65504); choose --dtype bfloat16 or float32"
            )
    return out


class ShardWriter:
    """Writes one safetensors file whose layout is fixed up front; tensors arrive in pieces.

    Args:
        path: output file.
        entries: (name, dtype, shape) in the order the data will be written.
    """

    def __init__(self, path: str, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        self._sizes = []
        for name, dtype, shape in entries:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._sizes.append((name, nbytes))
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data must start 8-byte aligned
        self.path, self.total = path, offset
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        self._written = 0

    def write(self, piece: torch.Tensor) -> None:
        """Append the bytes of a contiguous piece (a whole tensor or a block of its rows)."""
        piece = piece.contiguous()
        self._file.write(memoryview(piece.view(-1).view(torch.uint8).numpy()))
        self._written += piece.nbytes

    def close(self) -> None:
        """Flush and check that exactly the declared bytes were written."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        assert self._written == self.total, (self.path, self._written, self.total)


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """A whole stored tensor, a 0-d one included."""
    if info.shape:
        return read_rows(info)
    return read_rows(dataclasses.replace(info, shape=(1,))).reshape(())


def copy_tensors(infos: dict[str, TensorInfo], path: str, block_bytes: int = 16 * 2**20) -> None:
    """Write the stored tensors ``infos`` (by name, sorted) verbatim into one safetensors file at
    ``path``: same dtype, shape and bytes, each read in row blocks of about ``block_bytes``."""
    names = sorted(infos)
    writer = ShardWriter(path, [(n, infos[n].dtype, infos[n].shape) for n in names])
    for name in names:
        info = infos[name]
        if not info.shape:
            writer.write(read_tensor(info))
            continue
        step = max(1, block_bytes // max(1, info.nbytes // max(1, info.shape[0])))
        for start in range(0, info.shape[0], step):
            writer.write(read_rows(info, start, min(info.shape[0], start + step)))
    writer.close()
