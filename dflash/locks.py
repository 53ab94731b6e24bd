"""Exclusive OS locks (flock on a lock file) that one process holds while it writes a folder: a run folder of
`dflash train`, a part of a store being harvested. The kernel drops the lock when the process dies, however it
dies, so a stale lock never blocks a rerun; a second live process is refused with a message naming the holder."""

import errno
import fcntl
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from dflash.errors import DISK_ERRORS, DflashError, disk_error

LOCK_FILE = ".lock"
RERUN = "rerun the same command"


class FileLock:
    """`acquire()` or `with`: the lock on `path`, or DflashError(busy(holder)) when another process holds it.

    `remove`: the lock file is deleted on release (a lock beside a user's file, which should not leave one
    behind). A process that opened the file just before its holder deleted it then holds a lock on a file no one
    else can open, so `acquire` checks that the file it locked is still the one at `path`, and retries if not."""

    def __init__(self, path: Path, busy: Callable[[str], str], remove: bool = False):
        self.path, self.busy, self.remove, self.fd = Path(path), busy, remove, None

    def acquire(self) -> "FileLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            while self.fd is None:
                self.fd = self._lock()
        except OSError as exc:  # a full disk, at a run's, an export's or an eval's start: not a traceback
            if exc.errno in DISK_ERRORS:
                raise disk_error(exc, f"writing the lock file {self.path} failed", self.path.parent, RERUN) from None
            raise DflashError(
                f"cannot write the lock file {self.path} ({exc.strerror}); check the folder's permissions and {RERUN}"
            ) from None
        return self

    def _lock(self) -> int | None:
        """The descriptor of the lock file, locked and naming this process; None to try again."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DflashError(f"cannot lock {self.path}: {exc.strerror}; check the folder's permissions") from None
            raise DflashError(self.busy(holder)) from None
        if self.remove and not _is_file_at(fd, self.path):
            os.close(fd)  # its holder deleted it as we opened it: lock the file now at the path
            return None
        holder = f"process {os.getpid()} on {socket.gethostname()}\n".encode()
        try:  # written over the last holder's line, then cut to it: never an empty file while held
            os.pwrite(fd, holder, 0)
            os.ftruncate(fd, len(holder))
        except OSError:
            self.path.unlink(missing_ok=True)  # an empty lock file names no holder; held, so no one else's
            os.close(fd)
            raise
        return fd

    def release(self) -> None:
        if self.fd is not None:
            if self.remove:
                self.path.unlink(missing_ok=True)  # while still held: no one locks it between unlink and close
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None

    def __enter__(self) -> "FileLock":
        return self.acquire()

    def __exit__(self, *_exc) -> None:
        self.release()


def _holder(fd: int) -> str:
    """The holder's line; a lock taken a moment ago may not name it yet (its holder writes it right after)."""
    for _ in range(50):
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.002)
    return "an unknown process"


def _is_file_at(fd: int, path: Path) -> bool:
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)
