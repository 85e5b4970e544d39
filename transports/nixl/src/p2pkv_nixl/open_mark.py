"""The open mark: how a reader on the ``cma`` lane tells that the region it just read was still
its owner's to lend when the read ended.

On ``cma`` the *reader's* process copies the owner's pages (``process_vm_readv``), so nothing
on the owner's side can refuse a read: after the owner's ``close`` its region is its caller's
again (an engine reuses it at once), yet a read posted then still copies it and ends ``DONE``.

So each transport holds an :class:`OpenMark`, an 8-byte word in memory this process never
frees, holding a random nonzero token while the transport is open and 0 from the first step of
its ``close`` on. The address and token travel in the descriptor (with our pid). A reader
whose direct read ended ``DONE`` reads the word (:class:`MarkReader`, one ``process_vm_readv``
of 8 bytes) and reports the read done only if it still holds the token: the word was read
after the data, so the owner had not begun ``close`` when the data was read, and its caller
could not have written the region yet. Otherwise (cleared, another token: the pid now names
another process, or the process is gone) the read fails.

Ordering: the word is read by a system call issued after the read's own copy returned, and the
owner clears it (a plain store) before its ``close`` returns; stores are seen in order on the
platforms UCX's ``cma`` runs on (x86-64 total store order; a system call boundary orders the
reader's loads).

Threading: :class:`OpenMark` may be cleared from any thread; a :class:`MarkReader` belongs to
the thread that polls its transport.
"""

from __future__ import annotations

import ctypes
import itertools
import secrets
import threading

import numpy as np

from p2pkv_nixl.locality import Iovec, process_vm_call

__all__ = ["MarkReader", "OpenMark"]

_ARENA_SLOTS = 4096
_ARENAS: list[np.ndarray] = []
"""Every arena of marks this process made: never freed, so a mark's address never names other
data while the process lives."""
_NEXT_SLOT = itertools.count()
_LOCK = threading.Lock()


class OpenMark:
    """This transport's word: ``token`` while open, 0 once :meth:`clear` ran (final)."""

    __slots__ = ("_arena", "_slot", "token")

    def __init__(self) -> None:
        with _LOCK:
            index = next(_NEXT_SLOT)
            if index // _ARENA_SLOTS == len(_ARENAS):
                _ARENAS.append(np.zeros(_ARENA_SLOTS, dtype=np.uint64))
            self._arena = _ARENAS[index // _ARENA_SLOTS]
        self._slot = index % _ARENA_SLOTS
        self.token = secrets.randbits(64) | 1
        self._arena[self._slot] = self.token

    @property
    def address(self) -> int:
        return int(self._arena.ctypes.data) + 8 * self._slot

    def clear(self) -> None:
        self._arena[self._slot] = 0


_READV = process_vm_call("process_vm_readv")


class MarkReader:
    """Reads one peer's open mark (its pid, the word's address, the token it must hold).
    Built once per peer: :meth:`holds` allocates nothing."""

    __slots__ = ("_local", "_pid", "_remote", "_token", "_word")

    def __init__(self, pid: int, address: int, token: int) -> None:
        self._pid, self._token = pid, token
        self._word = ctypes.c_uint64(0)
        self._local = Iovec(ctypes.cast(ctypes.pointer(self._word), ctypes.c_void_p), 8)
        self._remote = Iovec(address, 8)

    def holds(self) -> bool:
        """Whether the peer's word holds its token now (False if it cannot be read)."""
        if _READV is None:
            return False
        self._word.value = 0
        moved = _READV(self._pid, ctypes.byref(self._local), 1, ctypes.byref(self._remote), 1, 0)
        return bool(moved == 8 and self._word.value == self._token)
