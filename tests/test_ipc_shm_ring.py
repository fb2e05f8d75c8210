"""ipc.shm_ring: slots, wraparound, stale detection, inline fallback, cross-process use,
and no leaked or prematurely unlinked /dev/shm segments."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ipc import messages as M
from ipc.shm_ring import (
    BlockTooLarge, RingError, ShmRing, StaleSlot, get_block, pack_block, put_block, slot_bytes_for,
    unpack_block,
)

# Spawned children import this module: keep torch out of module level so they start fast.

SHM = Path("/dev/shm")
REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm (Linux)")


def _ours(pids) -> list[str]:
    """Our segments still present: only names made by the given processes count
    (other test runs on the machine may have their own)."""
    prefixes = tuple(f"dovetail-{pid}-" for pid in pids)
    return sorted(p.name for p in SHM.iterdir() if p.name.startswith(prefixes))


@pytest.fixture(autouse=True, scope="module")
def _no_leaks():
    before = set(_ours([os.getpid()]))
    yield
    assert set(_ours([os.getpid()])) - before == set(), "a test leaked a shared-memory segment"


def _exists(name: str) -> bool:
    return (SHM / name).exists()


def test_create_names_and_unlinks():
    ring = ShmRing.create(1024, 3)
    assert ring.name.startswith(f"dovetail-{os.getpid()}-") and _exists(ring.name)
    assert oct((SHM / ring.name).stat().st_mode & 0o777) == oct(0o600)
    assert ring.owner and not ring.closed
    ring.close()
    ring.close()  # idempotent
    assert ring.closed and not _exists(ring.name)
    with pytest.raises(RingError, match="closed"):
        ring.write(np.zeros((1, 1), np.float16))
    with ShmRing.create(1024) as ring2:
        assert _exists(ring2.name)
    assert not _exists(ring2.name)


def test_garbage_collected_owner_unlinks():
    ring = ShmRing.create(64)
    name = ring.name
    del ring
    import gc

    gc.collect()
    assert not _exists(name)


def test_wraparound_many_blocks_all_dtypes():
    import torch

    gen = torch.Generator().manual_seed(0)
    with ShmRing.create(slot_bytes_for(16, 64, "float32"), nslots=3) as writer, ShmRing.attach(writer.name) as reader:
        assert not reader.owner and reader.nslots == 3 and reader.slot_bytes == writer.slot_bytes
        history = []
        for i in range(50):
            dtype = (torch.float16, torch.bfloat16, torch.float32)[i % 3]
            rows = 1 + i % 16
            block = torch.randn(rows, 64, generator=gen).to(dtype)
            ref = writer.write(block)
            assert (ref.seq, ref.slot, ref.rows, ref.cols) == (i + 1, i % 3, rows, 64)
            got = reader.read(ref)
            assert got.dtype == dtype and torch.equal(got.view(torch.uint8), block.view(torch.uint8))
            history.append((ref, block))
        for ref, block in history[-3:]:  # the last nslots blocks are all still readable
            assert torch.equal(reader.read(ref), block)
            assert reader.is_valid(ref)
        # Every older one is detected as overwritten, never returned.
        for ref, _ in history[:-3]:
            assert not reader.is_valid(ref)
            with pytest.raises(StaleSlot, match="overwritten"):
                reader.read(ref)
            with pytest.raises(StaleSlot):
                reader.read_numpy(ref)


def test_numpy_in_and_out_and_bfloat16_bits():
    import torch

    with ShmRing.create(4096, 2) as ring:
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        ref = ring.write(a)
        assert ref.dtype == "float32"
        assert np.array_equal(ring.read_numpy(ref), a)
        assert torch.equal(ring.read(ref), torch.from_numpy(a))
        b = np.linspace(-2, 2, 10, dtype=np.float16).reshape(2, 5)
        assert np.array_equal(ring.read_numpy(ring.write(b)), b)
        t = torch.randn(2, 3).to(torch.bfloat16)
        raw = ring.read_numpy(ring.write(t))
        assert raw.dtype == np.uint16 and np.array_equal(raw, t.view(torch.int16).numpy().view(np.uint16))
        # Non-contiguous input is written in row-major order.
        wide = torch.randn(4, 3)
        assert torch.equal(ring.read(ring.write(wide.t())), wide.t())
        # An empty block is fine.
        ref = ring.write(np.zeros((0, 7), np.float16))
        assert ring.read(ref).shape == (0, 7)


def test_bad_blocks_are_refused():
    import torch

    with ShmRing.create(64) as ring:
        with pytest.raises(ValueError, match="2-D"):
            ring.write(torch.zeros(4))
        with pytest.raises(TypeError, match="dtype"):
            ring.write(torch.zeros(2, 2, dtype=torch.int64))
        with pytest.raises(TypeError, match="dtype"):
            ring.write(np.zeros((2, 2), np.float64))
        with pytest.raises(TypeError):
            ring.write([[1.0]])


def test_oversize_block_raises_and_put_block_falls_back_inline():
    import torch

    with ShmRing.create(slot_bytes_for(4, 8, "float16"), 2) as ring:
        big = torch.randn(5, 8).half()
        with pytest.raises(BlockTooLarge, match="slots hold 64 bytes"):
            ring.write(big)
        small = torch.randn(4, 8).half()
        ref = put_block(ring, small)
        assert isinstance(ref, M.RingRef)
        inline = put_block(ring, big)
        assert isinstance(inline, M.InlineBlock) and len(inline.data) == 80
        assert isinstance(put_block(None, small), M.InlineBlock)
        # Both travel in the same message field and resolve the same way.
        for features, expect in ((ref, small), (inline, big)):
            msg = M.decode(M.encode(M.VerifyResult(seq_id=1, accepted_tokens=[3], accepted_nodes=[0], features=features)))
            assert torch.equal(get_block(msg.features, {ring.name: ring}), expect)
            assert torch.equal(get_block(msg.features, ring), expect)
        with pytest.raises(RingError, match="no attached ring"):
            get_block(ref, {})


def test_pack_unpack_block():
    import torch

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        t = torch.randn(3, 5).to(dtype)
        back = unpack_block(pack_block(t))
        assert back.dtype == dtype and torch.equal(back, t)
    a = np.ones((2, 2), np.float32)
    assert torch.equal(unpack_block(pack_block(a)), torch.ones(2, 2))
    with pytest.raises(RingError, match="needs 16 bytes, has 3"):
        unpack_block(M.InlineBlock(rows=2, cols=2, dtype="float32", data=b"abc"))


def test_refs_are_checked_against_the_slot():
    with ShmRing.create(256, 4) as ring:
        ref = ring.write(np.ones((2, 8), np.float16))
        from dataclasses import replace

        with pytest.raises(RingError, match="given to ring"):
            ring.read(replace(ref, ring="dovetail-0-other"))
        with pytest.raises(RingError, match="inconsistent"):
            ring.read(replace(ref, slot=1))
        with pytest.raises(RingError, match="holds \\[2, 8\\] float16"):
            ring.read(replace(ref, rows=1))
        with pytest.raises(RingError, match="holds \\[2, 8\\] float16"):
            ring.read(replace(ref, dtype="bfloat16"))
        with pytest.raises(RingError, match="cannot be in a slot"):
            ring.read(replace(ref, rows=100))
        with pytest.raises(StaleSlot, match="older than"):
            ring.read(replace(ref, seq=ref.seq + 4))  # same slot, a seq not written yet


def test_half_written_slot_is_never_exposed():
    """The writer zeroes the slot's seq before touching the payload: a reader of the
    previous block in that slot sees 'being overwritten', not mixed data."""
    import struct

    from ipc import shm_ring

    with ShmRing.create(64, 1) as ring:
        ref = ring.write(np.ones((1, 4), np.float32))
        header = shm_ring._SEG_HEADER_BYTES
        struct.pack_into("<Q", ring._state.mm, header, 0)  # what write() does first
        with pytest.raises(StaleSlot, match="being overwritten"):
            ring.read(ref)


def test_zero_copy_view_and_close_with_live_view():
    import torch

    ring = ShmRing.create(64, 2)
    reader = ShmRing.attach(ring.name)
    ref = ring.write(torch.full((2, 4), 3.0))
    view = reader.read(ref, copy=False)
    assert torch.equal(view, torch.full((2, 4), 3.0))
    ring.write(torch.full((2, 4), 4.0))
    ring.write(torch.full((2, 4), 5.0))  # slot reused: the view now shows the new block
    assert torch.equal(view, torch.full((2, 4), 5.0))
    npview = reader.read_numpy(ring.write(np.zeros((2, 4), np.float32)), copy=False)
    # Closing while views are alive neither crashes nor unmaps under them.
    reader.close()
    ring.close()
    assert not _exists(ring.name)
    assert float(view.sum()) == 40.0 and float(npview.sum()) == 0.0
    del view, npview


def test_attach_missing_or_foreign_segment():
    with pytest.raises(RingError, match="does not exist"):
        ShmRing.attach(f"dovetail-{os.getpid()}-missing")
    from multiprocessing import shared_memory

    other = shared_memory.SharedMemory(name=f"dovetail-{os.getpid()}-foreign", create=True, size=128)
    try:
        with pytest.raises(RingError, match="not a Dovetail ring"):
            ShmRing.attach(other.name)
    finally:
        other.close()
        other.unlink()


class _FakeCudart:
    def __init__(self, err=0):
        self.err = err
        self.calls = []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size, flags))
        return self.err

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


def test_pin_for_cuda_without_cuda_is_a_no_op():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: pin_for_cuda really pins here")
    with ShmRing.create(64) as ring:
        assert ring.pin_for_cuda() is False and not ring.pinned


def test_pin_for_cuda_registers_whole_segment_and_unregisters_on_close(monkeypatch):
    """The CUDA calls themselves need a GPU; this checks what we hand them (pointer,
    size, flags) and that unregistering happens before the mapping goes."""
    import ctypes

    import torch

    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ShmRing, "_cudart", lambda self: fake)
    ring = ShmRing.create(100, 3)
    mm = ring._state.mm
    anchor = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(anchor)
    del anchor
    assert ring.pin_for_cuda() is True and ring.pinned
    assert ring.pin_for_cuda() is True  # idempotent
    assert fake.calls == [("register", address, len(mm), 0)]
    ring.close()
    assert fake.calls[-1] == ("unregister", address) and len(fake.calls) == 2
    assert mm.closed


def test_pin_for_cuda_failure_is_clear(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ShmRing, "_cudart", lambda self: _FakeCudart(err=1))
    with ShmRing.create(64) as ring:
        with pytest.raises(RingError, match="cudaHostRegister"):
            ring.pin_for_cuda()
        assert not ring.pinned


# --- across processes -----------------------------------------------------------------


def _child(parent_ring: str, refs: list[bytes], conn) -> None:
    """Spawned child: read the parent's blocks, then own a ring and write blocks into it."""
    try:
        reader = ShmRing.attach(parent_ring)
        digests = []
        for data in refs:
            ref = M.decode(data, {M.RingRef})
            digests.append(hashlib.sha256(reader.read_numpy(ref).tobytes()).hexdigest())
        reader.close()
        own = ShmRing.create(slot_bytes_for(16, 256, "float16"), 4)
        rng = np.random.default_rng(1)
        sent = []
        for i in range(4):
            block = rng.standard_normal((16, 256)).astype(np.float16)
            sent.append((M.encode(own.write(block)), hashlib.sha256(block.tobytes()).hexdigest()))
        conn.send(("ok", digests, own.name, sent))
        conn.recv()  # wait until the parent has read them
        own.close()
        conn.send(("closed", own.name))
    except BaseException as exc:  # report, never hang the parent
        conn.send(("error", repr(exc)))
        raise


def test_cross_process_spawn_byte_exact():
    ctx = mp.get_context("spawn")
    rng = np.random.default_rng(0)
    with ShmRing.create(slot_bytes_for(16, 5120, "float16"), 4) as ring:
        blocks = [rng.standard_normal((16, 5120)).astype(np.float16) for _ in range(4)]
        refs = [M.encode(ring.write(b)) for b in blocks]
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(ring.name, refs, child_end), daemon=True)
        proc.start()
        try:
            assert parent_end.poll(60), "child did not answer"
            status, digests, child_ring, sent = parent_end.recv()
            assert status == "ok"
            assert digests == [hashlib.sha256(b.tobytes()).hexdigest() for b in blocks]
            with ShmRing.attach(child_ring) as reader:
                for data, digest in sent:
                    got = reader.read_numpy(M.decode(data))
                    assert hashlib.sha256(got.tobytes()).hexdigest() == digest
            parent_end.send("done")
            assert parent_end.poll(30)
            assert parent_end.recv() == ("closed", child_ring)
            proc.join(30)
            assert proc.exitcode == 0
            # The child unlinked its own ring; the child exiting left ours alone.
            assert not _exists(child_ring)
            assert _exists(ring.name)
            assert np.array_equal(ring.read_numpy(M.decode(refs[-1])), blocks[-1])
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(10)


_ATTACH_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
import numpy as np
from ipc import messages as M
from ipc.shm_ring import ShmRing
ring = ShmRing.attach({name!r})
print(float(ring.read_numpy(M.decode(bytes.fromhex({ref!r}))).sum()))
"""

_NAIVE_SCRIPT = """
from multiprocessing import shared_memory
shm = shared_memory.SharedMemory(name={name!r})  # registers with this process's tracker
shm.close()
"""


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)


def test_unrelated_attaching_process_exit_does_not_unlink():
    """A separate interpreter (its own resource tracker) attaches, reads, exits without
    closing: the owner's segment must survive."""
    with ShmRing.create(64, 2) as ring:
        ref = ring.write(np.full((2, 4), 0.5, np.float32))
        done = _run_python(_ATTACH_SCRIPT.format(repo=str(REPO), name=ring.name, ref=M.encode(ref).hex()))
        assert done.returncode == 0, done.stderr
        assert float(done.stdout) == 4.0
        assert "leaked" not in done.stderr
        assert _exists(ring.name)
        assert np.array_equal(ring.read_numpy(ref), np.full((2, 4), 0.5, np.float32))


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="3.13+ can attach with track=False")
def test_naive_attach_would_unlink_the_owners_segment():
    """The hazard the attach path avoids (so the test above has teeth): on Python < 3.13
    a plain SharedMemory(name) attach in another interpreter unlinks the segment when
    that interpreter exits."""
    ring = ShmRing.create(64, 2)
    try:
        done = _run_python(_NAIVE_SCRIPT.format(name=ring.name))
        assert done.returncode == 0, done.stderr
        assert not _exists(ring.name)
    finally:
        ring.close()  # tolerates the segment being gone already
    assert not _exists(ring.name)
