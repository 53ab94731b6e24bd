"""The harvest store's bookkeeping: its file names, its JSON files (written atomically, harvest.json created
exclusively), the agreement of the ranks' headers, and the checks of what must be whole (the store-level arrays,
the chunk files of committed rows). dflash.store builds on it and re-exports its names."""

import hashlib
import json
import os
import uuid
from pathlib import Path

import numpy as np
import zarr

from dflash.errors import DflashError, describe_differences
from dflash.leftovers import owner_tag
from dflash.manifest import Manifest

HARVEST_FILE = "harvest.json"
MANIFEST_FILE = "manifest.json"
PROGRESS_FILE = "progress.json"
PROJECTION = "projection"
DOCUMENT_SOURCES = "document_sources"  # per doc id, its data source: a store of several sources
TMP_PREFIX = ".dflash-tmp-"


def part_name(rank: int) -> str:
    return f"rank{rank:05d}"


def _fsynced_temp(path: Path, obj: dict) -> Path:
    """`obj` as JSON in a new temporary file beside `path`, fsynced: what the writers below put in place."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex}.{owner_tag()}")  # a rerun removes a dead one's
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(obj, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk or a kill leaves no partial temporary behind
        raise
    return tmp


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write through a temporary file, fsync it and rename, so readers, killed writers and a power loss never
    leave half a file."""
    tmp = None
    try:
        tmp = _fsynced_temp(path, obj)
        os.replace(tmp, path)
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def write_json_exclusive(path: Path, obj: dict) -> bool:
    """Create `path` with `obj` unless it exists, atomically (written and fsynced under a temporary name, then
    hard-linked into place, which fails when the name is taken): of several ranks creating it, exactly one wins.
    Returns whether this call created it."""
    tmp = None
    try:
        tmp = _fsynced_temp(path, obj)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def read_json(path: Path) -> dict | None:
    """A JSON file's contents, None when it does not exist; DflashError when it is damaged."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DflashError(f"{path} is damaged ({exc}); restore it, or start again in a new folder") from None


def read_manifest(path: Path) -> Manifest | None:
    """harvest.json or manifest.json at `path`, validated; None when the file does not exist."""
    raw = read_json(path)
    return None if raw is None else Manifest.from_json(raw, str(path))


# Fingerprint fields added after stores were made without them, with the value that matches what those stores did:
# a store begun before deduplication existed kept every record, and resuming it with dedup on would pack other rows.
FINGERPRINT_BEFORE = {"dedup": False}

# Fingerprint fields added after stores were made without them that no value can stand for: a store without one
# is resumed without checking it (its harvest.json records what it recorded).
FINGERPRINT_UNRECORDED = ("weights_sha256",)


def as_recorded(out: Path, fingerprint: dict) -> dict:
    """This run's fingerprint without the FINGERPRINT_UNRECORDED fields that the store at `out` (if any) lacks."""
    try:
        raw = json.loads((out / HARVEST_FILE).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return fingerprint  # no store yet, or a damaged harvest.json: check_folder names it
    recorded = raw.get("fingerprint") if isinstance(raw, dict) else None
    if not isinstance(recorded, dict):
        return fingerprint
    return {k: v for k, v in fingerprint.items() if k not in FINGERPRINT_UNRECORDED or k in recorded}


# The header fields that decide a store's content (dflash.manifest.identity_of): every part is written under them.
CONTENT_KEYS = ("fingerprint", "target", "tokenizer", "features", "codecs", "layer_ids", "token_budget", "teacher")


def header_content(header: Manifest) -> dict:
    """The content-deciding fields of a header, fingerprint fields of older stores filled with what they did."""
    raw = header.header().to_json()
    content = {key: raw.get(key) for key in CONTENT_KEYS}
    content["fingerprint"] = {**FINGERPRINT_BEFORE, **content["fingerprint"]}
    return content


def header_sha256(header: Manifest) -> str:
    """sha256 of `header_content` (canonical JSON): recorded in each part's progress.json by the rank writing it."""
    return hashlib.sha256(
        json.dumps(header_content(header), sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def header_differences(found: dict, ours: dict, found_label: str, our_label: str) -> str:
    """The settings two headers' contents (`header_content`) differ in: the fingerprint fields by name and value,
    the other fields by name; '' when they agree."""
    details = describe_differences(found["fingerprint"], ours["fingerprint"], found_label, our_label)
    others = [key for key in CONTENT_KEYS if key != "fingerprint" and found.get(key) != ours.get(key)]
    return "; ".join(filter(None, [details, *(f"{key} differs" for key in others)]))


def check_header(out: Path, header: Manifest, rank: int) -> None:
    """Refuse to write rank `rank`'s part under `header` unless it is the store's harvest.json: ranks started
    together with other settings (another --data, --subspace, --precision, ...) would make one mixed store."""
    found = read_manifest(out / HARVEST_FILE)
    if found is None:
        raise DflashError(
            f"{out / HARVEST_FILE} disappeared while rank {rank} was harvesting {out}; restore it, or harvest into a "
            "new --out folder"
        )
    details = header_differences(header_content(found), header_content(header), "the store has", f"rank {rank} has")
    if details:
        raise DflashError(
            f"rank {rank} runs with other settings than {out / HARVEST_FILE}, which another rank of this harvest "
            f"wrote ({details}); every rank of a harvest must run the same command but for --rank: stop this rank "
            f"and rerun it with the store's settings (harvest.json's `options`), or harvest into a new --out folder"
        )


def missing_committed_chunks(folder: Path, rows_committed: int, documents: bool = True) -> tuple[int | None, list[str]]:
    """(first row, up to 3 examples) of the chunk files missing among a part's committed rows and its documents
    table; (None, []) when none is. One walk over the chunk folders, no chunk read: a store copied while being
    written can hold a progress.json newer than its chunks."""
    first, examples = None, []
    try:
        arrays = {
            child.name: zarr.open_array(child, mode="r")
            for child in folder.iterdir()
            if (child / "zarr.json").is_file() and not child.name.startswith(TMP_PREFIX)
        }
    except Exception:  # damaged metadata: verify and the reader name it
        return None, []
    for name, array in sorted(arrays.items()):
        if name == "documents" and not documents:
            continue
        present = set()
        for root, _, files in os.walk(folder / name / "c"):
            relative = Path(root).relative_to(folder / name)
            present.update(str(relative / file) for file in files)
        grid = array.cdata_shape
        rows = grid[0] if name == "documents" else min(rows_committed, grid[0])
        for coords in np.ndindex(rows, *grid[1:]):
            key = array.metadata.encode_chunk_key(coords)
            if key not in present:
                row = 0 if name == "documents" else coords[0]
                first = row if first is None else min(first, row)
                if len(examples) < 3:
                    examples.append(f"{name}/{key}")
    return first, examples


PART_COUNTS = ("documents", "tokens", "loss_tokens", "padding_tokens")


def read_progress(path: Path) -> dict | None:
    """A part's progress.json, validated: rows, rows_committed (0..rows) and the part's counts; None if absent."""
    fix = (
        "if the store is complete, rerun the harvest command with --repair, which rewrites it from manifest.json; "
        "otherwise delete it to redo that part, or restore it"
    )
    try:
        raw = read_json(path)
    except DflashError as exc:
        raise DflashError(f"{str(exc).split('; restore it')[0]}; {fix}") from None
    if raw is None:
        return None

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    counts = raw.get("counts") if isinstance(raw, dict) else None
    if (
        not isinstance(raw, dict)
        or not count(raw.get("rows"))
        or not count(raw.get("rows_committed"))
        or raw["rows_committed"] > raw["rows"]
        or not isinstance(counts, dict)
        or sorted(counts) != sorted(PART_COUNTS)
        or not all(count(v) for v in counts.values())
        or not isinstance(raw.get("header_sha256", ""), str)
        or not isinstance(raw.get("fingerprint", {}), dict)
    ):
        raise DflashError(
            f"{path} is damaged or was edited (expected rows, rows_committed <= rows and the counts "
            f"{', '.join(PART_COUNTS)}, all non-negative integers); {fix}"
        )
    return raw


def part_progress(out: Path, world_size: int) -> list[dict | None]:
    return [read_progress(out / "parts" / part_name(rank) / PROGRESS_FILE) for rank in range(world_size)]


def check_parts_agree(out: Path, header: Manifest, progress: list[dict | None], complete: bool = False) -> None:
    """Refuse a mixed store: every part must have been written under the store's header (parts of a dflash that
    did not record theirs are taken as they are). Checked by the finishing step and, for a part put into a
    `complete` store afterwards (copied from another harvest), by every open of it."""
    expected, fingerprint = header_sha256(header), header_content(header)["fingerprint"]
    mixed = [
        (rank, p) for rank, p in enumerate(progress) if p is not None and p.get("header_sha256", expected) != expected
    ]
    if not mixed:
        return
    lines = [
        f"{part_name(rank)} records header_sha256 {p['header_sha256']}, the store's is {expected} ("
        + (describe_differences(fingerprint, p.get("fingerprint", {}), "store has", "part has") or "its header differs")
        + ")"
        for rank, p in mixed
    ]
    ranks = ", ".join(str(rank) for rank, _ in mixed)
    folders = ", ".join(f"parts/{part_name(rank)}" for rank, _ in mixed)
    rerun = f"rerun rank(s) {ranks} with the store's settings (harvest.json's `options`)"
    fix = (
        f"its rows are not this store's: delete those part folders ({folders}) and {MANIFEST_FILE}, then {rerun}, "
        "which harvests them again and completes the store"
        if complete
        else f"no manifest is written: delete those part folders ({folders}) and {rerun}, or harvest into a new "
        "--out folder"
    )
    raise DflashError(
        f"{out} is a mixed store: part(s) written under other settings than its {HARVEST_FILE} ({'; '.join(lines)}); "
        f"{fix}"
    )


def content_sha256(data: np.ndarray) -> str:
    """sha256 of an array's values as C-order bytes of its dtype (little endian): a whole array's checksum."""
    return hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()


def missing_chunks(array: zarr.Array, folder: Path) -> list[str]:
    """The keys of `array`'s chunks that have no file in `folder` (zarr would read them as fill values): one
    listing of the keys, no chunk read."""
    keys = [array.metadata.encode_chunk_key(coords) for coords in np.ndindex(*array.cdata_shape)]
    return [key for key in keys if not (folder / key).is_file()]


def read_whole(out: Path, name: str, what: str, fix: str) -> tuple[np.ndarray, dict] | None:
    """(values, attributes) of the store-level array `name` that must be read whole (the projection, the
    document sources), None when the store has none: every chunk present, its CRC32C and the content's sha256
    (when recorded) checked. A damaged one is a DflashError naming the problem and `fix`."""
    folder = out / name
    if not (folder / "zarr.json").exists():
        return None
    try:
        array = zarr.open_array(folder, mode="r")
        missing = missing_chunks(array, folder)
        if missing:
            problem = f"chunk file {', '.join(missing[:3])} missing: it would read as zeros"
        else:
            data, attributes = np.asarray(array[:]), dict(array.attrs)
            if attributes.get("sha256", content_sha256(data)) == content_sha256(data):
                return data, attributes
            problem = "its content does not match the sha256 its attributes record"
    except Exception as exc:  # a checksum mismatch, damaged metadata
        problem = f"{type(exc).__name__}: {exc}"
    raise DflashError(f"the {what} of {out} ({folder}) is damaged ({problem}); {fix}")


REPAIR = "rerun the harvest command with --repair"

PROJECTION_FIX = (
    "rerun the harvest command (with --repair once the store is complete), which recomputes it (the calibration "
    "is deterministic) and checks it against the rows' one, or harvest again into a new folder"
)

DOCUMENT_SOURCES_FIX = (
    f"{REPAIR}, which rewrites it from the data, or delete that folder to train without per-source metrics"
)
