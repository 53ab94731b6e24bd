"""The harvest store's write side (the checks of an output folder before it: dflash/store/folder.py): the store's creation (harvest.json first), the
part writer (its arrays' creation, the hidden-state chunk writer, the commits after each row group), the
store-level arrays written once (projection, document sources) and the finishing step that writes manifest.json.
Every file is replaced atomically, so a killed harvest leaves committed rows intact and resumes after them.
"""

import dataclasses
import logging
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import google_crc32c
import numcodecs
import numpy as np
import zarr

from dflash.errors import DflashError, describe_differences
from dflash.manifest import (
    FORMAT_VERSION,
    FeatureSpec,
    Manifest,
    PartEntry,
    SelfCheck,
    TargetSpec,
    TeacherSpec,
    TokenizerSpec,
    identity_of,
)
from dflash.store.bookkeeping import (
    DOCUMENT_SOURCES,
    HARVEST_FILE,
    MANIFEST_FILE,
    PROGRESS_FILE,
    PROJECTION,
    TMP_PREFIX,
    check_header,
    check_parts_agree,
    content_sha256,
    header_content,
    header_sha256,
    missing_chunks,
    missing_committed_chunks,
    part_name,
    part_progress,
    read_progress,
    write_json_atomic,
    write_json_exclusive,
)
from dflash.store.reader import (
    BF16,
    DIGESTS,
    DOCUMENT_COLUMNS,
    HIDDEN_BLOSC,
    HIDDEN_DTYPES,
    SCALE_DTYPE,
    TOKEN_ARRAYS,
    Store,
    array_config,
    arrays_of,
    chunk_columns,
    compressors_of,
    document_digests,
    hidden_chunk_tokens,
    hidden_compressors,
    open_manifest,
    place_digest,
    read_projection,
    teacher_arrays,
    token_compressors,
)

logger = logging.getLogger("dflash")


DOC_CHUNK = 65536

HIDDEN_ENCODINGS = {
    "bf16": "uint16 bit patterns of bfloat16 (zarr has no bfloat16): torch.from_numpy(a).view(torch.bfloat16)",
    "fp8": "uint8 bit patterns of float8 e4m3fn (OCP, no infinities); value = fp8 * 2**scales[..., group]",
}

TEACHER_MEANINGS = {
    "teacher_ids": "ids of the target's top-k next tokens at each position (the distribution of token t+1), most "
    "probable first; 0 on padding",
    "teacher_probs": "their probabilities under the target; 0 on padding",
    "teacher_tail": "1 - the sum of the top-k probabilities (the mass of every other token); 0 on padding",
    "teacher_hidden": "uint16 bit patterns of bfloat16: the target's final-normed last hidden state (the LM head's "
    "input); 0 on padding",
}


def _hidden_encoder(features: FeatureSpec):
    """numcodecs' implementation of hidden_compressors' first codec: the chunk writer's encoder."""
    if features.precision == "fp8":
        return numcodecs.Zstd(level=1)
    return numcodecs.Blosc(**HIDDEN_BLOSC, shuffle=numcodecs.Blosc.BITSHUFFLE, typesize=2)


DIGESTS_MEANING = (
    "per row, the CRC32C of each chunk's path in the store (parts/<part>/ + the column's, {row} filled in) followed "
    "by the 4 CRC32C bytes ending that chunk's file: binds every chunk to its row, array and part"
)

CHUNK_WRITTEN = ("hidden", "teacher_hidden")  # the large arrays, written by HiddenChunkWriter outside zarr


def create_store(out: Path, header: Manifest) -> None:
    """Create the folder, `harvest.json` (first; of ranks racing, one writes it) and the root groups; a no-op on
    an existing store. A rank then checks the header it finds against its own (`check_header`)."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / HARVEST_FILE).exists():
        write_json_exclusive(out / HARVEST_FILE, header.header().to_json())
    _ensure_group(out)
    _ensure_group(out / "parts")


def _ensure_group(path: Path) -> zarr.Group:
    """Open or create a Zarr v3 group. Ranks race to create the shared groups: the loser opens the winner's."""
    try:
        return zarr.open_group(path, mode="a", zarr_format=3)
    except zarr.errors.ContainsGroupError:
        return zarr.open_group(path, mode="r+", zarr_format=3)


@dataclass
class PartSpec:
    """Everything about one rank's part that the packing plan fixes before any forward."""

    rank: int
    rows: int
    token_budget: int
    features: FeatureSpec
    documents: np.ndarray  # int64 [n, 5]: DOCUMENT_COLUMNS, row local to the part
    counts: dict  # documents, tokens, loss_tokens, padding_tokens
    teacher: TeacherSpec | None = None


class PartWriter:
    """Writes one rank's rows; opening an existing part resumes after its committed rows."""

    def __init__(self, out: Path, spec: PartSpec, header: Manifest | None = None):
        """`header`: the rank's own header, recorded in progress.json and checked against harvest.json before
        every commit (None: no check, for tests and benchmarks that write parts directly)."""
        self.out, self.header = out, header
        self.folder = out / "parts" / part_name(spec.rank)
        self.progress = read_progress(self.folder / PROGRESS_FILE)
        recorded = (
            {}
            if header is None
            else {"header_sha256": header_sha256(header), "fingerprint": header_content(header)["fingerprint"]}
        )
        if self.progress is None:  # absent until every array exists: a half-created part is simply redone
            self._create(out, spec, recorded)
        elif self.progress["rows"] != spec.rows or self.progress["counts"] != spec.counts:
            raise DflashError(
                f"part {part_name(spec.rank)} of {out} was planned differently ({self.progress['rows']} rows, "
                f"now {spec.rows}); the data or tokenizer changed under the store: harvest into a new folder"
            )
        elif recorded and self.progress.get("header_sha256", recorded["header_sha256"]) != recorded["header_sha256"]:
            details = describe_differences(
                self.progress.get("fingerprint", {}), recorded["fingerprint"], "part has", "this run"
            )
            raise DflashError(
                f"part {part_name(spec.rank)} of {out} was written under other settings ({details or 'its header differs'}); "
                f"rerun it with the settings it was started with, or delete {self.folder} and rerun this rank"
            )
        else:  # resuming: drop the temporary files of writes a killed run left unfinished
            # Only rows past the committed ones are written again (all of them for a finished part: a repair).
            committed = self.progress["rows_committed"]
            if committed < self.progress["rows"]:  # chunks of committed rows may be missing from a copied store
                hole, examples = missing_committed_chunks(self.folder, committed, documents=False)
                if hole is not None:
                    logger.warning(
                        "part %s of %s: chunk files of committed rows are missing (%s; copied while being written?): "
                        "resuming from row %d instead of %d",
                        part_name(spec.rank),
                        out,
                        ", ".join(examples),
                        hole,
                        committed,
                    )
                    committed = hole
                    self.progress = {**self.progress, "rows_committed": hole}
                    write_json_atomic(self.folder / PROGRESS_FILE, self.progress)
            first = committed if committed < self.progress["rows"] else 0
            for leftover in [*_unfinished_writes(self.folder, first), *self.folder.glob(f"{TMP_PREFIX}*")]:
                leftover.unlink(missing_ok=True)
            self.progress = {**self.progress, **recorded}  # a part of an older dflash gains the record at its commit
        group = zarr.open_group(self.folder, mode="r+")
        names = arrays_of(spec.features, spec.teacher)
        self.arrays = {name: group[name].with_config(array_config(read=False)) for name in names}
        if missing_chunks(self.arrays["documents"], self.folder / "documents"):  # a copy of a store being written
            self.write_documents(spec.documents)
        self.chunk_writers = {
            name: HiddenChunkWriter(self.arrays[name], self.folder / name, spec.features if name == "hidden" else BF16)
            for name in CHUNK_WRITTEN
            if name in self.arrays
        }

    def _create(self, out: Path, spec: PartSpec, recorded: dict) -> None:
        _write_documents(self.folder, create_part_arrays(_ensure_group(self.folder), spec), spec.documents)
        self.progress = {"rows": spec.rows, "rows_committed": 0, "counts": spec.counts, **recorded}
        write_json_atomic(self.folder / PROGRESS_FILE, self.progress)

    def write_documents(self, table: np.ndarray) -> None:
        """(Re)write the part's documents table: one with missing chunks, or a repair's."""
        _write_documents(self.folder, self.arrays["documents"], table)

    @property
    def rows_committed(self) -> int:
        return self.progress["rows_committed"]

    def write_rows(self, first_row: int, hidden: np.ndarray, others: dict[str, np.ndarray]) -> None:
        """Write rows [first_row, first_row + len(hidden)): hidden [r, T, W] (bf16 or fp8 bits), and the other
        row arrays (scales [r, T, G] for fp8, TOKEN_ARRAYS [r, T], the teacher arrays)."""
        rows = slice(first_row, first_row + len(hidden))
        for name, writer in self.chunk_writers.items():
            writer.write_rows(first_row, hidden if name == "hidden" else others[name])
        for name in self.arrays:
            if name not in (*CHUNK_WRITTEN, DIGESTS, "documents"):
                self.arrays[name][rows] = others[name]
        _write_digests(self.folder, self.arrays, range(rows.start, rows.stop))

    def commit(self, rows_committed: int) -> None:
        """Record rows as durable; call only once write_rows for them has returned. The store's harvest.json is
        checked first against the header the rows were written under: rows of a mixed store are never committed."""
        if self.header is not None:
            check_header(self.out, self.header, int(self.folder.name.removeprefix("rank")))
        self.progress = {**self.progress, "rows_committed": rows_committed}
        write_json_atomic(self.folder / PROGRESS_FILE, self.progress)


def _write_digests(folder: Path, arrays: dict[str, zarr.Array], rows: range) -> None:
    """Record the digest of each chunk of `rows` (`chunk_digest`) from the CRC32C ending its file, as it is now."""
    columns = chunk_columns(arrays)
    digests = np.zeros((len(rows), len(columns)), np.uint32)
    for i, row in enumerate(rows):
        for c, (name, coords) in enumerate(columns):
            digests[i, c] = place_digest(folder, name, arrays[name].metadata.encode_chunk_key((row, *coords)))
    arrays[DIGESTS][rows.start : rows.stop] = digests


def _write_documents(folder: Path, array: zarr.Array, table: np.ndarray) -> None:
    """Write the documents table of the part at `folder`, then record its chunks' digests in its attribute `digests`
    (zarr.json, rewritten atomically): not a row array, it has no columns in the part's `digests`."""
    array[:] = table
    _record_document_digests(folder, array)


def _record_document_digests(folder: Path, array: zarr.Array) -> None:
    array.update_attributes({DIGESTS: document_digests(folder, array)})


def record_digests(out: Path) -> None:
    """Record every part's digests (its rows', its documents table's) anew from its chunk files as they are now. For
    stores whose rows were rewritten in place through zarr (tests, benchmarks, hand edits), which the old digests
    would call chunks in another's place; never a way past damage, since it accepts whatever each chunk file holds."""
    manifest = open_manifest(out)
    for entry in manifest.parts:
        group = zarr.open_group(out / "parts" / entry.name, mode="r+")
        names = arrays_of(manifest.features, manifest.teacher)
        arrays = {name: group[name].with_config(array_config(read=False)) for name in names}
        _write_digests(out / "parts" / entry.name, arrays, range(entry.rows))
        _record_document_digests(out / "parts" / entry.name, arrays["documents"])


def create_part_arrays(group: zarr.Group, spec: PartSpec) -> zarr.Array:
    """Create (metadata only, overwriting) every array of a part in `group`; returns the documents array. Also
    what `--repair` rebuilds a damaged zarr.json from (dflash.store.verify.repair_metadata)."""
    T, f = spec.token_budget, spec.features
    write = dict(overwrite=True, config=array_config(read=False))
    chunk = hidden_chunk_tokens(T, f.width * f.bytes_per_value)
    arrays = {}
    arrays["hidden"] = group.create_array(
        "hidden",
        shape=(spec.rows, T, f.width),
        chunks=(1, chunk, f.width),
        dtype=HIDDEN_DTYPES[f.precision],
        compressors=hidden_compressors(f),
        fill_value=0,
        **write,
        attributes={"precision": f.precision, "encoding": HIDDEN_ENCODINGS[f.precision]},
    )
    if f.precision == "fp8":
        arrays["scales"] = group.create_array(
            "scales",
            shape=(spec.rows, T, f.scale_groups),
            chunks=(1, T, f.scale_groups),
            dtype=SCALE_DTYPE,
            compressors=token_compressors(),
            fill_value=0,
            attributes={"meaning": "log2 of each group's scale"},
            **write,
        )
    for name, dtype in TOKEN_ARRAYS.items():
        fill = -1 if name == "doc_ids" else 0
        arrays[name] = group.create_array(
            name,
            shape=(spec.rows, T),
            chunks=(1, T),
            dtype=dtype,
            compressors=token_compressors(),
            fill_value=fill,
            **write,
        )
    for name, (shape, dtype) in teacher_arrays(spec.teacher, T).items():
        chunk = (hidden_chunk_tokens(T, 2 * shape[1]), shape[1]) if name == "teacher_hidden" else shape
        arrays[name] = group.create_array(
            name,
            shape=(spec.rows, *shape),
            chunks=(1, *chunk),
            dtype=dtype,
            compressors=compressors_of(name, f),
            fill_value=0,
            attributes={"meaning": TEACHER_MEANINGS[name]},
            **write,
        )
    columns = chunk_columns(arrays)
    group.create_array(
        DIGESTS,
        shape=(spec.rows, len(columns)),
        chunks=(1, len(columns)),
        dtype="uint32",
        compressors=token_compressors(),
        fill_value=0,
        attributes={
            "meaning": DIGESTS_MEANING,
            "columns": ["/".join([name, "c", "{row}", *map(str, coords)]) for name, coords in columns],
        },
        **write,
    )
    documents = group.create_array(
        "documents",
        shape=spec.documents.shape,
        chunks=(DOC_CHUNK, len(DOCUMENT_COLUMNS)),
        dtype="int64",
        compressors=token_compressors(),
        fill_value=0,
        attributes={"columns": DOCUMENT_COLUMNS},
        **write,
    )
    return documents


class HiddenChunkWriter:
    """Writes hidden-state chunks byte for byte as zarr's codec chain would (blosc bit shuffle, then crc32c),
    from a thread pool whose work releases the GIL: blosc, crc32c and file writes.

    Zarr's own write path holds the GIL for much of its work, and in a harvest it shares the process with the
    thread that launches the target's kernels (docs/benchmarks.md). Files are written under a `.partial` name
    and renamed, as zarr does, so a killed write never leaves a half chunk.
    """

    def __init__(self, array: zarr.Array, folder: Path, features: FeatureSpec, threads: int | None = None):
        self.array, self.folder = array, folder
        threads = threads or max(1, min(8, (os.cpu_count() or 2) - 1))  # leave a core to the launching thread
        self.chunk_tokens = array.chunks[1]
        self.codec = _hidden_encoder(features)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="dflash-chunks")

    def write_rows(self, first_row: int, hidden: np.ndarray) -> None:
        slices = range(0, hidden.shape[1], self.chunk_tokens)
        jobs = [(first_row + i, j) for i in range(len(hidden)) for j in range(len(slices))]
        for done in self.pool.map(lambda job: self._write_chunk(*job, hidden[job[0] - first_row]), jobs):
            del done  # map re-raises the first failure (a full disk, say) here, in the writer's thread

    def _write_chunk(self, row: int, j: int, row_data: np.ndarray) -> None:
        chunk = row_data[j * self.chunk_tokens : (j + 1) * self.chunk_tokens]
        if len(chunk) < self.chunk_tokens:  # the grid's edge chunk is stored whole, padded with the fill value
            chunk = np.concatenate([chunk, np.zeros((self.chunk_tokens - len(chunk), chunk.shape[1]), chunk.dtype)])
        encoded = self.codec.encode(np.ascontiguousarray(chunk))
        checksum = np.uint32(google_crc32c.value(encoded)).tobytes()
        path = self.folder / self.array.metadata.encode_chunk_key((row, j, 0))
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{uuid.uuid4().hex}.partial")
        with open(partial, "wb") as f:
            f.write(encoded)
            f.write(checksum)
        os.replace(partial, path)


def _unfinished_writes(folder: Path, first_row: int) -> list[Path]:
    """The `.partial` files (zarr's and HiddenChunkWriter's) under the chunk folders `<array>/c/<row>` of rows
    from `first_row` on: one listing of each array's `c/` instead of a walk over every chunk file of the part."""
    found = []
    for array in folder.iterdir():
        if not (array / "c").is_dir():
            continue
        with os.scandir(array / "c") as rows:
            dirty = [Path(entry.path) for entry in rows if not entry.name.isdigit() or int(entry.name) >= first_row]
        found += [path for row in dirty for path in ([row] if row.is_file() else row.rglob("*.partial"))]
    return [path for path in found if path.name.endswith(".partial")]


def finalize(out: Path, header: Manifest, check_chunks: bool = True) -> bool:
    """Write `manifest.json` if every part is done; whichever rank finishes last does it (idempotently).
    `check_chunks` False skips the listing of every committed row's chunk files: only for synthetic stores whose
    rows are written later or never (tests and benchmarks of the reader's start-up).

    The manifest is `header` (the contents of harvest.json) plus its identity and the counts and rows of every part.
    """
    progress = part_progress(out, header.world_size)
    if any(p is None or p["rows_committed"] < p["rows"] for p in progress):
        return False
    check_parts_agree(out, header, progress)
    for rank, p in enumerate(progress if check_chunks else ()):
        first, examples = missing_committed_chunks(out / "parts" / part_name(rank), p["rows_committed"])
        if first is not None:
            raise DflashError(
                f"part {part_name(rank)} of {out} records {p['rows_committed']} rows committed, but chunk files of "
                f"row {first} and maybe others are missing ({', '.join(examples)}): the store was copied while being "
                f"written, or damaged; no manifest is written. Rerun rank {rank}'s harvest command with --repair, "
                "which re-harvests exactly the rows with missing or damaged chunks"
            )
    parts = [PartEntry(part_name(rank), p["rows"], **p["counts"]) for rank, p in enumerate(progress)]
    manifest = dataclasses.replace(header, identity=identity_of(header)).with_parts(parts)
    write_json_atomic(out / MANIFEST_FILE, manifest.to_json())
    for leftover in out.glob(f"{TMP_PREFIX}*"):  # store-level arrays' temporaries of killed writers: every rank
        if leftover.is_dir():  # wrote its own before its first row, and all rows are done
            shutil.rmtree(leftover, ignore_errors=True)
    return True


def record_self_check(out: Path, check: SelfCheck) -> Manifest:
    """Rewrite manifest.json with the result of a check against the target (atomic; the identity is unchanged)."""
    manifest = open_manifest(out)
    manifest = dataclasses.replace(manifest, self_check=check)
    write_json_atomic(out / MANIFEST_FILE, manifest.to_json())
    return manifest


def _write_array_once(out: Path, name: str, data: np.ndarray, chunks: tuple, attributes: dict | None = None) -> None:
    """Write the store-level array `name` unless it is there: into a temporary folder renamed into place (atomic),
    so that of several ranks writing it the first wins and nobody sees half of one. Its attributes record the
    sha256 of its content (`read_whole`)."""
    if (out / name / "zarr.json").exists():
        return
    tmp = out / f"{TMP_PREFIX}{name}.{uuid.uuid4().hex}"
    attributes = {**(attributes or {}), "sha256": content_sha256(data)}
    # Every chunk written, even one equal to the fill value (document sources all 0: one source's documents only),
    # since read_whole takes a missing chunk file for damage.
    zarr.create_array(
        tmp,
        data=data,
        chunks=chunks,
        compressors=token_compressors(),
        attributes=attributes,
        config=array_config(False),
    )
    try:
        os.rename(tmp, out / name)  # fails when another rank's is already there, which then wins
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def write_projection(out: Path, projection: np.ndarray, calibration: dict) -> tuple[np.ndarray, dict]:
    """Store P [width, feature_dim] (float32) with its calibration record, once: the first rank to finish its
    calibration wins and every later rank reads the stored one, so all ranks project with the same matrix.
    Returns the stored (P, calibration)."""
    attributes = {"meaning": "stored features = P @ concatenated features", **calibration}
    _write_array_once(out, PROJECTION, projection.astype(np.float32), projection.shape, attributes)
    return read_projection(out)


def write_document_sources(out: Path, sources: np.ndarray) -> None:
    """Store each document's data source (int16, indexed by doc id; -1: a record that gave no document) once: every
    rank computes the same array, the first to get here writes it (after harvest.json)."""
    _write_array_once(out, DOCUMENT_SOURCES, sources.astype(np.int16), (max(1, min(len(sources), 1 << 20)),))


def new_manifest(
    *,
    target: TargetSpec,
    layer_ids: list[int],
    token_budget: int,
    tokenizer: TokenizerSpec,
    fingerprint: dict,
    features: FeatureSpec | None = None,
    options: dict | None = None,
    data: dict | None = None,
    dflash_version: str = "",
    teacher: TeacherSpec | None = None,
) -> Manifest:
    """The header of a new store (harvest.json): what the harvest, the tests and the benchmarks all write."""
    feature_dim = len(layer_ids) * target.hidden_size
    features = features or FeatureSpec("bf16", feature_dim, 0, None)
    codecs = {
        "hidden": [codec.to_dict() for codec in hidden_compressors(features)],
        "tokens": [codec.to_dict() for codec in token_compressors()],
    }
    if teacher is not None:
        name = "teacher_hidden" if teacher.kind == "hidden" else "teacher_probs"
        codecs["teacher"] = [codec.to_dict() for codec in compressors_of(name, features)]
    return Manifest(
        format_version=FORMAT_VERSION,
        dflash_version=dflash_version,
        fingerprint={**fingerprint, "format_version": FORMAT_VERSION},
        options=options or {},
        target=target,
        layer_ids=tuple(layer_ids),
        feature_dim=feature_dim,
        features=features,
        dtype="bfloat16",
        token_budget=token_budget,
        tokenizer=tokenizer,
        data=data or {},
        codecs=codecs,
        teacher=teacher,
    )


def write_store(
    out: Path, header: Manifest, parts: list["PartContent"], projection: np.ndarray | None = None
) -> "Store":
    """A complete store of given rows through the real writers, for tests and benchmarks (no target involved);
    `projection`: P of a subspace store."""
    if projection is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_projection(
            out,
            projection,
            {"captured": header.features.subspace.captured, "calibration_tokens": 0, "calibration_documents": 0},
        )
    create_store(out, header)
    for rank, content in enumerate(parts):
        spec = PartSpec(
            rank, content.rows, header.token_budget, header.features, content.documents, content.counts, header.teacher
        )
        writer = PartWriter(out, spec, header)
        for r in range(content.rows):
            hidden, others = content.row(r)
            writer.write_rows(r, hidden[None], {name: value[None] for name, value in others.items()})
        writer.commit(content.rows)
    if not finalize(out, header):
        raise RuntimeError(f"the store at {out} did not complete")
    return Store.open(out)


@dataclass
class PartContent:
    """One part's rows for `write_store`: row(r) -> (hidden [T, W] stored bits, {other row array: [T] or [T, G]})."""

    rows: int
    documents: np.ndarray  # int64 [n, 5]: DOCUMENT_COLUMNS
    counts: dict  # documents, tokens, loss_tokens, padding_tokens
    row: object
