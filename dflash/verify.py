"""Verification of a store: every chunk of every array read and its CRC32C checked (`dflash inspect --verify`,
and the damage a `--repair` mends). Imports dflash.store, which never imports it."""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zarr

from dflash.errors import DflashError
from dflash.manifest import FeatureSpec, TeacherSpec
from dflash.store import Store, _array_config, arrays_of, part_name


@dataclass
class PartDamage:
    rows: list[int]  # rows of the part (local) with a missing or corrupt chunk in any row array
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


def part_damage(
    out: Path, rank: int, features: FeatureSpec, teacher: TeacherSpec | None = None, threads: int = 8
) -> PartDamage:
    """Read every chunk of one part (finished, with or without the store's manifest): its damaged rows."""
    folder = out / "parts" / part_name(rank)
    try:
        group = zarr.open_group(folder, mode="r")
        names = arrays_of(features, teacher)
        arrays = {name: group[name].with_config(_array_config(read=True)) for name in names}
    except Exception as exc:
        raise DflashError(
            f"the arrays of part {part_name(rank)} of {out} cannot be opened ({exc}); their metadata is damaged: "
            "restore the part folder, or harvest again into a new folder"
        ) from None
    jobs = [(name, array, coords) for name, array in arrays.items() for coords in np.ndindex(*array.cdata_shape)]

    def check(job):
        name, array, coords = job
        problem = _chunk_problem(array, folder / name / array.metadata.encode_chunk_key(coords), coords)
        return None if problem is None else (name, coords, f"array {name} chunk {coords}: {problem}")

    with ThreadPoolExecutor(threads) as pool:
        found = [result for result in pool.map(check, jobs) if result is not None]
    rows = sorted({coords[0] for name, coords, _ in found if name != "documents"})
    return PartDamage(rows, any(name == "documents" for name, _, _ in found), [text for _, _, text in found])


def check_chunks(store: Store, progress=None, threads: int = 8) -> list[str]:
    """Read every chunk of every array; return one line per missing or corrupt chunk, naming part/array/row."""
    jobs = [
        (part, name, array, coords)
        for part, arrays in enumerate(store.parts)
        for name, array in arrays.items()
        for coords in np.ndindex(*array.cdata_shape)
    ]

    def check(job) -> str | None:
        part, name, array, coords = job
        where = f"part {store.part_names[part]} array {name} chunk {coords}"
        if name != "documents":
            where += f" (row {store.part_starts[part] + coords[0]})"
        chunk_file = store.path / "parts" / store.part_names[part] / name / array.metadata.encode_chunk_key(coords)
        try:
            problem = _chunk_problem(array, chunk_file, coords)
            return None if problem is None else f"{where}: {problem}"
        finally:
            if progress is not None:
                progress(array.nbytes // array.nchunks)

    with ThreadPoolExecutor(threads) as pool:
        return [problem for problem in pool.map(check, jobs) if problem is not None]
