"""Documents -> token ids and loss masks, validated in full before anything is written.

dflash/data/sources.py reads the records (JSONL, compressed JSONL, Parquet, folders, weighted mixtures) and turns
ShareGPT `conversations` into `messages`; each record is one document:
- `{"messages": [{"role": ..., "content": ...}, ...]}` is rendered with the tokenizer's chat template; the loss
  mask is on for the tokens of each assistant turn as the model generates it: from the first character after
  the generation prompt (`<|im_start|>assistant\\n`) to the end of the turn, including its end-of-turn token
  (`<|im_end|>`) so that the drafter learns to stop, excluding the whitespace a template writes after that token
  (the model never generates it). Everything else (system, user, tool turns, role headers) is off. A tool turn
  (sources.TOOL_ROLES) the chat template does not render is refused, never dropped silently. In a conversation
  where `dflash regenerate` marked the turns the target wrote (`"target": true`), only those are on: the other
  assistant turns were written by the data, not the target, and are context (counted as `context_turns`). A target
  turn marked `"unfinished": true` (cut at regenerate's --max-new-tokens) keeps the end-of-turn token that closes
  it out of the loss: the target never wrote it there (counted as `unfinished`).
- `{"text": "..."}` is tokenised as the tokenizer does by default (its BOS if it defines one; no EOS added) and
  the loss mask is on for every token.
- `{"prompt": "...", "completion": "..."}` (what `dflash regenerate` writes for text prompts) is tokenised as the
  text prompt + completion; the loss mask is on for the tokens holding completion characters only, since the
  drafter drafts what the target writes, not the prompt it was given. A completion that ends up without a loss
  token (an empty response) is dropped and counted, like a split-off prompt; one marked `"unfinished": true` is
  counted (no end-of-text token is on its loss either way).

Blank lines are skipped; `doc_id` is the 0-based index of the record in the mixture (the file's order for one
source), error messages name the file and its 1-based line (or Parquet row). Documents longer than `max_length`
are truncated or split into standalone pieces; pieces left with no loss token (for example a split-off prompt, or a
long chat truncated inside its prompt) are dropped, since they could hold no training block, and counted (the log
says when a truncated document is then dropped). The documents' tokens are spilled to a temporary
file and mapped back (`_Spill`), so that they do not sit in the Python heap; the records' text is read twice as a
stream (sources.Mixture.read), never held. A record that fails to tokenise is reported first in file order.
"""

import array
import itertools
import logging
import math
import multiprocessing
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from dflash.data import chat, sources
from dflash.data.records import check_record
from dflash.errors import DflashError

logger = logging.getLogger("dflash")

OVERFLOW_MODES = ("truncate", "split")
TRUNCATION_WARNING = 0.5  # a truncation dropping more than this share of a document's tokens is warned about
TURN_COUNTS = ("context_turns", "unfinished")  # DataStats fields counted per record while it is encoded


@dataclass
class Document:
    doc_id: int  # index of the source line (0-based); split pieces share it
    piece: int  # 0 unless a long document was split
    input_ids: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # uint8 [n]: 1 on assistant tokens (chat), completion tokens or every token (text)
    source: int = 0  # index of its data source, in the order of --data


@dataclass
class DataConfig:
    path: (
        str | Path | list
    )  # one source or several: PATH or PATH:WEIGHT, each a file or a folder (dflash/data/sources.py)
    max_length: int = 3072
    overflow: str = "truncate"  # "truncate" | "split"
    workers: int = 1
    sample: int | None = None  # tokenize only this many records, a seeded random choice (dflash plan)
    seed: int = 0  # of the mixture's weighted sampling and order
    dedup: bool = True  # keep one of identical records
    limit: int | None = None  # keep the first N records of the mixture
    spill_dir: str | Path | None = None  # where the documents' tokens are spilled to (None: the system's temp dir)


@dataclass
class DataStats:
    lines: int = 0  # records in the mixture (after dedup, weights and limit)
    lines_used: int = 0  # records tokenized (fewer than `lines` for a sample)
    records_read: int = 0  # records of every source
    deduplicated: int = 0  # records dropped as copies of earlier ones
    chat: int = 0  # lines tokenized of each kind
    text: int = 0
    completion: int = 0
    truncated: int = 0  # documents cut to max_length ...
    truncated_tokens: int = 0  # ... and the tokens that cut dropped
    truncated_dropped: int = 0  # truncated documents then dropped: their kept tokens hold no loss token
    split: int = 0  # documents split ...
    split_pieces: int = 0  # ... into this many pieces
    dropped_no_loss: int = 0  # pieces (or truncated documents) left without a loss token
    context_turns: int = 0  # assistant turns the data wrote in conversations the target answered: no loss
    unfinished: int = 0  # target answers cut at regenerate's --max-new-tokens: no end-of-turn token on the loss
    documents: int = 0  # documents returned, pieces counted one by one
    tokens: int = 0
    loss_tokens: int = 0
    truncated_most: int = 0  # truncated documents that lost more than TRUNCATION_WARNING of their tokens ...
    largest_cut: int = 0  # ... the most tokens one truncation dropped ...
    largest_cut_line: int = -1  # ... and that document's index (0-based; -1: none) ...
    largest_cut_dropped: bool = False  # ... and whether it was then dropped (no loss token in what it kept)
    sources: list[dict] = field(default_factory=list)  # per source: sources.SourceStats

    def summary(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name)}" for f in fields(self) if f.name != "sources")


def load_documents(cfg: DataConfig, tokenizer_path: str) -> tuple[list[Document], DataStats]:
    """Read, validate, mix and tokenise the records of `cfg.path`; raise DflashError on the first bad record."""
    _check_config(cfg)
    with _Encoder(tokenizer_path, cfg.workers) as encoder:  # its pool starts while the mixture reads
        mixture = sources.mix(cfg.path, _parse_document, cfg.seed, cfg.dedup, cfg.limit)
        chosen = np.arange(len(mixture.order))
        if cfg.sample is not None and cfg.sample < len(chosen):
            chosen = np.sort(np.random.default_rng(0).choice(len(chosen), cfg.sample, replace=False))
        records = mixture.order[chosen]
        per_kind = np.bincount(mixture.kinds[records], minlength=len(mixture.kind_names)).tolist()
        stats = DataStats(len(mixture.order), len(chosen), **dict(zip(mixture.kind_names, per_kind)))
        if encoder.tokenizer.chat_template is None and stats.chat:
            raise DflashError(
                f"the tokenizer at {tokenizer_path} has no chat template, but {_names(cfg.path)} holds chat records; "
                'use a tokenizer with a chat template or give those documents as {"text": ...} records'
            )
        # Every record once, in file order: one repeated by a weight > 1 gives views of the same tokens.
        wanted = np.unique(records)
        spill = _Spill(cfg.spill_dir)
        for ids, mask, counts in encoder.encode(mixture.read(wanted), len(wanted)):
            spill.add(ids, mask, counts, cfg)
    rows, source_of = np.searchsorted(wanted, records), mixture.source_of(records)
    documents = spill.documents(chosen, rows, source_of, cfg, stats, mixture.sources)
    if not documents:
        raise DflashError(
            f"no document of {_names(cfg.path)} holds a token to train on ({stats.dropped_no_loss} dropped without one, "
            "e.g. empty completions); give the responses some content"
        )
    stats.documents = len(documents)
    stats.tokens = sum(counts.tokens for counts in mixture.sources)
    stats.loss_tokens = sum(counts.loss_tokens for counts in mixture.sources)
    stats.records_read = sum(counts.records for counts in mixture.sources)
    stats.deduplicated = sum(counts.deduplicated for counts in mixture.sources)
    stats.sources = [asdict(counts) for counts in mixture.sources]
    _log(cfg, stats)
    return documents, stats


class _Spill:
    """Every record's token ids and loss mask, cut to max_length, appended to two unlinked temporary files and
    mapped back at the end: the documents are views of those maps, so the data's tokens sit in the page cache, not
    the Python heap. The files have no name from the start: the disk space returns when the last document is
    dropped. A record is added once, in file order; `documents` puts its pieces in the mixture's order."""

    # per record: tokens before the cut, pieces before dropping, first kept piece, kept, tokens, loss, TURN_COUNTS
    FACTS = 6 + len(TURN_COUNTS)

    def __init__(self, folder: str | Path | None):
        self.files = [tempfile.TemporaryFile(prefix="dflash-tokens-", dir=folder) for _ in range(2)]
        self.pieces = array.array("q")  # per kept piece: piece number, offset, length
        self.facts = array.array("q")  # per record: FACTS numbers
        self.size = 0

    def add(self, ids: np.ndarray, mask: np.ndarray, counts: tuple[int, ...], cfg: DataConfig) -> None:
        """Cut one record by cfg.overflow (truncate: its first piece only) and keep the pieces with a loss token."""
        limit, first = cfg.max_length, len(self.pieces) // 3
        starts = range(0, len(ids), limit) if cfg.overflow == "split" else range(1)
        tokens = loss = 0
        for piece, start in enumerate(starts):
            piece_mask = mask[start : start + limit]
            if not piece_mask.any():
                continue
            self.files[0].write(ids[start : start + limit].tobytes())
            self.files[1].write(piece_mask.tobytes())
            self.pieces.extend((piece, self.size, len(piece_mask)))
            self.size += len(piece_mask)
            tokens += len(piece_mask)
            loss += int(piece_mask.sum())
        self.facts.extend((len(ids), len(starts), first, len(self.pieces) // 3 - first, tokens, loss, *counts))

    def documents(self, chosen, rows, source_of, cfg: DataConfig, stats: DataStats, counts) -> list[Document]:
        """The documents of the mixture entries `chosen` (their records' rows here, and their sources), counted
        into `stats` and the sources' `counts`."""
        facts = np.frombuffer(self.facts, np.int64).reshape(-1, self.FACTS)[rows]
        _count_cuts(chosen, facts[:, 0], facts[:, 1], facts[:, 3], cfg, stats)
        for column, name in enumerate(TURN_COUNTS, start=6):
            setattr(stats, name, int(facts[:, column].sum()))
        for column, name in zip((3, 4, 5), ("documents", "tokens", "loss_tokens")):
            for source, total in zip(counts, np.bincount(source_of, facts[:, column], len(counts)).tolist()):
                setattr(source, name, int(total))
        if not self.size:
            return []
        # Copy-on-write maps: writable views (torch.from_numpy takes them), and nothing written goes to the files.
        ids, masks = (
            np.memmap(file, dtype, "c", shape=(self.size,)) for file, dtype in zip(self.files, (np.int32, np.uint8))
        )
        for file in self.files:
            file.close()  # the maps keep the data
        pieces = np.frombuffer(self.pieces, np.int64).reshape(-1, 3).tolist()
        return [
            Document(index, piece, ids[o : o + n], masks[o : o + n], source)
            for index, first, kept, source in zip(
                chosen.tolist(), facts[:, 2].tolist(), facts[:, 3].tolist(), source_of.tolist()
            )
            for piece, o, n in pieces[first : first + kept]
        ]


def _count_cuts(chosen, lengths, pieces, kept, cfg: DataConfig, stats: DataStats) -> None:
    """What cfg.overflow did to the documents of the mixture (a record repeated counts each time)."""
    over = lengths > cfg.max_length
    stats.dropped_no_loss = int((pieces - kept).sum())
    if cfg.overflow == "split":
        stats.split, stats.split_pieces = int(over.sum()), int(pieces[over].sum())
        return
    cuts, dropped = (lengths - cfg.max_length)[over], kept[over] == 0
    stats.truncated, stats.truncated_tokens = len(cuts), int(cuts.sum())
    stats.truncated_dropped = int(dropped.sum())
    stats.truncated_most = int((cuts > TRUNCATION_WARNING * lengths[over]).sum())
    if len(cuts):
        stats.largest_cut, stats.largest_cut_line = int(cuts.max()), int(chosen[over][cuts.argmax()])
        stats.largest_cut_dropped = bool(dropped[cuts.argmax()])


def _names(path) -> str:
    return ", ".join(map(str, [path] if isinstance(path, (str, Path)) else path))


def _log(cfg: DataConfig, stats: DataStats) -> None:
    if stats.context_turns:
        logger.info(
            "%d assistant turns of conversations the target answered were written by the data, not the target: "
            "context, with no loss (dflash regenerate --turns all has the target write them)",
            stats.context_turns,
        )
    if stats.unfinished:
        logger.info(
            "%d target answers were cut at regenerate's --max-new-tokens: their end-of-turn token is kept out of the "
            "loss (regenerate them with a larger --max-new-tokens to train the drafter to stop there)",
            stats.unfinished,
        )
    for counts in stats.sources:
        logger.info(
            "source %s: %d records read, %d duplicates dropped, %d used, %d documents, %d tokens (%d with loss)",
            *(
                counts[key]
                for key in ("source", "records", "deduplicated", "used", "documents", "tokens", "loss_tokens")
            ),
        )
    if stats.truncated_most:
        # The kept part of a long chat may be all prompt: then the document is dropped too, and the log says so.
        kept = "then dropped: the rest held no token to train on" if stats.largest_cut_dropped else "keeping %d"
        logger.warning(
            "WARNING: --overflow truncate cut %d document(s) of %s to less than %d%% of their length, dropping %d "
            f"tokens in all (document %d alone lost %d of its tokens, {kept}); those tokens are never trained on. "
            "Pass --overflow split to keep them as standalone pieces, or raise --max-length",
            stats.truncated_most,
            _names(cfg.path),
            round(100 * (1 - TRUNCATION_WARNING)),
            stats.truncated_tokens,
            stats.largest_cut_line,
            stats.largest_cut,
            *(() if stats.largest_cut_dropped else (cfg.max_length,)),
        )
    if stats.truncated_dropped:
        logger.warning(
            "WARNING: %d truncated document(s) of %s were then dropped whole: their first %d tokens (the prompt) "
            "hold no token to train on. Pass --overflow split or raise --max-length to keep their answers",
            stats.truncated_dropped,
            _names(cfg.path),
            cfg.max_length,
        )


def load_tokenizer(tokenizer_path: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except (OSError, ValueError) as exc:
        raise DflashError(f"cannot load a tokenizer from {tokenizer_path}: {exc}; pass the model folder") from exc
    if not tokenizer.is_fast:
        raise DflashError(
            f"the tokenizer at {tokenizer_path} is a slow (Python) tokenizer; dflash needs a fast one "
            "(a tokenizer.json in the folder) to map assistant turns to tokens"
        )
    return tokenizer


# ---- reading and validation -------------------------------------------------------------------------------


def _check_config(cfg: DataConfig) -> None:
    if not isinstance(cfg.max_length, int) or cfg.max_length < 1:
        raise DflashError(f"max length must be a positive integer, got {cfg.max_length!r}")
    if cfg.overflow not in OVERFLOW_MODES:
        raise DflashError(f"overflow must be one of {', '.join(OVERFLOW_MODES)}, got {cfg.overflow!r}")
    if not isinstance(cfg.workers, int) or cfg.workers < 1:
        raise DflashError(f"workers must be a positive integer, got {cfg.workers!r}")


def jsonl_lines(raw: bytes) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line) for every non-blank line of a JSONL file's bytes.

    Splits bytes, not str: str.splitlines would also break at U+2028, U+2029 and U+0085, which
    json.dumps(ensure_ascii=False) writes raw inside strings.
    """
    for number, line in enumerate(raw.splitlines(), start=1):
        if line.strip():
            yield number, line


def _parse_document(record, where: str) -> tuple[str, object]:
    """check_record, plus what training needs: a conversation with an assistant turn to learn from."""
    kind, payload = check_record(record, where)
    if kind == "chat" and not any(message["role"] == "assistant" for message in payload):
        raise DflashError(
            f"{where}: the conversation has no assistant turn, so nothing to train on; add one or remove the line"
        )
    if kind == "completion" and payload[1] is None:
        raise DflashError(
            f'{where}: the prompt has no "completion", so nothing to train on; add one or remove the line'
        )
    return kind, payload


def parse_line(line: bytes, where: str) -> tuple[str, object]:
    """One JSONL line as ("chat", messages), ("text", text) or ("completion", (prompt, completion)), checked for
    shape; errors name `where`."""
    return check_record(sources.decode_json_line(line, where), where)


# ---- tokenisation -------------------------------------------------------------------------------------------

CHUNK = 128  # records per task: one batched call into the tokenizer, and few, large messages to and from a worker

_worker_tokenizer = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool's processes are the parallelism
    _worker_tokenizer = load_tokenizer(tokenizer_path)


def _encode_in_worker(chunk: list) -> list[tuple[np.ndarray, np.ndarray]]:
    return _encode_chunk(_worker_tokenizer, chunk)


class _Encoder:
    """Encodes (where, kind, payload) records in order, in this process (the tokenizer's Rust side may still spread
    a chunk over the cores) or in a pool of `workers` processes started at once, so that their startup (each
    imports transformers and loads the tokenizer) overlaps the reading."""

    def __init__(self, tokenizer_path: str, workers: int):
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.workers = workers
        # spawn, not fork: the caller may hold CUDA or writer threads that a forked child must not inherit.
        context = multiprocessing.get_context("spawn")
        self.pool = context.Pool(workers, _init_worker, (tokenizer_path,)) if workers > 1 else None

    def __enter__(self):
        return self

    def __exit__(self, *error):
        if self.pool is not None:
            self.pool.terminate()

    def encode(self, records: Iterator, count: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The first bad record (in record order) raises its DflashError."""
        chunks = _chunks(records, max(1, min(CHUNK, count // (4 * self.workers))))
        if self.pool is None:
            encoded = (_encode_chunk(self.tokenizer, chunk) for chunk in chunks)
        else:
            encoded = self.pool.imap(_encode_in_worker, chunks)
        for chunk in encoded:
            yield from chunk


def _chunks(items: Iterator, size: int) -> Iterator[list]:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encode_chunk(tokenizer, records: list) -> list[tuple[np.ndarray, np.ndarray, tuple[int, ...]]]:
    """Render every record, tokenise them in one batched call per kind of special-token handling, and mask them.

    A record that cannot be rendered raises after the records before it are checked, so that the first bad record
    is the one reported."""
    prepared, error = [], None
    for where, kind, payload in records:
        try:
            prepared.append((where, kind, *_prepare(tokenizer, where, kind, payload)))
        except DflashError as exc:
            error = exc
            break
    tokens = [None] * len(prepared)
    for special in (True, False):  # chat renderings hold their special tokens; text gets the tokenizer's default
        batch = [i for i, (_, kind, *_) in enumerate(prepared) if (kind != "chat") == special]
        if batch:
            texts = [prepared[i][2] for i in batch]
            encoding = tokenizer(texts, add_special_tokens=special, return_offsets_mapping=True, verbose=False)
            for i, ids, offsets in zip(batch, encoding["input_ids"], encoding["offset_mapping"]):
                tokens[i] = ids, offsets
    encoded = [
        (*_masked(where, kind, spans, *token), counts)
        for (where, kind, _, spans, counts), token in zip(prepared, tokens)
    ]
    if error is not None:
        raise error
    return encoded


def _prepare(tokenizer, where: str, kind: str, payload) -> tuple[str, list[tuple[float, float]] | None, tuple]:
    """The text to tokenise, the character spans on the loss (None: every token) and the record's TURN_COUNTS."""
    if kind == "text":
        return payload, None, (0, 0)
    if kind == "completion":
        prompt, completion, unfinished = payload
        # A token holding completion characters ends after the prompt; added special tokens span (0, 0).
        return prompt + completion, [(len(prompt), math.inf)], (0, int(unfinished))
    return chat.rendered_with_spans(tokenizer, payload, where)


def _masked(where: str, kind: str, spans, ids: list[int], offsets) -> tuple[np.ndarray, np.ndarray]:
    if len(ids) == 0:
        raise DflashError(f"{where}: empty document (the tokenizer produced no tokens); remove the line")
    if spans is None:
        mask = np.ones(len(ids), bool)
    else:
        offsets = np.fromiter(itertools.chain.from_iterable(offsets), np.int64, 2 * len(ids)).reshape(-1, 2)
        mask = np.zeros(len(offsets), bool)
        for start, end in spans:
            mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)  # every token overlapping the span
    if kind == "chat" and not mask.any():
        raise DflashError(f"{where}: no assistant tokens after tokenisation; give the assistant turns some content")
    return np.asarray(ids, np.int32), mask.astype(np.uint8)
