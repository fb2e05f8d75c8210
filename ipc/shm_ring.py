"""Shared-memory rings for hidden-state blocks.

A ring is one POSIX shared-memory segment (``/dev/shm/dovetail-<pid>-<random>``) of
``nslots`` fixed-size slots. A writer puts a [rows, cols] float16/bfloat16/float32 block
into the next slot (wrapping around) and gets a :class:`~ipc.messages.RingRef`, which
travels in a ZMQ control message; the reader resolves the RingRef to a tensor.

Rules:

- **One owner.** :meth:`ShmRing.create` makes the segment; that object unlinks it in
  :meth:`close` (or at garbage collection / interpreter exit, or, if the process dies,
  through multiprocessing's resource tracker as a last resort). Every other process uses
  :meth:`ShmRing.attach`, which maps the segment *without* registering it with the
  resource tracker: on Python 3.11/3.12 ``SharedMemory(name)`` registers on attach, and
  the attaching process's tracker then unlinks the owner's segment when that process
  exits. (3.13 added ``track=False``; the low-level attach here works on all versions.)
  Close and unlink are idempotent.
- **One writer, one reader per ring**, with at most ``nslots`` blocks in flight: a
  reader that falls further behind finds its slot reused and gets :class:`StaleSlot`
  (never wrong data).
- **Sequence numbers.** Each write gets the next sequence number (1, 2, ...; slot =
  (seq - 1) % nslots). The slot header's seq is set to 0 ("being written") first,
  then the payload and shape are written, then the seq LAST. A reader checks the seq
  in the RingRef against the slot header before reading and, for copies, again after
  copying, so a half-written or overwritten slot is never returned silently. The
  ZMQ message that carries the RingRef orders the writer's stores before the reader's
  loads (socket system calls are full barriers).
- **Too big:** a block larger than ``slot_bytes`` raises :class:`BlockTooLarge`. Hidden
  states never travel inline: size the ring for the largest block it must carry (the
  coordinator keeps one ring for the cycle's few rows and one for a whole prompt's).
- **Reads:** :meth:`ShmRing.read` returns a torch tensor, a private copy by default;
  ``copy=False`` returns a zero-copy view of the slot that is valid only until the
  writer reuses the slot (``nslots`` writes later) and keeps the mapping alive.
- **Pinned memory:** :meth:`ShmRing.pin_for_cuda` registers the whole segment as
  page-locked with ``cudaHostRegister`` so host-to-device copies are DMA; a no-op
  returning False without CUDA. The registration is undone before the mapping closes.

Data are raw little-endian, row-major.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import struct
import sys
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from ipc.dtypes import dtype_name, torch_dtype
from ipc.messages import RingRef

try:  # POSIX only, like multiprocessing.shared_memory itself
    import _posixshmem
except ImportError:  # pragma: no cover
    _posixshmem = None

SEGMENT_PREFIX = "dovetail"
MAGIC = b"DVTLRNG1"
_SEG_HEADER = struct.Struct("<8sIIQQ")  # magic, nslots, reserved, slot_bytes, stride
_SEG_HEADER_BYTES = 64
_WRITE_SEQ_OFFSET = 32  # u64: the last sequence number written
_SLOT_HEADER = struct.Struct("<QQIII")  # seq, nbytes, rows, cols, dtype code
_SLOT_HEADER_BYTES = 64
_U64 = struct.Struct("<Q")

# name -> (code, itemsize, numpy dtype for the raw payload)
DTYPES: dict[str, tuple[int, int, np.dtype[Any]]] = {
    "float16": (1, 2, np.dtype("<f2")),
    "bfloat16": (2, 2, np.dtype("<u2")),  # raw bits in numpy
    "float32": (3, 4, np.dtype("<f4")),
}
_CODE_TO_DTYPE = {code: name for name, (code, _, _) in DTYPES.items()}


class RingError(RuntimeError):
    """Base class of ring errors."""


class BlockTooLarge(RingError):
    """The block does not fit in one slot."""


class StaleSlot(RingError):
    """The slot no longer (or not yet) holds the block a RingRef points at."""


def _torch():
    import torch

    return torch


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def cycle_slots(max_sequences: int) -> int:
    """Slots of the cycle ring: a verification's feature rows stay in theirs until the draft
    reads them, and a batch of ``max_sequences`` writes that many before any is read."""
    return max(4, 2 * max_sequences)


def slot_bytes_for(rows: int, cols: int, dtype: str = "float16") -> int:
    """Payload bytes of a [rows, cols] block."""
    return rows * cols * DTYPES[dtype][1]


def _describe_block(block):
    """(rows, cols, dtype name, kind) of a 2-D torch tensor or numpy array."""
    if isinstance(block, np.ndarray):
        name = block.dtype.name if block.dtype.isnative and block.dtype.name in ("float16", "float32") else None
        if name is None:
            raise TypeError(f"numpy block dtype must be native float16 or float32, got {block.dtype}")
        kind = "numpy"
    else:
        torch = _torch()
        if not isinstance(block, torch.Tensor):
            raise TypeError(f"a block is a torch tensor or a numpy array, got {type(block).__name__}")
        try:
            name = dtype_name(block.dtype)
        except ValueError as error:
            raise TypeError(f"tensor block dtype: {error}") from None
        kind = "torch"
    if block.ndim != 2:
        raise ValueError(f"a block is a 2-D [rows, cols] matrix, got shape {tuple(block.shape)}")
    rows, cols = (int(d) for d in block.shape)
    return rows, cols, name, kind


def _raw_bytes_source(block, kind):
    """A flat uint8 view of the block's bytes (a copy only if it is not contiguous)."""
    if kind == "numpy":
        return np.ascontiguousarray(block).reshape(-1).view(np.uint8)
    torch = _torch()
    flat = block.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


class _State:
    """What must be released when the ring goes away (shared with the finalizer)."""

    def __init__(self, name: str, owner: bool, mm: mmap.mmap):
        self.name = name
        self.owner = owner
        self.mm = mm
        self.pinned: tuple[Any, int] | None = None  # (cudart, ptr) while registered with CUDA
        self.closed = False


def _release(state: _State) -> None:
    if state.closed:
        return
    state.closed = True
    if state.pinned is not None:
        cudart, ptr = state.pinned
        state.pinned = None
        try:
            cudart.cudaHostUnregister(ptr)
        except Exception:
            pass
    try:
        state.mm.close()
    except BufferError:
        # A zero-copy view handed out by read(copy=False) is still alive: the mapping
        # goes when the last view does. Unlinking below still removes the name.
        pass
    if state.owner:
        try:
            _posixshmem.shm_unlink("/" + state.name)
        except FileNotFoundError:
            pass
        from multiprocessing import resource_tracker

        try:
            resource_tracker.unregister("/" + state.name, "shared_memory")
        except Exception:
            pass


class ShmRing:
    """A ring of fixed-size slots in one shared-memory segment. See the module doc."""

    def __init__(self, state: _State, nslots: int, slot_bytes: int, stride: int):
        self._state = state
        self.name = state.name
        self.owner = state.owner
        self.nslots = nslots
        self.slot_bytes = slot_bytes
        self._stride = stride
        self._finalizer = weakref.finalize(self, _release, state)

    # --- lifecycle --------------------------------------------------------------------

    @classmethod
    def create(cls, slot_bytes: int, nslots: int = 4, *, prefix: str = SEGMENT_PREFIX) -> ShmRing:
        """Create (and own) a ring of ``nslots`` slots of ``slot_bytes`` payload bytes."""
        if _posixshmem is None:  # pragma: no cover
            raise RingError("shared-memory rings need a POSIX system")
        if nslots < 1 or slot_bytes < 1:
            raise ValueError("a ring needs at least one slot of at least one byte")
        stride = _align(_SLOT_HEADER_BYTES + slot_bytes, 64)
        size = _SEG_HEADER_BYTES + nslots * stride
        for _ in range(16):
            name = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
                break
            except FileExistsError:
                continue
        else:  # pragma: no cover
            raise RingError("could not find a free shared-memory name")
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            _posixshmem.shm_unlink("/" + name)
            raise
        os.close(fd)
        # Last-resort cleanup if this process dies without closing: the resource tracker
        # (shared with spawn children) unlinks what is still registered when it exits.
        from multiprocessing import resource_tracker

        resource_tracker.register("/" + name, "shared_memory")
        _SEG_HEADER.pack_into(mm, 0, MAGIC, nslots, 0, slot_bytes, stride)
        _U64.pack_into(mm, _WRITE_SEQ_OFFSET, 0)
        return cls(_State(name, True, mm), nslots, slot_bytes, stride)

    @classmethod
    def attach(cls, name: str) -> ShmRing:
        """Map an existing ring without owning it (and without resource tracking)."""
        if _posixshmem is None:  # pragma: no cover
            raise RingError("shared-memory rings need a POSIX system")
        name = name.lstrip("/")
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            raise RingError(f"shared-memory ring {name!r} does not exist (closed by its owner?)") from None
        try:
            size = os.fstat(fd).st_size
            if size < _SEG_HEADER_BYTES:
                raise RingError(f"{name!r} is not a Dovetail ring (only {size} bytes)")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, nslots, _, slot_bytes, stride = _SEG_HEADER.unpack_from(mm, 0)
        if magic != MAGIC or _SEG_HEADER_BYTES + nslots * stride > size:
            mm.close()
            raise RingError(f"{name!r} is not a Dovetail ring (bad header)")
        return cls(_State(name, False, mm), nslots, slot_bytes, stride)

    def close(self) -> None:
        """Unpin, unmap and (owner only) unlink. Idempotent."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._state.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        role = "owner" if self.owner else "attached"
        return f"ShmRing({self.name!r}, {self.nslots} x {self.slot_bytes} B, {role}{', closed' if self.closed else ''})"

    def _mm(self) -> mmap.mmap:
        if self._state.closed:
            raise RingError(f"ring {self.name!r} is closed")
        return self._state.mm

    # --- writing ----------------------------------------------------------------------

    def write(self, block) -> RingRef:
        """Copy a 2-D block (torch tensor on any device, or numpy array) into the next
        slot; return its RingRef. BlockTooLarge if it does not fit in a slot."""
        rows, cols, dtype, kind = _describe_block(block)
        code, itemsize, _ = DTYPES[dtype]
        nbytes = rows * cols * itemsize
        if nbytes > self.slot_bytes:
            raise BlockTooLarge(
                f"block [{rows}, {cols}] {dtype} is {nbytes} bytes; ring {self.name!r} slots hold "
                f"{self.slot_bytes} bytes"
            )
        mm = self._mm()
        (last,) = _U64.unpack_from(mm, _WRITE_SEQ_OFFSET)
        seq = last + 1
        slot = (seq - 1) % self.nslots
        header = _SEG_HEADER_BYTES + slot * self._stride
        payload = header + _SLOT_HEADER_BYTES
        _U64.pack_into(mm, header, 0)  # busy: readers of the old block see it is gone
        if nbytes:
            src = _raw_bytes_source(block, kind)
            if kind == "numpy":
                np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=payload)[:] = src
            else:
                torch = _torch()
                torch.from_numpy(np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=payload)).copy_(src)
        _SLOT_HEADER.pack_into(mm, header, 0, nbytes, rows, cols, code)
        _U64.pack_into(mm, header, seq)  # LAST: the slot is now valid
        _U64.pack_into(mm, _WRITE_SEQ_OFFSET, seq)
        return RingRef(ring=self.name, slot=slot, seq=seq, rows=rows, cols=cols, dtype=dtype)

    # --- reading ----------------------------------------------------------------------

    def _locate(self, ref: RingRef) -> tuple[int, int]:
        """Check ``ref`` against this ring and its slot header; (payload offset, nbytes)."""
        if ref.ring != self.name:
            raise RingError(f"RingRef for ring {ref.ring!r} given to ring {self.name!r}")
        if ref.dtype not in DTYPES:
            raise RingError(f"RingRef dtype {ref.dtype!r} unknown")
        if not 0 <= ref.slot < self.nslots or ref.seq < 1 or (ref.seq - 1) % self.nslots != ref.slot:
            raise RingError(f"RingRef slot {ref.slot} / seq {ref.seq} is inconsistent "
                            f"with a ring of {self.nslots} slots")
        code, itemsize, _ = DTYPES[ref.dtype]
        nbytes = ref.rows * ref.cols * itemsize
        if nbytes > self.slot_bytes:
            raise RingError(f"RingRef block of {nbytes} bytes cannot be in a slot of {self.slot_bytes}")
        mm = self._mm()
        header = _SEG_HEADER_BYTES + ref.slot * self._stride
        seq, h_nbytes, rows, cols, h_code = _SLOT_HEADER.unpack_from(mm, header)
        self._check_seq(ref, seq)
        if (h_nbytes, rows, cols, h_code) != (nbytes, ref.rows, ref.cols, code):
            raise RingError(
                f"slot {ref.slot} of ring {self.name!r} holds [{rows}, {cols}] {_CODE_TO_DTYPE.get(h_code)}, "
                f"the RingRef says [{ref.rows}, {ref.cols}] {ref.dtype}"
            )
        return header + _SLOT_HEADER_BYTES, nbytes

    def _check_seq(self, ref: RingRef, seq: int | None = None) -> None:
        if seq is None:
            (seq,) = _U64.unpack_from(self._mm(), _SEG_HEADER_BYTES + ref.slot * self._stride)
        if seq == ref.seq:
            return
        where = f"slot {ref.slot} of ring {self.name!r}"
        if seq == 0:
            raise StaleSlot(f"{where} is being overwritten (wanted seq {ref.seq}): "
                            f"the reader fell {self.nslots} blocks behind")
        if seq > ref.seq:
            raise StaleSlot(f"{where} was overwritten: holds seq {seq}, wanted {ref.seq} "
                            f"(more than {self.nslots} blocks in flight)")
        raise StaleSlot(f"{where} holds seq {seq}, older than the wanted {ref.seq}: "
                        "stale RingRef from another ring instance?")

    def read(self, ref: RingRef, *, copy: bool = True, device=None):
        """The block as a [rows, cols] torch tensor.

        copy=True (default): a private CPU tensor (or on ``device``, e.g. "cuda", copied
        straight from the (pinned) slot); the seq is checked before and after the copy.
        copy=False: a zero-copy view of the slot, valid only until the writer reuses the
        slot (``nslots`` writes later); it keeps the mapping alive while it exists.
        """
        torch = _torch()
        offset, nbytes = self._locate(ref)
        tdtype = torch_dtype(ref.dtype)
        if nbytes == 0:
            return torch.empty((ref.rows, ref.cols), dtype=tdtype, device=device)
        # Through numpy, not torch.frombuffer: a numpy array holds a buffer export on the
        # mmap, so the mapping cannot be unmapped under a live zero-copy view (close()
        # then leaves the unmapping to the view's garbage collection).
        raw = np.frombuffer(self._mm(), dtype=DTYPES[ref.dtype][2], count=ref.rows * ref.cols, offset=offset)
        view = torch.from_numpy(raw).view(tdtype).view(ref.rows, ref.cols)
        del raw
        if not copy and device is None:
            return view
        if device is not None and torch.device(device).type != "cpu":
            out = view.to(device)  # synchronous copy: done before the seq is checked again
        else:
            out = torch.empty((ref.rows, ref.cols), dtype=tdtype)
            out.copy_(view)
        del view
        self._check_seq(ref)
        return out

    # --- CUDA -------------------------------------------------------------------------

    def _cudart(self):
        return _torch().cuda.cudart()

    def _address(self) -> int:
        anchor = ctypes.c_char.from_buffer(self._mm())
        try:
            return ctypes.addressof(anchor)
        finally:
            del anchor

    def pin_for_cuda(self) -> bool:
        """Register the segment as page-locked memory with CUDA (host-to-device copies
        from it are then DMA). Returns False, doing nothing, when CUDA is unavailable;
        True once pinned (idempotent). Unregistered automatically in close()."""
        if self._state.pinned is not None:
            return True
        if not _torch().cuda.is_available():
            return False
        mm = self._mm()
        cudart = self._cudart()
        ptr = self._address()
        err = cudart.cudaHostRegister(ptr, len(mm), 0)
        if int(err) != 0:
            raise RingError(f"cudaHostRegister of ring {self.name!r} ({len(mm)} bytes) failed: {err}")
        self._state.pinned = (cudart, ptr)
        return True

    @property
    def pinned(self) -> bool:
        return self._state.pinned is not None


def get_block(ref: RingRef, rings: ShmRing | Mapping[str, ShmRing], *, device=None):
    """The block ``ref`` points at, as a private torch tensor (on ``device``), from the ring
    it names (``rings``: one ring, or attached rings by name)."""
    ring = rings if isinstance(rings, ShmRing) else rings.get(ref.ring)
    if ring is None or ring.name != ref.ring:
        raise RingError(f"no attached ring named {ref.ring!r}")
    return ring.read(ref, copy=True, device=device)


if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("ipc.shm_ring assumes a little-endian host")

__all__ = ["ShmRing", "RingError", "BlockTooLarge", "StaleSlot", "SEGMENT_PREFIX", "slot_bytes_for", "get_block"]
