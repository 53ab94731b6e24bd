"""Verification of a store: every chunk of every array read, its CRC32C checked and its place against the part's
`digests` (`dflash inspect --verify`, and the damage a `--repair` mends), and the rebuilding of a finished part's
metadata by `--repair`. Imports dflash.store, which never imports it."""

import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zarr

from dflash import store
from dflash.errors import DflashError
from dflash.manifest import FeatureSpec, Manifest, TeacherSpec
from dflash.store import (
    DIGESTS,
    Store,
    array_config,
    arrays_of,
    chunk_columns,
    misplaced,
    misplaced_documents,
    part_name,
    place_digest,
)


def check_projection_source(source: Path, fingerprint: dict, config_hash: str) -> None:
    """Refuse `--projection-from` a store harvested from another target (its config.json, its weights when that
    store recorded them) or at other layers: its P fits this harvest's shapes but was calibrated on other features,
    and its captured share would be shown as this store's."""
    other = store.read_manifest(source / store.HARVEST_FILE)
    differences = []
    if other.target.config_hash != config_hash:
        differences.append(f"its target {other.fingerprint.get('model', other.target.name)} has another config.json")
    recorded = other.fingerprint.get("weights_sha256")
    if recorded is not None and recorded != fingerprint["weights_sha256"]:
        differences.append(
            f"its target's weights differ (weights_sha256 {recorded[:12]}, this target's "
            f"{fingerprint['weights_sha256'][:12]})"
        )
    if list(other.layer_ids) != list(fingerprint["layers"]):
        differences.append(f"it taps layers {list(other.layer_ids)}, this harvest {list(fingerprint['layers'])}")
    if differences:
        raise DflashError(
            f"--projection-from {source} was harvested from other features than this harvest's ({'; '.join(differences)}); "
            f"its projection fits only stores of the same target and --layers: give a subspace store of "
            f"{fingerprint['model']} at these layers, or leave out --projection-from to calibrate one"
        )


@dataclass
class PartDamage:
    rows: list[int]  # rows of the part (local) with a missing, corrupt or misplaced chunk in any row array
    documents: bool  # the documents table is damaged
    problems: list[str]


def _chunk_problem(array: zarr.Array, chunk_file: Path, coords) -> str | None:
    try:
        if not chunk_file.is_file():
            return "chunk file missing"
        array.get_block_selection(coords)
        return None
    except Exception as exc:  # zarr raises ValueError on a checksum mismatch, codec errors otherwise
        return str(exc)


def _recorded_digests(folder: Path, arrays: dict[str, zarr.Array], pool: ThreadPoolExecutor) -> dict[int, np.ndarray]:
    """Row -> the digests recorded for its chunks. Rows whose digests chunk is missing or corrupt are left out
    (that chunk is named damaged itself), as is every row of a store older than the digests."""
    digests = arrays.get(DIGESTS)
    if digests is None:
        return {}

    def read(row: int):
        if not (folder / DIGESTS / digests.metadata.encode_chunk_key((row, 0))).is_file():
            return row, None
        try:
            return row, digests.get_block_selection((row, 0))[0]
        except Exception:  # a checksum mismatch, a codec error
            return row, None

    return {row: values for row, values in pool.map(read, range(digests.shape[0])) if values is not None}


def _part_problems(
    folder: Path, arrays: dict[str, zarr.Array], pool: ThreadPoolExecutor, progress=None
) -> list[tuple[str, tuple, str]]:
    """(array, chunk coordinates, problem) of every missing, corrupt or misplaced chunk of the part at `folder`:
    each chunk read and its CRC32C checked, then its digest (a row array's in `digests`, the documents table's in
    its attributes)."""
    recorded = _recorded_digests(folder, arrays, pool)
    columns = {place: column for column, place in enumerate(chunk_columns(arrays))}
    jobs = [(name, array, coords) for name, array in arrays.items() for coords in np.ndindex(*array.cdata_shape)]

    def check(job):
        name, array, coords = job
        key = array.metadata.encode_chunk_key(coords)
        try:
            problem = _chunk_problem(array, folder / name / key, coords)
            column = columns.get((name, coords[1:]))
            if problem is None and column is not None and coords[0] in recorded:
                same = place_digest(folder, name, key) == recorded[coords[0]][column]
                problem = None if same else misplaced(folder / name / key)
            return None if problem is None else (name, coords, problem)
        finally:
            if progress is not None:
                progress(array.nbytes // array.nchunks)

    found = [found for found in pool.map(check, jobs) if found is not None]
    if DIGESTS in arrays and not any(name == "documents" for name, _, _ in found):  # its chunks all there and whole
        found += [
            ("documents", coords, problem) for coords, problem in misplaced_documents(folder, arrays["documents"])
        ]
    return found


def part_damage(
    out: Path, rank: int, features: FeatureSpec, teacher: TeacherSpec | None = None, threads: int = 8
) -> PartDamage:
    """Read every chunk of one part (finished, with or without the store's manifest): its damaged rows."""
    folder = out / "parts" / part_name(rank)
    try:
        group = zarr.open_group(folder, mode="r")
        names = arrays_of(features, teacher)
        arrays = {name: group[name].with_config(array_config(read=True)) for name in names}
    except Exception as exc:
        raise DflashError(
            f"the arrays of part {part_name(rank)} of {out} cannot be opened ({exc}); their metadata is damaged "
            "beyond what --repair rebuilds: restore the part folder, or harvest again into a new folder"
        ) from None
    with ThreadPoolExecutor(threads) as pool:
        found = _part_problems(folder, arrays, pool)
    rows = sorted({coords[0] for name, coords, _ in found if name != "documents"})
    problems = [f"array {name} chunk {coords}: {problem}" for name, coords, problem in found]
    return PartDamage(rows, any(name == "documents" for name, _, _ in found), problems)


def check_chunks(store: Store, progress=None, threads: int = 8) -> list[str]:
    """Read every chunk of every array; return one line per missing, corrupt or misplaced chunk, naming
    part/array/row."""
    problems = []
    with ThreadPoolExecutor(threads) as pool:
        for start, part, arrays in zip(store.part_starts, store.part_names, store.parts):
            for name, coords, problem in _part_problems(store.path / "parts" / part, arrays, pool, progress):
                row = "" if name == "documents" else f" (row {start + coords[0]})"
                problems.append(f"part {part} array {name} chunk {coords}{row}: {problem}")
    return problems


def _opens(folder: Path, kind: str) -> bool:
    """Whether `folder` opens as a zarr `kind` ("array" or "group"): its zarr.json is there and valid."""
    try:
        (zarr.open_array if kind == "array" else zarr.open_group)(folder, mode="r")
        return True
    except Exception:  # a missing or damaged zarr.json
        return False


def _finished_progress(out: Path, rank: int, header: Manifest) -> dict | None:
    """The progress.json of part `rank` as its harvest left it when finished, from manifest.json's entry; None when
    the manifest (missing or damaged) lists no such part."""
    try:
        manifest = store.read_manifest(out / store.MANIFEST_FILE)
    except DflashError:
        manifest = None
    entry = next((e for e in manifest.parts if e.name == part_name(rank)), None) if manifest else None
    if entry is None:
        return None
    counts = {key: getattr(entry, key) for key in store.PART_COUNTS}
    return {
        "rows": entry.rows,
        "rows_committed": entry.rows,
        "counts": counts,
        "header_sha256": store.header_sha256(header),
        "fingerprint": store.header_content(header)["fingerprint"],
    }


def repair_metadata(out: Path, rank: int, header: Manifest) -> list[str]:
    """`--repair`: rebuild what of part `rank`'s metadata is damaged and can be rebuilt exactly, before its
    chunks are checked: its progress.json, missing or garbled, from manifest.json (a finished part: without it the
    part would pass for unfinished, and --repair refuse it), the zarr.json of each of its
    arrays from harvest.json and the part's rows and documents, and the groups' zarr.json (root, parts, the
    part). Each file is written as the harvest wrote it (temporary file and rename). Returns what it rewrote."""
    folder, fixed = out / "parts" / part_name(rank), []
    damaged = None
    try:
        progress = store.read_progress(folder / store.PROGRESS_FILE)
    except DflashError as exc:
        progress, damaged = None, exc
    if progress is None:  # garbled or missing: a part the manifest lists is finished, and its file rebuilt
        progress = _finished_progress(out, rank, header)
        if progress is None and damaged is not None:
            raise damaged
        if progress is None:
            return fixed  # a part never started: nothing of it to rebuild
        store.write_json_atomic(folder / store.PROGRESS_FILE, progress)
        fixed.append(str(folder / store.PROGRESS_FILE))
    names = [name for name in arrays_of(header.features, header.teacher) if not _opens(folder / name, "array")]
    groups = [g for g in (out, out / "parts", folder) if not _opens(g, "group")]
    if not names and not groups:
        return fixed
    spec = store.PartSpec(
        rank,
        progress["rows"],
        header.token_budget,
        header.features,
        np.zeros((progress["counts"]["documents"], len(store.DOCUMENT_COLUMNS)), np.int64),
        progress["counts"],
        header.teacher,
    )
    tmp = out / f"{store.TMP_PREFIX}metadata.{uuid.uuid4().hex}"
    try:
        store.create_part_arrays(zarr.open_group(tmp, mode="w", zarr_format=3), spec)
        rebuilt = [(tmp / name / "zarr.json", folder / name / "zarr.json") for name in names]
        rebuilt += [(tmp / "zarr.json", group / "zarr.json") for group in groups]
        for source, target in rebuilt:
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f"{store.TMP_PREFIX}zarr.json.{uuid.uuid4().hex}")
            shutil.copyfile(source, partial)
            os.replace(partial, target)
            fixed.append(str(target))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return fixed
