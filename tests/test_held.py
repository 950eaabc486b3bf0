"""What a jail holds without a name: files only a mapping keeps alive count, named ones do not."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path

import pytest

from appliance.sandbox.held import held_bytes

# unshare(CLONE_FILES) and other processes' descriptors need root: never in the fast tier (tests/tiers.py).
pytestmark = pytest.mark.host

SIZE = 4 * 1024 * 1024
CLONE_FILES = 0x400


LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class Mapping:
    """A shared mapping of a whole descriptor, made with libc's mmap: unlike Python's mmap
    module (which keeps a dup of the descriptor) nothing but the mapping holds the file."""

    def __init__(self, fd: int) -> None:
        addr = LIBC.mmap(None, SIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        self.addr = addr

    def close(self) -> None:
        LIBC.munmap(self.addr, SIZE)


def _mapped(path: Path) -> Mapping:
    """Map a SIZE-byte file with allocated blocks, then close its descriptor: only the map holds it."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, SIZE)
        return Mapping(fd)
    finally:
        os.close(fd)


def test_a_file_only_a_mapping_holds_counts_once_it_has_no_name(tmp_path: Path) -> None:
    dev = os.stat(tmp_path).st_dev
    named = _mapped(tmp_path / "named.bin")
    hidden = _mapped(tmp_path / "hidden.bin")
    try:
        before = held_bytes([os.getpid()], {dev})
        assert before < SIZE  # both still have a name: neither counts
        (tmp_path / "hidden.bin").unlink()
        assert held_bytes([os.getpid()], {dev}) - before >= SIZE
    finally:
        named.close()
        hidden.close()


def test_a_memfd_only_a_mapping_holds_counts(tmp_path: Path) -> None:
    before = held_bytes([os.getpid()], set())
    fd = os.memfd_create("held-test")
    try:
        os.ftruncate(fd, SIZE)
        os.posix_fallocate(fd, 0, SIZE)
        mem = Mapping(fd)
    finally:
        os.close(fd)
    try:
        assert held_bytes([os.getpid()], set()) - before >= SIZE
    finally:
        mem.close()


def test_a_file_held_in_a_threads_own_descriptor_table_counts(tmp_path: Path) -> None:
    """A thread that unshares its descriptor table (CLONE_FILES) holds what it opens in no
    other table: the process's /proc/PID/fd does not list it, so each such table is searched."""
    dev = os.stat(tmp_path).st_dev
    held = threading.Event()
    release = threading.Event()
    errors: list[int] = []

    def hold() -> None:
        if LIBC.unshare(CLONE_FILES) != 0:
            errors.append(ctypes.get_errno())
            held.set()
            return
        fd = os.open(tmp_path / "hidden.bin", os.O_CREAT | os.O_RDWR, 0o600)
        os.posix_fallocate(fd, 0, SIZE)
        os.unlink(tmp_path / "hidden.bin")
        held.set()
        release.wait(30)
        os.close(fd)

    before = held_bytes([os.getpid()], {dev})
    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    try:
        assert held.wait(30) and not errors, errors
        assert not any(
            os.path.realpath(f"/proc/self/fd/{n}").endswith("hidden.bin (deleted)")
            for n in os.listdir("/proc/self/fd")
        ), "the file is in the process's own table: the test proves nothing"
        assert held_bytes([os.getpid()], {dev}) - before >= SIZE
    finally:
        release.set()
        thread.join(30)
