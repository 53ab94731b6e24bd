"""dflash.locks: the lock file a train run, an export or an eval report holds while it writes."""

import errno
import os

import pytest

from dflash import locks
from dflash.errors import DflashError
from dflash.locks import FileLock


@pytest.mark.parametrize("remove", [False, True])
def test_a_full_disk_at_the_lock_write_is_one_line_and_leaves_no_lock_file(tmp_path, monkeypatch, remove):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(locks.os, "pwrite", full)
    path = tmp_path / "run" / ".lock"
    with pytest.raises(DflashError) as refused:
        FileLock(path, lambda holder: f"busy: {holder}", remove=remove).acquire()
    message = str(refused.value)
    assert f"writing the lock file {path} failed: No space left on device on the disk of {path.parent}" in message
    assert "free space there" in message and "\n" not in message
    assert not path.exists()
    monkeypatch.undo()
    with FileLock(path, lambda holder: f"busy: {holder}", remove=remove):  # once there is room, it locks
        assert path.read_text().startswith(f"process {os.getpid()} on ")


def test_sizes_in_messages_are_shown_in_a_unit_that_holds_them():
    from dflash.errors import format_size

    assert [format_size(n) for n in (0, 999, 1000, 123456, 4.2e9, 3e13)] == [
        "0.0 B",
        "999.0 B",
        "1.0 KB",
        "123.5 KB",
        "4.2 GB",
        "30.0 TB",
    ]


def test_a_full_disk_names_the_free_space_that_is_left(tmp_path, monkeypatch):
    from collections import namedtuple

    from dflash import errors

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(errors.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))
    error = errors.disk_error(OSError(errno.ENOSPC, "full"), "writing x failed", tmp_path)
    assert f"on the disk of {tmp_path} (4.1 KB free)" in str(error)
