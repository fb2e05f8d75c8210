"""A GGUF file (llama.cpp's model format) read as hostile input: header, metadata and tensor table,
every field checked against the file's size before anything is allocated for it. Torch-free: the
coordinator reads a GGUF target's config, tokenizer and chat template through this module.

Why not ``gguf.GGUFReader`` (the format's reference reader, whose type tables this module uses):
it trusts the counts and lengths it reads (a crafted count makes it allocate or read past the
end), and it builds a numpy view per metadata value, which took 1.7 s on SmolLM2-135M's 49k-token
vocabulary; this parser takes about a tenth of that. The tests check that both read the same
fields and tensors from the same files.

The file is memory-mapped copy-on-write: tensors are views of the map, read as they are used, and
``release`` drops a tensor's pages once it has been converted, so a load's peak stays near the
converted model's size instead of the model's plus the file's.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from cpu_worker.model.model_dir import GGUF_MAGIC as MAGIC
from cpu_worker.model.model_dir import ModelLoadError

VERSIONS = (2, 3)  # version 1 (32-bit counts) is long gone from llama.cpp too
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_KEY_BYTES = 65535  # the spec's limit on a key's length
MAX_ARRAY_DEPTH = 2  # arrays of arrays exist in the spec; nothing real nests deeper
DEFAULT_ALIGNMENT = 32
# Fixed-size scalar types: (struct format, size).
_SCALARS = {
    GGUFValueType.UINT8: ("<B", 1), GGUFValueType.INT8: ("<b", 1), GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2), GGUFValueType.UINT32: ("<I", 4), GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4), GGUFValueType.BOOL: ("<?", 1), GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8), GGUFValueType.FLOAT64: ("<d", 8),
}
_NUMPY = {GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
          GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
          GGUFValueType.FLOAT32: "<f4", GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
          GGUFValueType.FLOAT64: "<f8"}


class GGUFError(ModelLoadError):
    """A GGUF file that cannot be read: the message names the file and what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table: ``dims`` in GGUF's order (the fastest-varying first, so a
    weight of ``out`` rows of ``in`` values is ``(in, out)``), ``start`` its byte offset in the file."""

    name: str
    dims: tuple[int, ...]
    type: GGMLQuantizationType
    start: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape as torch and numpy index it (``dims`` reversed): a weight is (out, in)."""
        return tuple(reversed(self.dims))

    @property
    def row_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.type]
        return self.dims[0] // block * size


class _Cursor:
    """Bounded reads from the map: every read checks the bytes it needs are there."""

    def __init__(self, view: memoryview, path: Path):
        self.view, self.path, self.at = view, path, 0

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what} (byte {self.at} of {len(self.view)}); not a valid GGUF file")

    def need(self, count: int, what: str) -> None:
        if count < 0 or self.at + count > len(self.view):
            raise self.fail(f"{what} runs past the end of the file")

    def scalar(self, value_type: GGUFValueType, what: str) -> Any:
        fmt, size = _SCALARS[value_type]
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.view, self.at)
        self.at += size
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT32, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT64, what))

    def string(self, what: str, limit: int | None = None) -> str:
        length = self.u64(f"the length of {what}")
        if limit is not None and length > limit:
            raise self.fail(f"{what} is {length} bytes long, more than the {limit} allowed")
        self.need(length, what)
        raw = bytes(self.view[self.at:self.at + length])
        self.at += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def value_type(self, what: str) -> GGUFValueType:
        code = self.u32(f"the type of {what}")
        try:
            return GGUFValueType(code)
        except ValueError:
            raise self.fail(f"{what} has unknown value type {code}") from None


def _value(cursor: _Cursor, value_type: GGUFValueType, what: str, depth: int = 0) -> Any:
    """One metadata value; arrays of numbers come back as numpy arrays."""
    if value_type == GGUFValueType.STRING:
        return cursor.string(what)
    if value_type != GGUFValueType.ARRAY:
        return cursor.scalar(value_type, what)
    if depth >= MAX_ARRAY_DEPTH:
        raise cursor.fail(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH}")
    item_type = cursor.value_type(f"the items of {what}")
    count = cursor.u64(f"the length of {what}")
    # Every item takes at least one byte (a string's length alone takes 8): a count the rest of
    # the file cannot hold is refused before any list of that size is made.
    smallest = 8 if item_type in (GGUFValueType.STRING, GGUFValueType.ARRAY) else _SCALARS[item_type][1]
    cursor.need(count * smallest, f"{what} ({count} items)")
    if item_type in _NUMPY:
        # A copy (bounded by the file's size, checked above): metadata must not pin the map.
        items = np.frombuffer(cursor.view, dtype=_NUMPY[item_type], count=count, offset=cursor.at).copy()
        items.setflags(write=False)  # shared by every GGUFFile of this file (_PARSED)
        cursor.at += count * smallest
        return items
    if item_type == GGUFValueType.STRING:
        return _strings(cursor, count, what)
    return [_value(cursor, item_type, what, depth + 1) for _ in range(count)]


_LENGTH = struct.Struct("<Q")


def _strings(cursor: _Cursor, count: int, what: str) -> list[str]:
    """An array of ``count`` strings, each checked as ``_Cursor.string`` checks one: a vocabulary's
    ~100k tokens and merges in one tight loop (the per-item reads took 1 s of a start-up's parses)."""
    view, at, end = cursor.view, cursor.at, len(cursor.view)
    unpack = _LENGTH.unpack_from
    items = []
    for index in range(count):
        if at + 8 > end:
            cursor.at = at
            raise cursor.fail(f"the length of item {index} of {what} runs past the end of the file")
        (length,) = unpack(view, at)
        at += 8
        if length > end - at:
            cursor.at = at
            raise cursor.fail(f"item {index} of {what} runs past the end of the file")
        try:
            items.append(str(view[at:at + length], "utf-8"))
        except UnicodeDecodeError:
            cursor.at = at
            raise cursor.fail(f"item {index} of {what} is not UTF-8") from None
        at += length
    cursor.at = at
    return items


def _metadata(cursor: _Cursor, count: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for index in range(count):
        key = cursor.string(f"the name of metadata entry {index}", MAX_KEY_BYTES)
        if key in found:
            raise cursor.fail(f"metadata key {key!r} appears twice")
        found[key] = _value(cursor, cursor.value_type(f"metadata {key!r}"), f"metadata {key!r}")
    return found


def _tensor_entry(cursor: _Cursor, index: int) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    """(name, dims, type, offset after the data start) of one tensor-table entry."""
    name = cursor.string(f"the name of tensor {index}", MAX_KEY_BYTES)
    n_dims = cursor.u32(f"the rank of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cursor.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
    dims = tuple(cursor.u64(f"a dimension of tensor {name!r}") for _ in range(n_dims))
    if 0 in dims:
        raise cursor.fail(f"tensor {name!r} has an empty dimension {list(dims)}")
    code = cursor.u32(f"the type of tensor {name!r}")
    try:
        kind = GGMLQuantizationType(code)
    except ValueError:
        raise cursor.fail(f"tensor {name!r} has unknown type {code}") from None
    if kind not in GGML_QUANT_SIZES:
        raise cursor.fail(f"tensor {name!r} has type {kind.name}, which has no known block size")
    return name, dims, kind, cursor.u64(f"the offset of tensor {name!r}")


def _tensor_bytes(cursor: _Cursor, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[kind]
    if dims[0] % block:
        raise cursor.fail(f"tensor {name!r} has rows of {dims[0]} values, not a multiple of {kind.name}'s "
                          f"blocks of {block}")
    count = 1
    for dim in dims:
        count *= dim  # Python integers: a crafted dimension cannot overflow
    return count // block * size


def _alignment(cursor: _Cursor, metadata: dict[str, Any]) -> int:
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise cursor.fail(f"general.alignment {alignment!r} is not a power of two")
    return alignment


def _header(cursor: _Cursor) -> tuple[int, int, int]:
    """(version, tensor count, metadata count), the counts checked against what the file can hold."""
    cursor.need(4, "the magic number")
    magic = bytes(cursor.view[:4])
    if magic != MAGIC:
        raise cursor.fail(f"the magic number is {magic!r}, not {MAGIC!r}")
    cursor.at = 4
    version = cursor.u32("the version")
    if version not in VERSIONS:
        raise cursor.fail(f"GGUF version {version} is not supported (only {', '.join(map(str, VERSIONS))})")
    tensors, keys = cursor.u64("the tensor count"), cursor.u64("the metadata count")
    # The smallest entries: a key (8-byte length, 4-byte type, a 1-byte value), a tensor (8-byte name
    # length, rank, one dimension, type, offset).
    if keys * 13 + tensors * 32 > len(cursor.view) - cursor.at:
        raise cursor.fail(f"{tensors} tensors and {keys} metadata entries cannot fit in a file of this size")
    return version, tensors, keys


@dataclass(frozen=True)
class _Parsed:
    """What ``GGUFFile._read`` makes of a file's header: kept per file (``_PARSED``), read-only."""

    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_start: int
    header_bytes: int  # the header's length and hash: a file changed in place is parsed again
    header_digest: bytes


def _digest(view: memoryview) -> bytes:
    return hashlib.blake2b(view, digest_size=16).digest()  # ~1 ms a MB


# A start opens the same file several times (precision, preflight checks, tokenizer, chat template,
# loading): its header, a vocabulary's ~100k strings, was parsed each time (0.15 s each, 0.9 s of the
# coordinator's start for SmolLM2). Kept per file (device, inode, size) for a few files; used again
# only where the header's bytes hash the same (timestamps are too coarse to tell a rewrite).
_PARSED: dict[tuple[int, int, int], _Parsed] = {}
_PARSED_FILES = 4


class GGUFFile:
    """An opened GGUF file: ``metadata`` {key: value} (arrays of numbers as numpy arrays),
    ``tensors`` {name: TensorInfo} in file order; ``data(name)`` maps a tensor's bytes.
    ``close`` (or a ``with`` block) unmaps the file. The metadata and tensor table of a file opened
    before are the same objects: read them, never change them."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as handle:
                size = handle.seek(0, 2)
                if size == 0:
                    raise GGUFError(f"{self.path} is empty; not a GGUF file")
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
                stat = os.fstat(handle.fileno())
        except OSError as error:
            raise GGUFError(f"cannot read {self.path}: {error.strerror or error}") from None
        self._view = memoryview(self._map)
        key = (stat.st_dev, stat.st_ino, stat.st_size)
        parsed = _PARSED.get(key)
        if parsed is None or _digest(self._view[:parsed.header_bytes]) != parsed.header_digest:
            try:
                parsed = self._read()
            except BaseException:
                self.close()
                raise
            _PARSED.pop(key, None)
            if len(_PARSED) >= _PARSED_FILES:
                del _PARSED[next(iter(_PARSED))]
            _PARSED[key] = parsed
        self.version, self.metadata, self.tensors, self.data_start = (parsed.version, parsed.metadata,
                                                                      parsed.tensors, parsed.data_start)

    def _read(self) -> _Parsed:
        cursor = _Cursor(self._view, self.path)
        version, tensor_count, key_count = _header(cursor)
        metadata = _metadata(cursor, key_count)
        entries = [_tensor_entry(cursor, index) for index in range(tensor_count)]
        alignment = _alignment(cursor, metadata)
        data_start = -(-cursor.at // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, dims, kind, offset in entries:
            if name in tensors:
                raise cursor.fail(f"tensor {name!r} appears twice")
            nbytes = _tensor_bytes(cursor, name, dims, kind)
            start = data_start + offset
            if offset % alignment or start + nbytes > len(self._view):
                raise cursor.fail(f"tensor {name!r} ({nbytes} bytes at data offset {offset}) lies outside the "
                                  f"file or off its {alignment}-byte alignment")
            tensors[name] = TensorInfo(name, dims, kind, start, nbytes)
        return _Parsed(version, metadata, tensors, data_start, cursor.at, _digest(self._view[:cursor.at]))

    def data(self, name: str) -> np.ndarray:
        """A tensor's bytes as uint8 [rows, bytes per row] (1-D tensors: [1, bytes]), a view of the map."""
        info = self.tensors[name]
        rows = info.nbytes // info.row_bytes if info.row_bytes else 0
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.start).reshape(rows, -1)

    def release(self, name: str) -> None:
        """Drop a converted tensor's pages from memory (the file stays mapped: they read again if used)."""
        info = self.tensors[name]
        page = mmap.PAGESIZE
        first = info.start // page * page
        last = -(-(info.start + info.nbytes) // page) * page
        if hasattr(self._map, "madvise") and last > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, min(last, len(self._map)) - first)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def close(self) -> None:
        try:
            self._view.release()
            self._map.close()
        except BufferError:  # a tensor view still uses the map: it closes when that view goes
            pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

