"""The harvest store's layout (its arrays, their dtypes, chunks and codecs) and its read side: `Store.open` reads
only the manifest, the parts' progress.json and the arrays' metadata; rows are read chunk by chunk without zarr's
copies (`ChunkReader`), checking each chunk's CRC32C and, against the part's `digests`, its place. The writer
(dflash.store.writer) builds on the layout here; dflash.store names both.
The exact format, and how to read it with plain zarr, is in docs/shard-format.md.
"""

import bisect
import logging
import math
import os
from pathlib import Path

import google_crc32c
import numcodecs
import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from dflash.errors import DflashError
from dflash.manifest import (
    DIGESTS_SINCE,
    FeatureSpec,
    Manifest,
    NewerFormat,
    PartEntry,
    SelfCheck,
    TeacherSpec,
)
from dflash.store.bookkeeping import (
    DOCUMENT_SOURCES,
    DOCUMENT_SOURCES_FIX,
    HARVEST_FILE,
    MANIFEST_FILE,
    PROGRESS_FILE,
    PROJECTION,
    PROJECTION_FIX,
    REPAIR,
    check_parts_agree,
    missing_chunks,
    part_progress,
    read_manifest,
    read_progress,
    read_whole,
)

logger = logging.getLogger("dflash")

CHUNK_BYTES = 32 << 20  # uncompressed size of one hidden chunk: a row is read in a few large, parallel reads
TOKEN_ARRAYS = {"input_ids": "int32", "position_ids": "int32", "doc_ids": "int32", "loss_mask": "uint8"}
DOCUMENT_COLUMNS = ["doc_id", "piece", "row", "start", "length"]
HIDDEN_DTYPES = {"bf16": np.uint16, "fp8": np.uint8}
SCALE_DTYPE = np.int8  # power-of-two exponents: one byte per scale group
# The teacher arrays' numpy dtypes (zarr has no bfloat16: teacher_hidden holds its bits, as hidden does).
TEACHER_DTYPES = {"int32": np.int32, "float16": np.float16, "bfloat16": np.uint16}
BF16 = FeatureSpec("bf16")  # the encoding of teacher_hidden: bf16 behind the features' lossless codec
DIGESTS = "digests"  # uint32 [rows, chunks of a row]: each chunk's digest (chunk_digest), checked on every read


HIDDEN_BLOSC = {"cname": "lz4", "clevel": 5}  # with bit shuffle, typesize 2


def arrays_of(features: FeatureSpec, teacher: TeacherSpec | None = None) -> tuple[str, ...]:
    """The arrays of one part, in write order."""
    scales = ("scales",) if features.precision == "fp8" else ()
    return ("hidden", *scales, *TOKEN_ARRAYS, *(teacher.arrays if teacher else ()), DIGESTS, "documents")


def chunk_columns(arrays: dict[str, zarr.Array]) -> list[tuple[str, tuple[int, ...]]]:
    """The columns of `digests`: (array, chunk coordinates after the row) of every chunk of one row, the row arrays
    in write order, each array's chunks in grid order."""
    return [
        (name, coords)
        for name, array in arrays.items()
        if name not in (DIGESTS, "documents")
        for coords in np.ndindex(*array.cdata_shape[1:])
    ]


def chunk_digest(part: str, name: str, key: str, checksum: bytes) -> int:
    """What binds a chunk to its place: the CRC32C of its path in the store (`parts/rank00000/hidden/c/4/0/0`, UTF-8)
    followed by its own CRC32C (the 4 bytes that end its file). A chunk copied or moved to another row, array or
    part keeps a valid CRC32C, but not the digest its new place records."""
    return google_crc32c.value(f"parts/{part}/{name}/{key}".encode() + checksum)


def stored_checksum(path: Path) -> bytes:
    """The CRC32C that ends a chunk file, as stored (little endian)."""
    with open(path, "rb") as f:
        f.seek(-4, os.SEEK_END)
        return f.read(4)


def place_digest(folder: Path, name: str, key: str) -> int:
    """The digest (`chunk_digest`) of chunk file `name/key` of the part at `folder`, as the file is now."""
    return chunk_digest(folder.name, name, key, stored_checksum(folder / name / key))


def document_digests(folder: Path, array: zarr.Array) -> list[int]:
    """The digest of each chunk of the documents table of the part at `folder` as it is now, in grid order: what the
    table's attribute `digests` records, since the part's `digests` array has columns for the row arrays only."""
    keys = (array.metadata.encode_chunk_key(coords) for coords in np.ndindex(*array.cdata_shape))
    return [place_digest(folder, "documents", key) for key in keys]


def misplaced_documents(folder: Path, array: zarr.Array) -> list[tuple[tuple[int, ...], str]]:
    """(chunk coordinates, problem) of each chunk of the part's documents table that is not the one written at its
    place, against its attribute `digests` (all named when that is missing: a zarr.json rebuilt by --repair, which
    then rewrites the table). Every chunk file must be there."""
    grid, recorded = list(np.ndindex(*array.cdata_shape)), array.attrs.get(DIGESTS)
    if not isinstance(recorded, list) or len(recorded) != len(grid):
        return [(coords, "the digests of the documents table are not recorded in its zarr.json") for coords in grid]
    return [
        (coords, misplaced(folder / "documents" / array.metadata.encode_chunk_key(coords)))
        for coords, now, then in zip(grid, document_digests(folder, array), recorded)
        if now != then
    ]


def misplaced(path: Path) -> str:
    return (
        f"chunk file {path} is not the chunk written there: its CRC32C is valid, but not the digest recorded for its "
        "place (a chunk of another row, array or part was copied or moved here)"
    )


def row_arrays(features: FeatureSpec, token_budget: int) -> dict[str, tuple[tuple[int, ...], type]]:
    """Name -> (shape, numpy dtype) of every per-row array: what a reader allocates for one row."""
    T = token_budget
    out = {"hidden": ((T, features.width), HIDDEN_DTYPES[features.precision])}
    if features.precision == "fp8":
        out["scales"] = ((T, features.scale_groups), SCALE_DTYPE)
    out.update({name: ((T,), np.dtype(dtype).type) for name, dtype in TOKEN_ARRAYS.items()})
    return out


def teacher_arrays(teacher: TeacherSpec | None, token_budget: int) -> dict[str, tuple[tuple[int, ...], type]]:
    """Name -> (shape, numpy dtype) of every per-row teacher array ({} without a teacher)."""
    if teacher is None:
        return {}
    return {
        name: ((token_budget,) if name == "teacher_tail" else (token_budget, teacher.width), TEACHER_DTYPES[dtype])
        for name, dtype in teacher.arrays.items()
    }


def hidden_compressors(features: FeatureSpec):
    """The codec of the stored features, chosen by bench/codecs.py (docs/shard-format.md); CRC32C last. bf16:
    Blosc-LZ4 with bit shuffle (sign and exponent bits gather into runs). fp8: zstd, which finds what is left in
    e4m3 bytes and bit shuffle does not."""
    if features.precision == "fp8":
        return [ZstdCodec(level=1), Crc32cCodec()]
    return [BloscCodec(**HIDDEN_BLOSC, shuffle="bitshuffle", typesize=2), Crc32cCodec()]


def token_compressors():
    return [ZstdCodec(level=1), Crc32cCodec()]


def compressors_of(name: str, features: FeatureSpec) -> list:
    if name == "teacher_hidden":
        return hidden_compressors(BF16)
    return hidden_compressors(features) if name == "hidden" else token_compressors()


def hidden_chunk_tokens(token_budget: int, row_bytes_per_token: int) -> int:
    """Tokens per hidden chunk: the fewest equal token slices of a row that keep a chunk under CHUNK_BYTES."""
    slices = max(1, math.ceil(token_budget * row_bytes_per_token / CHUNK_BYTES))
    return math.ceil(token_budget / slices)


def array_config(read: bool) -> dict:
    # Every chunk is written, even all-padding ones, so that a missing chunk file means damage; zarr >= 3.2
    # can then be told to raise on a missing chunk instead of returning fill values.
    if not read:
        return {"write_empty_chunks": True}
    return {"read_missing_chunks": False} if "read_missing_chunks" in zarr.config.get("array") else {}


def target_path(path: Path, manifest: Manifest) -> str:
    """The target checkpoint a store was harvested from: an absolute path as recorded, a relative one resolved
    against the store's parent folder (older stores), or a hub name when no such folder exists."""
    model = str(manifest.fingerprint.get("model", manifest.target.name))
    if Path(model).is_absolute():
        return model
    for base in (Path(path).resolve().parent, Path.cwd()):
        if (base / model / "config.json").is_file():
            return str((base / model).resolve())
    if model.startswith((".", "~")) or os.sep + os.sep in model or model.count("/") > 1:
        raise DflashError(
            f"{path} records its target as the relative path {model!r}, which is not a model folder relative to the "
            "store's parent or the current folder; pass the target's folder explicitly (--target / --model)"
        )
    return model


def read_document_sources(out: Path) -> np.ndarray | None:
    """Each doc id's data source, None for a store of one source (or one made before stores recorded them)."""
    stored = read_whole(out, DOCUMENT_SOURCES, "document sources", DOCUMENT_SOURCES_FIX)
    return None if stored is None else stored[0]


def read_projection(out: Path) -> tuple[np.ndarray, dict] | None:
    """(P, calibration record) of a subspace store, None when it has none (yet)."""
    return read_whole(out, PROJECTION, "projection", PROJECTION_FIX)


def damaged_whole_arrays(out: Path, header: Manifest) -> dict[str, str]:
    """The store-level arrays of `out` that fail `read_whole` (or that a subspace store lacks): name -> problem."""
    damaged = {}
    for name, read in ((PROJECTION, read_projection), (DOCUMENT_SOURCES, read_document_sources)):
        try:
            if read(out) is None and name == PROJECTION and header.features.subspace is not None:
                damaged[name] = f"the subspace store {out} has no {PROJECTION} array"
        except DflashError as exc:
            damaged[name] = str(exc)
    return damaged


def open_manifest(path: Path) -> Manifest:
    if not path.is_dir():
        raise DflashError(f"{path} is not a folder; pass the folder a harvest wrote (it holds {MANIFEST_FILE})")
    rewrite = (
        "rerun the harvest command, which rewrites it from harvest.json and the parts' progress.json (and runs the "
        "self-check again)"
    )
    try:
        manifest = read_manifest(path / MANIFEST_FILE)
    except NewerFormat:
        raise
    except DflashError as exc:
        raise DflashError(f"{str(exc).split('; restore it')[0]}; {rewrite}") from None
    if manifest is not None:
        if not manifest.complete:
            raise DflashError(f"{path / MANIFEST_FILE} has no counts; the file is damaged: {rewrite}")
        return manifest
    header = read_manifest(path / HARVEST_FILE)
    if header is None:
        raise DflashError(f"{path} is not a dflash store (no {HARVEST_FILE} or {MANIFEST_FILE})")
    progress = part_progress(path, header.world_size)
    done = sum(p is not None and p["rows_committed"] == p["rows"] for p in progress)
    raise DflashError(
        f"{path} is an incomplete store ({done} of {header.world_size} parts done, no {MANIFEST_FILE}); rerun the "
        "same harvest command to finish it"
    )


# The codecs the direct reader decodes itself (zarr's codec name -> numcodecs' implementation of the same format).
DIRECT_DECODERS = {"BloscCodec": numcodecs.Blosc, "ZstdCodec": numcodecs.Zstd}


class ChunkReader:
    """Reads a row's chunks of one array into a caller's buffer: the chunk file, its CRC32C, the decode in place.

    The mirror of HiddenChunkWriter for the hidden states and of zarr's writes for the token arrays. Zarr's read
    path decodes into an array of its own (one more copy of every row) and routes each read through its
    event-loop thread; here the heavy work (file reads, blosc / zstd) releases the GIL and runs in the calling
    thread, so the trainer's reader threads decode rows in parallel.
    """

    def __init__(self, array: zarr.Array, folder: Path, compressors: list):
        codecs = [type(c).__name__ for c in (array.serializer, *array.filters, *array.compressors)]
        expected = ["BytesCodec", *(type(c).__name__ for c in compressors)]
        endian = getattr(
            array.serializer.endian, "value", array.serializer.endian
        )  # an enum before zarr 3.4, a str since
        if codecs != expected or (endian != "little" and array.dtype.itemsize > 1):
            raise DflashError(
                f"the {folder.name} array in {folder.parent} is encoded as {codecs}, not the {' -> '.join(expected)} "
                "chain (little endian) this version of dflash reads; harvest again with this version"
            )
        self.array, self.folder = array, folder
        self.part, self.name = folder.parent.name, folder.name
        self.chunk_tokens = array.chunks[1]
        self.dtype = array.dtype
        self.codec = DIRECT_DECODERS[expected[1]]()  # decoding reads its settings from each chunk's header

    def read_row_into(
        self, row: int, out: np.ndarray, piece: int = 0, pieces: int = 1, digests: np.ndarray | None = None
    ) -> None:
        """Row `row` into `out` ([T, ...]); decoded in place when `out` holds integers of the stored size. With
        `pieces` > 1 only the chunks j with j % pieces == piece: threads reading the pieces of one row in parallel
        write disjoint token ranges. `digests`: the row's recorded digest of chunk j at j (None: not checked)."""
        T = out.shape[0]
        # Integers of the stored size take the stored bits unchanged (bfloat16 bits as int16 or uint16); any other
        # dtype gets the values converted.
        same_bits = out.dtype == self.dtype or (
            out.dtype.itemsize == self.dtype.itemsize and out.dtype.kind in "iu" and self.dtype.kind in "iu"
        )
        for j in range(piece, -(-T // self.chunk_tokens), pieces):
            start = j * self.chunk_tokens
            stop = min(start + self.chunk_tokens, T)
            encoded = self._checked_chunk(row, j, None if digests is None else digests[j])
            if same_bits and out.flags.c_contiguous and stop - start == self.chunk_tokens:
                self.codec.decode(encoded, out=out[start:stop])
                continue
            # The grid's edge chunk is stored whole, padded past the row's end; or `out` holds another dtype.
            chunk = np.frombuffer(self.codec.decode(encoded), self.dtype).reshape(-1, *out.shape[1:])[: stop - start]
            np.copyto(out[start:stop], chunk.view(out.dtype) if same_bits else chunk, casting="unsafe")

    def _checked_chunk(self, row: int, j: int, digest: int | None) -> bytes:
        """The chunk's encoded bytes, after checking the CRC32C that follows them (as zarr's crc32c codec does) and
        that the chunk is the one written at its place (`digest`, when given)."""
        coords = (row, j) + (0,) * (self.array.ndim - 2)
        key = self.array.metadata.encode_chunk_key(coords)
        path = self.folder / key
        try:
            with open(path, "rb") as f:
                encoded = f.read(max(os.fstat(f.fileno()).st_size - 4, 0))  # no copy to split off the checksum
                stored = f.read(4)
        except FileNotFoundError:
            raise DflashError(f"chunk file missing: {path}") from None
        if len(stored) != 4 or int.from_bytes(stored, "little") != google_crc32c.value(encoded):
            raise DflashError(f"checksum mismatch in chunk file {path}")
        if digest is not None and chunk_digest(self.part, self.name, key, stored) != digest:
            raise DflashError(misplaced(path))
        return encoded


class Store:
    """Read side: opening reads only the manifest, the parts' progress.json and the arrays' metadata, whatever the
    store's size."""

    def __init__(self, path: Path, manifest: Manifest):
        self.path = path
        self.manifest = manifest
        self.features = manifest.features
        self.token_budget = manifest.token_budget
        self.num_rows = manifest.counts.rows
        self.part_names = [part.name for part in manifest.parts]
        self.part_starts = np.cumsum([0] + [part.rows for part in manifest.parts]).tolist()
        self.row_layout = row_arrays(self.features, self.token_budget)
        self.teacher = manifest.teacher
        self.teacher_layout = teacher_arrays(self.teacher, self.token_budget)  # read apart: see read_teacher_into
        self.digested = manifest.format_version >= DIGESTS_SINCE
        if not self.digested:
            logger.warning(
                "%s is a store of format version %d, which records no chunk digests: a chunk file copied or moved to "
                "another row, array or part is read unnoticed (a harvest with this dflash records them)",
                path,
                manifest.format_version,
            )
        names = [name for name in arrays_of(self.features, self.teacher) if name != DIGESTS or self.digested]
        self._check_parts_headers()
        try:
            group = zarr.open_group(path, mode="r")
            self.parts = [
                {name: group[f"parts/{part}/{name}"].with_config(array_config(read=True)) for name in names}
                for part in self.part_names
            ]
        except Exception as exc:  # a missing part folder or array, damaged zarr.json metadata
            raise DflashError(
                f"the arrays of {path} cannot be opened ({type(exc).__name__}: {exc}); their metadata is damaged: "
                "rerun the harvest command of each rank with --repair, which rebuilds the zarr.json files from "
                "harvest.json and then re-harvests any damaged rows (or restore the parts folder)"
            ) from None
        columns = [name for name, _ in chunk_columns(self.parts[0])]  # every part has the same layout
        self.first_column = {name: columns.index(name) for name in set(columns)}  # of each row array in `digests`
        self.digest_layout = {DIGESTS: ((len(columns),), np.uint32)} if self.digested else {}
        for entry, arrays in zip(manifest.parts, self.parts):
            self._check_shapes(entry, arrays)
            missing = missing_chunks(arrays["documents"], path / "parts" / entry.name / "documents")
            if missing:
                raise DflashError(
                    f"the documents table of part {entry.name} of {path} is damaged (chunk file "
                    f"{', '.join(missing[:3])} missing: it would read as zeros); {REPAIR} for rank "
                    f"{int(entry.name.removeprefix('rank'))}, which rewrites it"
                )
        self.row_readers = self._chunk_readers(self.row_layout)
        self.teacher_readers = self._chunk_readers(self.teacher_layout)
        self.digest_readers = self._chunk_readers(self.digest_layout)
        self.document_sources = read_document_sources(path)  # int16 [doc ids]: a store of several data sources
        self.projection = None  # P [width, feature_dim] float32 for a subspace store
        if self.features.subspace is not None:
            stored = read_projection(path)
            if stored is None or stored[0].shape != (self.features.width, manifest.feature_dim):
                raise DflashError(
                    f"{path} is a subspace store without a valid {PROJECTION} array ("
                    + ("none" if stored is None else f"its shape is {stored[0].shape}")
                    + f"); {PROJECTION_FIX}"
                )
            self.projection = stored[0]

    def _check_parts_headers(self) -> None:
        """Refuse a part put into the complete store from another harvest: its progress.json records the header its
        rows were written under, which every rank checked against harvest.json before each commit. A part whose
        record, or a store whose harvest.json, cannot be read is read unchecked, with a warning."""
        header = self._read_or_warn(self.path / HARVEST_FILE, read_manifest, "restore it from a copy of the store")
        if header is None:
            return
        fix = f"{REPAIR}, which rewrites it from {MANIFEST_FILE}"
        parts = [self.path / "parts" / name / PROGRESS_FILE for name in self.part_names]
        check_parts_agree(self.path, header, [self._read_or_warn(p, read_progress, fix) for p in parts], complete=True)

    @staticmethod
    def _read_or_warn(file: Path, read, fix: str):
        """`read(file)`, or None with a warning when the file is missing or damaged."""
        try:
            found = read(file)
            problem = None if found is not None else f"{file} is missing; {fix}"
        except DflashError as exc:
            found, problem = None, str(exc)
        if problem:
            logger.warning("%s; until then the store's parts are not all checked against its header", problem)
        return found

    def _chunk_readers(self, layout: dict) -> list[dict[str, ChunkReader]]:
        return [
            {
                name: ChunkReader(arrays[name], self.path / "parts" / part / name, compressors_of(name, self.features))
                for name in layout
            }
            for arrays, part in zip(self.parts, self.part_names)
        ]

    def _check_shapes(self, entry: PartEntry, arrays: dict) -> None:
        """The manifest's rows and documents against the arrays on disk: reader and verify see the same rows."""
        problems = [
            f"{name} has {array.shape[0]} rows and {array.shape[1:]} per row, expected {entry.rows} and {shape}"
            for name, (shape, _) in {**self.row_layout, **self.teacher_layout, **self.digest_layout}.items()
            if (array := arrays[name]).shape != (entry.rows, *shape)
        ]
        if arrays["documents"].shape != (entry.documents, len(DOCUMENT_COLUMNS)):
            problems.append(f"documents has {arrays['documents'].shape[0]} entries, expected {entry.documents}")
        if problems:
            raise DflashError(
                f"{self.path / MANIFEST_FILE} does not match part {entry.name}'s arrays ({'; '.join(problems)}); the "
                "manifest or the part was edited or replaced: restore it, or harvest again"
            )

    @classmethod
    def open(cls, path) -> "Store":
        path = Path(path)
        return cls(path, open_manifest(path))

    @property
    def self_check(self) -> SelfCheck | None:
        """The recorded check against the target (None if never run); `.passed` False: the features are wrong."""
        return self.manifest.self_check

    @property
    def feature_dim(self) -> int:
        """Width of the target's concatenated features (what the exported drafter's fc takes)."""
        return self.manifest.feature_dim

    def locate(self, i: int) -> tuple[int, int]:
        """(part index, row within the part) of global row i."""
        if not 0 <= i < self.num_rows:
            raise IndexError(f"row {i} out of range: the store has {self.num_rows} rows")
        part = bisect.bisect_right(self.part_starts, i) - 1
        return part, i - self.part_starts[part]

    def read_row(self, i: int) -> dict[str, np.ndarray]:
        """Row i as new arrays (`row_layout`: hidden [T, W] as stored bits, scales [T, G] for fp8, token arrays [T])."""
        out = {name: np.empty(shape, dtype) for name, (shape, dtype) in self.row_layout.items()}
        self.read_row_into(i, out)
        return out

    def read_row_into(self, i: int, out: dict[str, np.ndarray], piece: int = 0, pieces: int = 1) -> None:
        """Row i into the caller's arrays (the trainer's pinned slots): integers of the stored size for hidden and
        scales (the stored bits, e.g. int16 for bf16), the token arrays' own dtypes; no copy in between. `piece`
        of `pieces`: every pieces-th chunk of each array (ChunkReader.read_row_into), for parallel reads of a row."""
        for name, (shape, _) in self.row_layout.items():
            if out[name].shape != shape:
                raise DflashError(
                    f"the store's rows have {name} of shape {shape}, the reader expects {out[name].shape}"
                )
        stored = np.dtype(self.row_layout["hidden"][1])
        if out["hidden"].dtype.kind not in "iu" or out["hidden"].dtype.itemsize != stored.itemsize:
            raise DflashError(
                f"hidden states are stored as {self.features.precision} bits: read them into {stored.itemsize}-byte "
                f"integers (a view of the tensor), not {out['hidden'].dtype}"
            )
        self._read_into(i, self.row_readers, out, piece, pieces)

    def read_teacher(self, i: int) -> dict[str, np.ndarray]:
        """Row i's teacher arrays as new arrays (`teacher_layout`)."""
        out = {name: np.empty(shape, dtype) for name, (shape, dtype) in self.teacher_layout.items()}
        self.read_teacher_into(i, out)
        return out

    def read_teacher_into(self, i: int, out: dict[str, np.ndarray], piece: int = 0, pieces: int = 1) -> None:
        """Row i's teacher arrays into the caller's (`teacher_layout`: shape and dtype each; teacher_hidden as
        bf16 bits in 2-byte integers); `piece` of `pieces` as in read_row_into. Apart from read_row_into, so that a
        trainer reads them only when its method asks for the teacher."""
        if self.teacher is None:
            raise DflashError(f"{self.path} holds no teacher arrays; harvest it with --teacher topk:K or hidden")
        for name, (shape, dtype) in self.teacher_layout.items():
            got = out[name]
            same = got.dtype == dtype or (name == "teacher_hidden" and got.dtype == np.int16)
            if got.shape != shape or not same:
                raise DflashError(
                    f"the store's {name} is {np.dtype(dtype)} of shape {shape} per row, the reader gives "
                    f"{got.dtype} of shape {got.shape}"
                )
        self._read_into(i, self.teacher_readers, out, piece, pieces)

    def _read_into(
        self, i: int, readers: list[dict[str, ChunkReader]], out: dict[str, np.ndarray], piece: int, pieces: int
    ) -> None:
        part, row = self.locate(i)
        name = DIGESTS
        try:
            digests = self._recorded_digests(part, row)
            for name, chunk_reader in readers[part].items():
                mine = None if digests is None else digests[self.first_column[name] :]
                chunk_reader.read_row_into(row, out[name], piece, pieces, mine)
        except Exception as exc:  # a checksum mismatch, a chunk in another's place, a missing file, a codec error
            raise DflashError(
                f"corrupt data in {self.path}: row {i} (part {self.part_names[part]}, array {name}, row {row}): "
                f"{exc}; run `dflash inspect --verify` to list every damaged chunk, then {REPAIR} for rank "
                f"{int(self.part_names[part].removeprefix('rank'))}, which re-harvests the damaged rows"
            ) from exc

    def _recorded_digests(self, part: int, row: int) -> np.ndarray | None:
        """The digest of each chunk of a part's row (`digests`' columns), None in stores older than them."""
        if not self.digested:
            return None
        digests = np.empty(*self.digest_layout[DIGESTS])
        self.digest_readers[part][DIGESTS].read_row_into(row, digests)
        return digests

    def documents(self) -> np.ndarray:
        """int64 [n_docs, 5] of DOCUMENT_COLUMNS for the whole store, with global row numbers."""
        tables = []
        for part, start, name in zip(self.parts, self.part_starts, self.part_names):
            try:
                table = part["documents"][:]
                if self.digested and (found := misplaced_documents(self.path / "parts" / name, part["documents"])):
                    raise DflashError(found[0][1])
            except Exception as exc:  # a checksum mismatch, a codec error, a chunk in another's place
                raise DflashError(
                    f"the documents table of part {name} of {self.path} is damaged ({type(exc).__name__}: {exc}); "
                    f"{REPAIR} for rank {int(name.removeprefix('rank'))}, which rewrites it"
                ) from None
            table[:, 2] += start
            tables.append(table)
        return np.concatenate(tables) if tables else np.zeros((0, len(DOCUMENT_COLUMNS)), np.int64)


# ------------------------------------------------------------------------------------------- verify / inspect


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
