"""Where documents come from: files of several kinds and record shapes, folders of shards, weighted mixtures.

A source is a path with an optional weight, `PATH` or `PATH:WEIGHT` (a path that exists as given wins, so a
name holding ':' still works). The path is one file or a folder, read recursively in sorted order, of:
- JSONL: `.jsonl` / `.json` (one object per line), plain or compressed (`.gz`, `.zst`), decompressed as a
  stream, line by line;
- Parquet: `.parquet`, read in record batches; each row is one record (a null column is an absent key).

Every record is normalised to one of the kinds dflash/data/__init__.py tokenises (`messages`, `text`, `prompt` /
`completion`): a ShareGPT `{"conversations": [{"from": ..., "value": ...}]}` becomes `messages`, its roles
mapped (human -> user, gpt -> assistant, ...); tool turns keep their role for the chat template to render.

Mixing (`mix`): identical records (same kind and content, whatever the file shape) are kept once, the first
seen in source order, unless dedup is off; then weight w takes round(w * n) of a source's n records: w < 1 a
seeded sample of them, w > 1 every record floor(w) times plus a seeded sample for the rest. One source of
weight 1 keeps its file order; anything else is shuffled, seeded. `limit` keeps the first N after mixing.
Mixing reads the files twice, as streams: a first pass keeps 17 bytes a record (its dedup hash and kind) to
choose and order the records, `Mixture.read` a second pass yields the chosen ones, so memory stays flat in the
data's size.
"""

import gzip
import hashlib
import io
import json
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash.errors import DflashError

LINE_EXAMPLE = (
    '{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}, '
    '{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}, {"text": ...} '
    'or {"prompt": ..., "completion": ...}'
)
JSONL_SUFFIXES = (".jsonl", ".json")
COMPRESSIONS = ("", ".gz", ".zst")
SUFFIXES = tuple(s + c for s in JSONL_SUFFIXES for c in COMPRESSIONS) + (".parquet",)
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}
# Turns of tools and their calls: rendered by the chat template as given, never in the loss.
TOOL_ROLES = ("tool", "function", "function_call", "observation", "ipython")
SHAREGPT_KEEP = ("tool_calls", "tool_call_id", "name")  # keys of a turn kept beside its role and content
PARQUET_BATCH = 1024  # rows decoded at a time: memory stays that of one batch whatever the file's size


@dataclass(frozen=True)
class Source:
    path: Path
    weight: float | None = None  # None: not given, i.e. 1

    @property
    def name(self) -> str:
        return str(self.path) + ("" if self.weight is None else f":{self.weight:g}")


def parse_source(spec: str | Path) -> Source:
    """`PATH` or `PATH:WEIGHT`; an existing path is taken whole, even with a ':' in it."""
    text = str(spec)
    path, sep, raw = text.rpartition(":")
    if Path(text).exists() or not sep or "/" in raw:
        return Source(Path(text))
    try:
        weight = float(raw)
    except ValueError:
        weight = math.nan
    if not math.isfinite(weight) or weight < 0:
        raise DflashError(
            f"data source {text}: the weight {raw!r} after the last ':' is not a number >= 0 (and no file {text} "
            "exists); write PATH or PATH:WEIGHT, e.g. chat.jsonl:0.5"
        )
    return Source(Path(path), weight)


def source_files(path: Path) -> list[Path]:
    """The data files of one source: the file itself, or every data file under the folder, sorted."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DflashError(
            f"cannot read data file {path}: it does not exist; pass a JSONL or Parquet file, or a folder of them "
            f"({', '.join(SUFFIXES)})"
        )
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))
    if not files:
        raise DflashError(
            f"data folder {path} holds no data file (none ending in {', '.join(SUFFIXES)}); pass a folder of shards"
        )
    return files


def iter_records(specs) -> Iterator[tuple[str, dict]]:
    """(where, record) for every record of every source, in order, each normalised to dflash's kinds (weights are
    ignored: this is every record once). `where` names the file and the line (JSONL) or row (Parquet)."""
    for spec in [specs] if isinstance(specs, (str, Path)) else specs:
        for path in source_files(parse_source(spec).path):
            for where, record in _file_records(path):
                yield where, normalise(record, where)


def _file_records(path: Path) -> Iterator[tuple[str, object]]:
    if path.name.endswith(".parquet"):
        yield from _parquet_records(path)
        return
    if not path.name.endswith(SUFFIXES):
        raise DflashError(f"data file {path}: unknown file kind; name it {', '.join(SUFFIXES)}")
    try:
        with _open_lines(path) as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    yield f"{path} line {number}", decode_json_line(line, f"{path} line {number}")
    except (EOFError, zlib.error, gzip.BadGzipFile, *_zstd_errors()) as exc:
        raise DflashError(f"data file {path} is damaged ({exc}); recompress it or replace it") from exc
    except OSError as exc:
        raise DflashError(f"cannot read data file {path}: {exc.strerror or exc}; check that it is readable") from exc


def _open_lines(path: Path):
    """A binary stream of the file's lines, decompressed on the fly. Lines split at b'\\n' only: str.splitlines
    would also break at U+2028, U+2029 and U+0085, which json.dumps(ensure_ascii=False) writes raw in strings."""
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.name.endswith(".zst"):
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True, closefd=True)
        return io.BufferedReader(reader)
    return open(path, "rb")


def _zstd_errors() -> tuple:
    """zstandard's error class, or none where it is not installed (then no .zst file was opened): the except
    clause that names it is also evaluated for a reader stopped early, which must not fail on the import."""
    try:
        import zstandard
    except ImportError:
        return ()
    return (zstandard.ZstdError,)


def _parquet_records(path: Path) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        number = 0
        for batch in file.iter_batches(batch_size=PARQUET_BATCH):
            for row in batch.to_pylist():
                number += 1
                yield f"{path} row {number}", _without_nulls(row)
    except pa.ArrowException as exc:
        raise DflashError(f"data file {path} is damaged ({exc}); check that it is a complete Parquet file") from exc
    except OSError as exc:
        raise DflashError(f"cannot read data file {path}: {exc.strerror or exc}; check that it is readable") from exc


def _without_nulls(value):
    """A Parquet row as the JSON object it stands for: a null is a key the record does not have (a column of
    `completion` is null in the rows of `text` records, a `name` field null in most messages)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def decode_json_line(line: bytes, where: str):
    try:
        # utf-8-sig: the byte order mark Windows editors start a UTF-8 file with is no part of the first object.
        # Without its line break, json's column is the line's own (past it, json counts a second line).
        text = line.decode("utf-8-sig").rstrip("\r\n")
        return json.loads(text)
    except UnicodeDecodeError as exc:
        raise DflashError(
            f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start}); re-encode the file as UTF-8"
        ) from exc
    except json.JSONDecodeError as exc:
        cut = exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string")
        at = f"{exc.msg.removesuffix(' at')} at column {exc.pos + 1}"
        raise DflashError(
            f"{where}: malformed JSON ({at}{': the line ends before its object does (cut off?)' if cut else ''}); "
            f"each line must be one JSON object, {LINE_EXAMPLE}"
        ) from exc


def normalise(record, where: str):
    """A ShareGPT record as an OpenAI `messages` one; other records unchanged (records.check_record checks them)."""
    if not isinstance(record, dict) or "conversations" not in record:
        return record
    if "messages" in record:
        raise DflashError(f'{where}: the object has both "conversations" and "messages"; keep one, {LINE_EXAMPLE}')
    turns = record["conversations"]
    if not isinstance(turns, list) or not turns:
        raise DflashError(f'{where}: "conversations" must be a non-empty list of {{"from": ..., "value": ...}} objects')
    rest = {k: v for k, v in record.items() if k != "conversations"}
    return {**rest, "messages": [_sharegpt_turn(turn, n, where) for n, turn in enumerate(turns, start=1)]}


def _sharegpt_turn(turn, number: int, where: str) -> dict:
    if not isinstance(turn, dict):
        raise DflashError(f'{where}: conversation turn {number} must be an object with "from" and "value"')
    role = turn["from"] if "from" in turn else turn.get("role")
    content = turn["value"] if "value" in turn else turn.get("content")
    if role not in SHAREGPT_ROLES and role not in TOOL_ROLES:
        raise DflashError(
            f"{where}: conversation turn {number} has the role {role!r}, which dflash does not know; use one of "
            f"{', '.join(SHAREGPT_ROLES)} (or a tool role: {', '.join(TOOL_ROLES)})"
        )
    # The keys of tool use go with the turn (its calls, the name of the tool a result comes from): never dropped.
    extra = {key: turn[key] for key in SHAREGPT_KEEP if key in turn}
    return {"role": SHAREGPT_ROLES.get(role, role), "content": content, **extra}


# ---- mixing -------------------------------------------------------------------------------------------------


@dataclass
class SourceStats:
    source: str  # as given, with its weight
    weight: float = 1.0
    records: int = 0  # records read
    deduplicated: int = 0  # records dropped as copies of one seen before (in this or an earlier source)
    used: int = 0  # records taken into the mixture, repeats counted (after --limit)
    documents: int = 0  # documents (pieces) it gave after tokenisation
    tokens: int = 0
    loss_tokens: int = 0


@dataclass
class Mixture:
    """The mixture as integers: a record is its index among every record read, in source and file order. The
    records themselves are not kept: `read` streams the files again for the ones asked for."""

    order: np.ndarray  # int64 [n]: the record of each mixture entry, in the mixed order
    kinds: np.ndarray  # uint8 [records read]: each record's kind, an index into `kind_names`
    kind_names: list[str]
    ends: np.ndarray  # int64 [sources]: one past each source's last record
    sources: list[SourceStats]
    specs: list[Source] = field(repr=False)
    parse: object = field(repr=False)

    def source_of(self, records: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.ends, records, side="right")

    def read(self, wanted: np.ndarray) -> Iterator[tuple[str, str, object]]:
        """(where, kind, payload) of each record in `wanted` (sorted, unique), in that order."""
        wanted = iter(wanted.tolist())
        want = next(wanted, None)
        records = enumerate(_all_records(self.specs))
        while want is not None:  # the files are read up to the last record wanted only
            index, (where, record) = next(records, (None, (None, None)))
            if index is None:
                raise DflashError(f"the data ({', '.join(s.name for s in self.specs)}) changed while it was read")
            if index == want:
                yield where, *self.parse(record, where)
                want = next(wanted, None)


def dedup_key(kind: str, payload) -> bytes:
    """The normalised record's identity: a ShareGPT conversation and its OpenAI form share it."""
    text = json.dumps([kind, payload], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def mix(specs, parse, seed: int = 0, dedup: bool = True, limit: int | None = None) -> Mixture:
    """Read every source, parse each record with `parse(record, where) -> (kind, payload)`, and mix them: one
    streaming pass keeps each record's dedup hash and kind, and the mixture is computed from those."""
    sources = [parse_source(spec) for spec in ([specs] if isinstance(specs, (str, Path)) else specs)]
    if not sources:
        raise DflashError("no data given; pass --data FILE (repeatable, FILE:WEIGHT to weigh a source)")
    if limit is not None and limit < 1:
        raise DflashError(f"--limit {limit}: give at least 1 document, or leave it out")
    keys, kinds, kind_names, stats, ends = bytearray(), bytearray(), [], [], []
    for source in sources:
        counts = SourceStats(source.name, 1.0 if source.weight is None else source.weight)
        for where, record in _source_records(source):
            kind, payload = parse(record, where)
            if kind not in kind_names:
                kind_names.append(kind)
            kinds.append(kind_names.index(kind))
            keys += dedup_key(kind, payload) if dedup else b""
            counts.records += 1
        if not counts.records:
            raise DflashError(f"data source {source.path} holds no documents; write one {LINE_EXAMPLE} per line")
        stats.append(counts)
        ends.append(len(kinds))
    kept = _first_copies(keys, len(kinds)) if dedup else np.arange(len(kinds))
    order = _mixed_order(kept, np.asarray(ends), sources, stats, seed)[:limit]
    if not len(order):
        raise DflashError(f"the data ({', '.join(s.name for s in sources)}) gives no document; raise the weights")
    mixture = Mixture(order, np.frombuffer(kinds, np.uint8), kind_names, np.asarray(ends), stats, sources, parse)
    for source, used in enumerate(np.bincount(mixture.source_of(order), minlength=len(sources)).tolist()):
        stats[source].used = used
    return mixture


def _first_copies(keys: bytearray, n: int) -> np.ndarray:
    """The sorted indices of the records whose 16-byte key was not seen before (np.unique's index is the first)."""
    _, first = np.unique(np.frombuffer(keys, np.uint64).reshape(n, 2), axis=0, return_index=True)
    return np.sort(first)


def _mixed_order(kept: np.ndarray, ends: np.ndarray, sources: list[Source], stats, seed: int) -> np.ndarray:
    """Weight each source's kept records, then shuffle them all, seeded, unless one source of weight 1."""
    rng = np.random.default_rng(seed)
    parts = np.split(kept, np.searchsorted(kept, ends[:-1]))
    for counts, part in zip(stats, parts):
        counts.deduplicated = counts.records - len(part)
    for source, part in zip(sources, parts):
        if source.weight and len(part) and not round(source.weight * len(part)):
            raise DflashError(
                f"data source {source.name} takes round({source.weight:g} x {len(part)} records) = 0 of them; give it "
                f"a weight of at least {1 / len(part):.2g} to take some, or 0 to leave it out on purpose"
            )
    chosen = [part[_weighted(len(part), source.weight, rng)] for source, part in zip(sources, parts)]
    order = np.concatenate(chosen).astype(np.int64)
    if not (len(sources) == 1 and sources[0].weight in (None, 1)):
        order = order[rng.permutation(len(order))]
    return order


def _source_records(source: Source) -> Iterator[tuple[str, object]]:
    for path in source_files(source.path):
        yield from _file_records(path)


def _all_records(sources: list[Source]) -> Iterator[tuple[str, object]]:
    for source in sources:
        yield from _source_records(source)


def _weighted(n: int, weight: float | None, rng: np.random.Generator) -> list[int]:
    """round(weight * n) indices into n records: whole passes in order, then a seeded sample without repeats."""
    if weight is None or n == 0:
        return list(range(n))
    passes, rest = divmod(round(weight * n), n)
    return list(range(n)) * passes + sorted(rng.choice(n, rest, replace=False).tolist())


def identity(specs, **options) -> dict:
    """Size and sha256 of the data: a resumed harvest must read the very same documents. One plain file, with the
    default options, keeps the digest of its bytes; anything else hashes every file with the sources and options."""
    sources = [parse_source(spec) for spec in ([specs] if isinstance(specs, (str, Path)) else specs)]
    files = [(source, path) for source in sources for path in source_files(source.path)]
    digests = [_file_digest(path) for _, path in files]
    size = sum(size for size, _ in digests)
    if len(files) == 1 and sources[0].weight is None and files[0][1] == sources[0].path and not options:
        return {"data_bytes": size, "data_sha256": digests[0][1]}
    whole = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    for (source, path), (_, digest) in zip(files, digests):
        whole.update(f"{source.weight}\0{path.relative_to(source.path) if path != source.path else ''}\0".encode())
        whole.update(digest.encode())
    return {"data_bytes": size, "data_sha256": whole.hexdigest()}


def _file_digest(path: Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(16 << 20):
                digest.update(chunk)
                size += len(chunk)
    except OSError as exc:
        raise DflashError(f"cannot read data file {path}: {exc.strerror}; check that it is readable") from exc
    return size, digest.hexdigest()
