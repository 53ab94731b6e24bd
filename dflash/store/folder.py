"""The checks of a harvest's output folder before anything is written: what it holds (a new, resumable or complete
store of this fingerprint, or something else), whether it can be written, and the lock of the part a process
harvests."""

import errno
import hashlib
import json
import logging
import uuid
from pathlib import Path

from dflash.errors import DflashError, describe_differences
from dflash.locks import LOCK_FILE, FileLock
from dflash.manifest import (
    FORMAT_VERSION,
    Manifest,
)
from dflash.store.bookkeeping import (
    FINGERPRINT_BEFORE,
    HARVEST_FILE,
    MANIFEST_FILE,
    PROJECTION,
    TMP_PREFIX,
    part_name,
    read_json,
    read_manifest,
)

logger = logging.getLogger("dflash")


def check_folder(out: Path, fingerprint: dict) -> str:
    """Classify `out` for a harvest of this `fingerprint`, writing nothing: 'new', 'resume' or 'complete'.

    Refuses a folder with other content and a store made with a different fingerprint (naming the fields).
    """
    if not out.exists():
        return "new"
    if not out.is_dir():
        raise DflashError(f"--out {out} is a file, not a folder; choose a new or empty folder")
    raw = read_json(out / HARVEST_FILE)
    if raw is None:  # a harvest stopped before harvest.json may have left its calibration and part locks
        others = sorted(
            p.name
            for p in out.iterdir()
            if not p.name.startswith(TMP_PREFIX) and p.name != PROJECTION and not (p.name == "parts" and _only_locks(p))
        )
        if others:
            shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
            raise DflashError(
                f"--out {out} holds other content ({shown}) and is not a dflash store; choose a new or empty folder"
            )
        _check_unclaimed_projection(out, fingerprint)
        return "new"
    if not isinstance(raw, dict):
        raise DflashError(f"{out / HARVEST_FILE} is damaged (not a JSON object); restore it, or start in a new folder")
    existing = Manifest.from_json(raw, str(out / HARVEST_FILE))  # first: a newer format's message is inspect's
    if existing.format_version != FORMAT_VERSION:
        raise DflashError(
            f"{out} is a dflash store of format version {existing.format_version}, this dflash writes "
            f"version {FORMAT_VERSION}; harvest into a new folder"
        )
    old, new = ({**FINGERPRINT_BEFORE, **f} for f in (existing.fingerprint, fingerprint))
    details = describe_differences(old, new, "store has", "this run")
    if (
        details
        and set(old) | set(new) == set(old) & set(new)
        and [key for key in old if old[key] != new[key]] == ["weights_sha256"]
    ):
        raise DflashError(
            f"the target's weights at {new.get('model')} changed since {out} was started (same config.json, other "
            f"safetensors content: weights_sha256 {old['weights_sha256'][:12]}, now {new['weights_sha256'][:12]}); "
            "resuming would mix two models in one store: restore the checkpoint the store was started with, or "
            "harvest into a new --out folder"
        )
    if details:
        raise DflashError(
            f"{out} holds a harvest made with different settings ({details}); rerun with the store's settings "
            f"to resume it, or choose a new --out folder"
        )
    if not (out / MANIFEST_FILE).exists():
        return "resume"
    try:
        complete = read_manifest(out / MANIFEST_FILE).complete
    except DflashError as exc:  # rebuilt from harvest.json and the parts' progress by finishing again
        complete = False
        logger.warning("%s; rewriting it from %s and the parts' progress", exc, HARVEST_FILE)
    return "complete" if complete else "resume"


def _check_unclaimed_projection(out: Path, fingerprint: dict) -> None:
    """A projection without harvest.json is the calibration of a harvest stopped before its first row: refuse it
    unless it was made for this harvest's settings (a harvest of no subspace would leave it lying in the store)."""
    try:
        made_for = json.loads((out / PROJECTION / "zarr.json").read_text())["attributes"].get("fingerprint_sha256")
    except FileNotFoundError:
        return
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        made_for = None  # damaged: a resume of the same settings recomputes it (harvest._projection_damaged)
    ours = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
    if made_for not in (ours, None) or (made_for is None and not fingerprint.get("subspace")):
        raise DflashError(
            f"{out} holds the projection of a harvest with other settings that stopped before writing {HARVEST_FILE}"
            f" (no row uses it; this harvest {'has another --subspace' if fingerprint.get('subspace') else 'stores no subspace'}); "
            f"delete {out / PROJECTION} and rerun, or choose a new --out (ranks of one harvest must all run the same "
            "command)"
        )


def _only_locks(folder: Path) -> bool:
    return folder.is_dir() and all(p.is_dir() or p.name == LOCK_FILE for p in folder.rglob("*"))


def nearest_existing(path: Path) -> Path:
    """`path` if it exists, else the nearest folder above it that does: where it would be created, on its disk."""
    return next(p for p in (path, *path.parents) if p.exists() or p == p.parent)


def check_writable(out: Path, option: str = "--out") -> None:
    """Refuse, before any work, an output that cannot be written: create and remove a file in it (or in the
    nearest folder above it that exists, where it would be created)."""
    existing = nearest_existing(out)
    if existing == out and not out.is_dir():
        raise DflashError(f"{option} {out} is a file, not a folder; choose a new or empty folder")
    probe = existing / f"{TMP_PREFIX}probe-{uuid.uuid4().hex}"
    try:
        probe.open("x").close()
        probe.unlink()
    except OSError as exc:
        why = "is on a read-only file system" if exc.errno == errno.EROFS else f"is not writable ({exc.strerror})"
        raise DflashError(
            f"{option} {out}: {existing} {why}; choose a writable folder (or fix its permissions) and rerun"
        ) from None


def part_lock(out: Path, rank: int) -> FileLock:
    """The part's lock, held by the process harvesting it (`with`): a second harvest of the same rank into the same
    store is refused, naming the process that holds it, instead of deleting its files."""
    path = out / "parts" / part_name(rank) / LOCK_FILE
    return FileLock(
        path,
        lambda holder: (
            f"part {part_name(rank)} of {out} is being harvested right now by {holder} (it holds "
            f"{path}); let that run finish, or stop it and rerun this command, which resumes the part"
        ),
    )
