import errno
import os
import shutil
from pathlib import Path


class DflashError(Exception):
    """A problem with the user's input or environment.

    The message must name the problem and the fix; the CLI prints it and exits with status 2.
    """


def format_size(n: float) -> str:
    """Bytes in the unit that shows them (B to TB, decimal), one decimal: never "0.0 GB" for a few MB."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:,.1f} TB"


def check_not_foreign(folder: Path, is_own, what: str, fix: str) -> None:
    """Refuse a non-empty `folder` that `is_own(folder)` does not take for `what` (a dflash export, a training run),
    listing what it holds: a command never writes among files it did not make."""
    shown = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    if not shown or is_own(folder):
        return
    listing = ", ".join(shown[:8]) + (f" and {len(shown) - 8} more" if len(shown) > 8 else "")
    raise DflashError(f"{folder} is not empty and is not {what} (it holds {listing}); {fix}")


def describe_differences(old: dict, new: dict, old_label: str, new_label: str) -> str:
    """`key: <old_label> X, <new_label> Y; ...` for every key whose value differs, sorted; '' when none does."""
    keys = sorted(key for key in set(old) | set(new) if old.get(key) != new.get(key))
    return "; ".join(f"{key}: {old_label} {old.get(key)!r}, {new_label} {new.get(key)!r}" for key in keys)


# Errors of a full disk or a file-size limit: reported in one line, with nothing half-written left behind.
DISK_ERRORS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def disk_error(exc: OSError, what: str, where: Path, fix: str = "rerun with --resume") -> DflashError:
    """One line for a full disk or a file-size limit, naming the disk (the folder and its free space) and `fix`,
    how the command goes on once there is room."""
    try:
        free = f"{format_size(shutil.disk_usage(where).free)} free"
    except OSError:
        free = "free space unknown"
    return DflashError(
        f"{what}: {os.strerror(exc.errno)} on the disk of {where} ({free}); free space there (or raise the file "
        f"size limit) and {fix}"
    )
