"""ipc.shm_ring: slots, wraparound, stale detection, RingRefs carried in messages,
cross-process use, and no leaked or prematurely unlinked /dev/shm segments."""

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
from ipc.codec import decode, encode
from ipc.shm_ring import BlockTooLarge, RingError, ShmRing, StaleSlot, get_block, slot_bytes_for

# Spawned children import this module: keep torch out of module level so they start fast.

SHM = Path("/dev/shm")
REPO = Path(__file__).resolve().parents[2]
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


def _carry(ref: M.RingRef) -> bytes:
    """A RingRef the way it travels: inside a message."""
    return encode(M.VerifyResult(seq_id=1, accepted_tokens=[1], features=ref))


def _uncarry(data: bytes) -> M.RingRef:
    return decode(data, M.FROM_CPU_WORKER).features


def _sha(tensor) -> str:
    """Digest of a tensor's raw bytes (any float dtype, bfloat16 included)."""
    import torch

    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


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
            assert torch.equal(get_block(ref, {reader.name: reader}), block)
        # Every older one is detected as overwritten, never returned, whichever way it is read.
        for ref, _ in history[:-3]:
            with pytest.raises(StaleSlot, match="overwritten"):
                reader.read(ref)
            with pytest.raises(StaleSlot, match="overwritten"):
                reader.read(ref, copy=False)
            with pytest.raises(StaleSlot, match="overwritten"):
                get_block(ref, reader)


def test_numpy_in_torch_out_and_bfloat16_bits():
    import torch

    with ShmRing.create(4096, 2) as ring:
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        ref = ring.write(a)
        assert ref == M.RingRef(ring=ring.name, slot=0, seq=1, rows=3, cols=4, dtype="float32")
        got = ring.read(ref)
        assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(a))
        b = np.linspace(-2, 2, 10, dtype=np.float16).reshape(2, 5)
        ref = ring.write(b)
        assert ref.dtype == "float16"
        got = ring.read(ref)
        assert got.dtype == torch.float16 and np.array_equal(got.numpy(), b)
        # bfloat16 travels bit for bit (compare the raw bits: NaN payloads and -0.0 included).
        t = torch.randn(2, 3).to(torch.bfloat16)
        t[0, 0], t[0, 1] = -0.0, float("nan")
        ref = ring.write(t)
        assert ref.dtype == "bfloat16"
        got = ring.read(ref)
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), t.view(torch.int16))
        assert torch.equal(got[1].float(), t[1].float())
        # Non-contiguous input is written in row-major order.
        wide = torch.randn(4, 3)
        assert torch.equal(ring.read(ring.write(wide.t())), wide.t())
        # An empty block is fine.
        ref = ring.write(np.zeros((0, 7), np.float16))
        assert ring.read(ref).shape == (0, 7) and ring.read(ref).dtype == torch.float16


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


def test_oversize_block_raises_and_leaves_the_ring_alone():
    import torch

    with ShmRing.create(slot_bytes_for(4, 8, "float16"), 2) as ring:
        small = torch.randn(4, 8).half()
        ref = ring.write(small)
        big = torch.randn(5, 8).half()
        with pytest.raises(BlockTooLarge, match="slots hold 64 bytes"):
            ring.write(big)
        with pytest.raises(BlockTooLarge):
            ring.write(torch.randn(4, 8))  # the same shape in float32 is twice the bytes
        # Nothing was written: the earlier block is intact and the next write takes seq 2.
        assert torch.equal(ring.read(ref), small)
        assert ring.write(small).seq == 2


def test_get_block_resolves_a_ref_from_a_message():
    import torch

    with ShmRing.create(slot_bytes_for(4, 8, "float32"), 2) as ring, ShmRing.create(64, 1) as other:
        block = torch.randn(4, 8)
        ref = _uncarry(_carry(ring.write(block)))
        assert isinstance(ref, M.RingRef)
        assert torch.equal(get_block(ref, {ring.name: ring, other.name: other}), block)
        assert torch.equal(get_block(ref, ring), block)
        assert torch.equal(get_block(ref, ring, device="cpu"), block)
        # get_block returns a private copy: later writes to the slot do not show through.
        copy = get_block(ref, ring)
        ring.write(torch.zeros(4, 8))
        ring.write(torch.zeros(4, 8))  # slot of ref reused
        assert torch.equal(copy, block)
        with pytest.raises(StaleSlot):
            get_block(ref, ring)
        with pytest.raises(RingError, match="no attached ring"):
            get_block(ref, {})
        with pytest.raises(RingError, match="no attached ring"):
            get_block(ref, other)  # the wrong ring
        with pytest.raises(RingError, match="no attached ring"):
            get_block(ref, {ref.ring: other})  # filed under the wrong name


def test_refs_are_checked_against_the_slot():
    from msgspec.structs import replace

    with ShmRing.create(256, 4) as ring:
        ref = ring.write(np.ones((2, 8), np.float16))
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
    copy = reader.read(ring.write(torch.zeros(2, 4)))  # slot 1
    ring.write(torch.ones(2, 4))  # slot 0: the view shows it
    zeros = reader.read(ring.write(torch.zeros(2, 4)), copy=False)  # slot 1 again
    assert float(copy.sum()) == 0.0 and float(view.sum()) == 8.0
    ring.write(torch.full((2, 4), 7.0))  # slot 0
    ring.write(torch.full((2, 4), 9.0))  # slot 1: `copy` is private, `zeros` is a view
    assert float(copy.sum()) == 0.0 and float(view.sum()) == 56.0 and float(zeros.sum()) == 72.0
    # Closing while views are alive neither crashes nor unmaps under them.
    reader.close()
    ring.close()
    assert not _exists(ring.name)
    assert float(view.sum()) == 56.0 and float(zeros.sum()) == 72.0
    del view, zeros


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
        digests = [_sha(get_block(_uncarry(data), {reader.name: reader})) for data in refs]
        reader.close()
        own = ShmRing.create(slot_bytes_for(16, 256, "float16"), 4)
        rng = np.random.default_rng(1)
        sent = []
        for _ in range(4):
            block = rng.standard_normal((16, 256)).astype(np.float16)
            sent.append((_carry(own.write(block)), hashlib.sha256(block.tobytes()).hexdigest()))
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
        refs = [_carry(ring.write(b)) for b in blocks]
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
                    assert _sha(reader.read(_uncarry(data))) == digest
            parent_end.send("done")
            assert parent_end.poll(30)
            assert parent_end.recv() == ("closed", child_ring)
            proc.join(30)
            assert proc.exitcode == 0
            # The child unlinked its own ring; the child exiting left ours alone.
            assert not _exists(child_ring)
            assert _exists(ring.name)
            assert np.array_equal(ring.read(_uncarry(refs[-1])).numpy(), blocks[-1])
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(10)


_ATTACH_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
from ipc.codec import decode
from ipc.shm_ring import ShmRing, get_block
ring = ShmRing.attach({name!r})
print(float(get_block(decode(bytes.fromhex({ref!r})).features, ring).sum()))
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
        done = _run_python(_ATTACH_SCRIPT.format(repo=str(REPO), name=ring.name, ref=_carry(ref).hex()))
        assert done.returncode == 0, done.stderr
        assert float(done.stdout) == 4.0
        assert "leaked" not in done.stderr
        assert _exists(ring.name)
        assert np.array_equal(ring.read(ref).numpy(), np.full((2, 4), 0.5, np.float32))


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
