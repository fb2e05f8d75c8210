"""Noticing that a ROUTER's peer disconnected, without libzmq's draft API.

libzmq can announce a disconnect to a ROUTER (``ZMQ_ROUTER_NOTIFY``), but that option is part
of the draft API, which the libzmq bundled with pyzmq is built without (setting it fails with
EINVAL). What every build offers: each received message names the file descriptor of the
connection it came on (``ZMQ_SRCFD``). A peer's connection is gone once that descriptor is
closed, or is now a different socket (descriptors are reused; socket inodes are not while the
old one is open and are handed out in increasing order), so :class:`PeerWatch` remembers
(fd, inode) per peer at its latest message and compares later. inproc:// peers have no
descriptor and are never reported gone.
"""

from __future__ import annotations

import os

import zmq

# Past this many remembered peers, forget those that are gone (one entry per connection ever seen).
PRUNE_ABOVE = 1024


def _inode(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


class PeerWatch:
    def __init__(self) -> None:
        self._seen: dict[bytes, tuple[int, int]] = {}
        self._prune_at = PRUNE_ABOVE

    def saw(self, peer: bytes, frame: zmq.Frame) -> None:
        """A message from ``peer`` arrived in ``frame``: remember its connection."""
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError:
            return
        if not isinstance(fd, int) or fd < 0:
            return
        inode = _inode(fd)
        if inode is None:  # closed already: the peer sent and left
            self._seen[peer] = (fd, -1)
            return
        self._seen[peer] = (fd, inode)
        if len(self._seen) > self._prune_at:
            for gone in [p for p in self._seen if self.gone(p)]:
                del self._seen[gone]
            self._prune_at = max(PRUNE_ABOVE, 2 * len(self._seen))

    def gone(self, peer: bytes) -> bool:
        """True once the connection ``peer`` last sent on is closed; False when unknown."""
        seen = self._seen.get(peer)
        if seen is None:
            return False
        fd, inode = seen
        return inode == -1 or _inode(fd) != inode

    def forget(self, peer: bytes) -> None:
        self._seen.pop(peer, None)

    def __len__(self) -> int:
        return len(self._seen)
