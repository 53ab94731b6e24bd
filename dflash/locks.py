"""Exclusive OS locks (flock on a lock file) that one process holds while it writes a folder: a run folder of
`dflash train`, a part of a store being harvested. The kernel drops the lock when the process dies, however it
dies, so a stale lock never blocks a rerun; a second live process is refused with a message naming the holder."""

import errno
import fcntl
import os
import socket
from collections.abc import Callable
from pathlib import Path

from dflash.errors import DflashError

LOCK_FILE = ".lock"


class FileLock:
    """`acquire()` or `with`: the lock on `path`, or DflashError(busy(holder)) when another process holds it.

    `remove`: the lock file is deleted on release (a lock beside a user's file, which should not leave one
    behind). A process that opened the file just before its holder deleted it then holds a lock on a file no one
    else can open, so `acquire` checks that the file it locked is still the one at `path`, and retries if not."""

    def __init__(self, path: Path, busy: Callable[[str], str], remove: bool = False):
        self.path, self.busy, self.remove, self.fd = Path(path), busy, remove, None

    def acquire(self) -> "FileLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while self.fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "an unknown process"
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise DflashError(
                        f"cannot lock {self.path}: {exc.strerror}; check the folder's permissions"
                    ) from None
                raise DflashError(self.busy(holder)) from None
            if self.remove and not _is_file_at(fd, self.path):
                os.close(fd)  # its holder deleted it as we opened it: lock the file now at the path
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
            self.fd = fd
        return self

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


def _is_file_at(fd: int, path: Path) -> bool:
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)
