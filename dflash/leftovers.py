"""What a writer killed mid-way leaves: a temporary file or folder beside the one it was writing. Its name ends in
its writer's process and host (`owner_tag`), so that the next run of the operation that owns it removes those of
dead writers (`remove_dead`) and never one that a live process is still writing: the ranks of one harvest, for
one, write the store's shared files at the same time."""

import contextlib
import os
import re
import shutil
import socket
from collections.abc import Iterable
from pathlib import Path

_OWNER = re.compile(r"\.(\d+)(?:@([^@/]+))?$")  # .PID@HOST, or .PID (a name of this host's process)


def owner_tag() -> str:
    """This process, as the last part of a temporary name: PID@HOST."""
    return f"{os.getpid()}@{socket.gethostname()}"


def held_by_live_process(name: str) -> bool:
    """Whether the temporary `name` belongs to a live process. Another host's processes cannot be seen from here:
    its temporaries are left to a rerun there. A name without a tag is an earlier dflash's, taken as dead."""
    owner = _OWNER.search(name)
    if owner is None:
        return False
    if owner[2] is not None and owner[2] != socket.gethostname():
        return True
    try:
        os.kill(int(owner[1]), 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_dead(paths: Iterable[Path]) -> list[Path]:
    """Remove the temporaries among `paths` that no live process holds; returns those removed. One that cannot be
    removed (a read-only folder) is left: it is in the way of nothing."""
    removed = []
    for path in paths:
        if held_by_live_process(path.name):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        if not path.exists():
            removed.append(path)
    return removed
