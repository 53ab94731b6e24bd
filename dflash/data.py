"""Documents -> token ids and loss masks, validated in full before anything is written.

dflash/sources.py reads the records (JSONL, compressed JSONL, Parquet, folders, weighted mixtures) and turns
ShareGPT `conversations` into `messages`; each record is one document:
- `{"messages": [{"role": ..., "content": ...}, ...]}` is rendered with the tokenizer's chat template; the loss
  mask is on for the tokens of each assistant turn as the model generates it: from the first character after
  the generation prompt (`<|im_start|>assistant\\n`) to the end of the turn, including its end-of-turn token
  (`<|im_end|>`) so that the drafter learns to stop, excluding the whitespace a template writes after that token
  (the model never generates it). Everything else (system, user, tool turns, role headers) is off. A tool turn
  (sources.TOOL_ROLES) the chat template does not render is refused, never dropped silently.
- `{"text": "..."}` is tokenised as the tokenizer does by default (its BOS if it defines one; no EOS added) and
  the loss mask is on for every token.
- `{"prompt": "...", "completion": "..."}` (what `dflash regenerate` writes for text prompts) is tokenised as the
  text prompt + completion; the loss mask is on for the tokens holding completion characters only, since the
  drafter drafts what the target writes, not the prompt it was given. A completion that ends up without a loss
  token (an empty response) is dropped and counted, like a split-off prompt.

Blank lines are skipped; `doc_id` is the 0-based index of the record in the mixture (the file's order for one
source), error messages name the file and its 1-based line (or Parquet row). Documents longer than `max_length`
are truncated or split into standalone pieces; pieces left with no loss token (for example a split-off prompt) are
dropped, since they could hold no training block, and counted. The documents' tokens are spilled to a temporary
file and mapped back (`_Spill`), so that they do not sit in the Python heap.
"""

import logging
import multiprocessing
import re
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from dflash import sources
from dflash.errors import DflashError
from dflash.sources import LINE_EXAMPLE

logger = logging.getLogger("dflash")

OVERFLOW_MODES = ("truncate", "split")
TRUNCATION_WARNING = 0.5  # a truncation dropping more than this share of a document's tokens is warned about
KINDS = {"messages": "chat", "text": "text", "prompt": "completion"}  # the key that names a line's kind


@dataclass
class Document:
    doc_id: int  # index of the source line (0-based); split pieces share it
    piece: int  # 0 unless a long document was split
    input_ids: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # uint8 [n]: 1 on assistant tokens (chat), completion tokens or every token (text)


@dataclass
class DataConfig:
    path: str | Path | list  # one source or several: PATH or PATH:WEIGHT, each a file or a folder (dflash/sources.py)
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
    split: int = 0  # documents split ...
    split_pieces: int = 0  # ... into this many pieces
    dropped_no_loss: int = 0  # pieces (or truncated documents) left without a loss token
    documents: int = 0  # documents returned, pieces counted one by one
    tokens: int = 0
    loss_tokens: int = 0
    truncated_most: int = 0  # truncated documents that lost more than TRUNCATION_WARNING of their tokens ...
    largest_cut: int = 0  # ... the most tokens one truncation dropped ...
    largest_cut_line: int = -1  # ... and that document's index (0-based; -1: none)
    sources: list[dict] = field(default_factory=list)  # per source: sources.SourceStats

    def summary(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name)}" for f in fields(self) if f.name != "sources")


def load_documents(cfg: DataConfig, tokenizer_path: str) -> tuple[list[Document], DataStats]:
    """Read, validate, mix and tokenise the records of `cfg.path`; raise DflashError on the first bad record."""
    _check_config(cfg)
    mixture = sources.mix(cfg.path, _parse_document, cfg.seed, cfg.dedup, cfg.limit)
    items = mixture.items
    chosen = range(len(items))
    if cfg.sample is not None and cfg.sample < len(items):
        chosen = np.sort(np.random.default_rng(0).choice(len(items), cfg.sample, replace=False)).tolist()
    tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer.chat_template is None and any(items[i].kind == "chat" for i in chosen):
        raise DflashError(
            f"the tokenizer at {tokenizer_path} has no chat template, but {_names(cfg.path)} holds chat records; "
            'use a tokenizer with a chat template or give those documents as {"text": ...} records'
        )
    encoded = _encode_all(
        [(items[i].where, items[i].kind, items[i].payload) for i in chosen], tokenizer, tokenizer_path, cfg.workers
    )
    stats = DataStats(
        len(items), len(chosen), **{kind: sum(items[i].kind == kind for i in chosen) for kind in KINDS.values()}
    )
    spill = _Spill(cfg.spill_dir)
    for index, (ids, mask) in zip(chosen, encoded):
        counts = mixture.sources[items[index].source]
        for document in _fit(index, ids, mask, cfg, stats):
            spill.add(document)
            counts.documents += 1
            counts.tokens += len(document.input_ids)
            counts.loss_tokens += int(document.loss_mask.sum())
    if not spill.spans:
        raise DflashError(
            f"no document of {_names(cfg.path)} holds a token to train on ({stats.dropped_no_loss} dropped without one, "
            "e.g. empty completions); give the responses some content"
        )
    documents = spill.documents()
    stats.documents = len(documents)
    stats.tokens = sum(counts.tokens for counts in mixture.sources)
    stats.loss_tokens = sum(counts.loss_tokens for counts in mixture.sources)
    stats.records_read = sum(counts.records for counts in mixture.sources)
    stats.deduplicated = sum(counts.deduplicated for counts in mixture.sources)
    stats.sources = [asdict(counts) for counts in mixture.sources]
    _log(cfg, stats)
    return documents, stats


class _Spill:
    """Every document's token ids and loss mask appended to two unlinked temporary files, mapped back at the end:
    the documents are views of those maps, so the data's tokens sit in the page cache, not the Python heap. The
    files have no name from the start: the disk space returns when the last document is dropped."""

    def __init__(self, folder: str | Path | None):
        self.files = [tempfile.TemporaryFile(prefix="dflash-tokens-", dir=folder) for _ in range(2)]
        self.spans: list[tuple[int, int, int, int]] = []  # doc_id, piece, offset, length
        self.size = 0

    def add(self, document: Document) -> None:
        self.files[0].write(document.input_ids.tobytes())
        self.files[1].write(document.loss_mask.tobytes())
        self.spans.append((document.doc_id, document.piece, self.size, len(document.input_ids)))
        self.size += len(document.input_ids)

    def documents(self) -> list[Document]:
        # Copy-on-write maps: writable views (torch.from_numpy takes them), and nothing written goes to the files.
        ids, masks = (
            np.memmap(file, dtype, "c", shape=(self.size,)) for file, dtype in zip(self.files, (np.int32, np.uint8))
        )
        for file in self.files:
            file.close()  # the maps keep the data
        return [Document(d, p, ids[o : o + n], masks[o : o + n]) for d, p, o, n in self.spans]


def _names(path) -> str:
    return ", ".join(map(str, [path] if isinstance(path, (str, Path)) else path))


def _log(cfg: DataConfig, stats: DataStats) -> None:
    for counts in stats.sources:
        logger.info(
            "source %s: %d records read, %d duplicates dropped, %d used, %d documents, %d tokens (%d with loss)",
            *(
                counts[key]
                for key in ("source", "records", "deduplicated", "used", "documents", "tokens", "loss_tokens")
            ),
        )
    if stats.truncated_most:
        logger.warning(
            "WARNING: --overflow truncate cut %d document(s) of %s to less than %d%% of their length, dropping %d "
            "tokens in all (document %d alone lost %d of its tokens, keeping %d); those tokens are never trained on. "
            "Pass --overflow split to keep them as standalone pieces, or raise --max-length",
            stats.truncated_most,
            _names(cfg.path),
            round(100 * (1 - TRUNCATION_WARNING)),
            stats.truncated_tokens,
            stats.largest_cut_line,
            stats.largest_cut,
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


def check_record(record, where: str) -> tuple[str, object]:
    """parse_line for a record already decoded (a prompt given in memory, say); ShareGPT records are accepted."""
    record = sources.normalise(record, where)
    if not isinstance(record, dict):
        raise DflashError(f"{where}: expected a JSON object, got {type(record).__name__}; write {LINE_EXAMPLE}")
    keys = [key for key in KINDS if key in record]
    if len(keys) != 1:
        problem = (
            f"has the keys {', '.join(keys)}"
            if keys
            else 'has none of the keys "messages", "text", "prompt" (nor ShareGPT "conversations")'
        )
        raise DflashError(f"{where}: the object {problem}; give exactly one kind of document, {LINE_EXAMPLE}")
    kind = KINDS[keys[0]]
    if kind == "text":
        return kind, _check_text(record["text"], where)
    if kind == "completion":
        return kind, _check_completion(record, where)
    return kind, _check_messages(record["messages"], where)


def _check_text(text, where: str) -> str:
    if not isinstance(text, str):
        raise DflashError(f'{where}: "text" must be a string, got {type(text).__name__}')
    if not text.strip():
        raise DflashError(f'{where}: empty document ("text" holds no characters besides whitespace); remove the line')
    return text


def _check_completion(record: dict, where: str) -> tuple[str, str | None]:
    """(prompt, completion); the completion may be absent (a prompt to answer), but not of another type."""
    prompt, completion = record["prompt"], record.get("completion")
    if not isinstance(prompt, str):
        raise DflashError(f'{where}: "prompt" must be a string, got {type(prompt).__name__}')
    if completion is not None and not isinstance(completion, str):
        raise DflashError(f'{where}: "completion" must be a string, got {type(completion).__name__}')
    if not (prompt + (completion or "")).strip():
        raise DflashError(f"{where}: empty document (no characters besides whitespace); remove the line")
    return prompt, completion


def _check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DflashError(f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": ...}} objects')
    for number, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DflashError(
                f'{where}: message {number} must be an object with "role" and "content", got {type(message).__name__}'
            )
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise DflashError(f'{where}: message {number} needs a string "{key}", got {message.get(key)!r:.60}')
    return messages


# ---- tokenisation -------------------------------------------------------------------------------------------

_worker_tokenizer = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(tokenizer_path)


def _encode_in_worker(item):
    return _encode(_worker_tokenizer, *item)


def _encode_all(items, tokenizer, tokenizer_path: str, workers: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encode every item, in order, as a stream; the first bad item (in record order) raises its DflashError."""
    if workers == 1:
        yield from (_encode(tokenizer, *item) for item in items)
        return
    # spawn, not fork: the caller may hold CUDA or writer threads that a forked child must not inherit.
    context = multiprocessing.get_context("spawn")
    chunksize = max(1, min(256, len(items) // (8 * workers)))
    with context.Pool(workers, initializer=_init_worker, initargs=(tokenizer_path,)) as pool:
        yield from pool.imap(_encode_in_worker, items, chunksize=chunksize)


def _encode(tokenizer, where: str, kind: str, payload) -> tuple[np.ndarray, np.ndarray]:
    if kind == "text":
        ids = tokenizer(payload, add_special_tokens=True, verbose=False)["input_ids"]
        mask = np.ones(len(ids), np.uint8)
    elif kind == "completion":
        ids, mask = _encode_completion(tokenizer, *payload)
    else:
        ids, mask = _encode_chat(tokenizer, payload, where)
    if len(ids) == 0:
        raise DflashError(f"{where}: empty document (the tokenizer produced no tokens); remove the line")
    if kind == "chat" and not mask.any():
        raise DflashError(f"{where}: no assistant tokens after tokenisation; give the assistant turns some content")
    return np.asarray(ids, np.int32), mask


def _encode_completion(tokenizer, prompt: str, completion: str) -> tuple[list[int], np.ndarray]:
    encoding = tokenizer(prompt + completion, add_special_tokens=True, return_offsets_mapping=True, verbose=False)
    offsets = np.asarray(encoding["offset_mapping"], np.int64).reshape(-1, 2)
    # A token holding completion characters ends after the prompt; added special tokens span (0, 0).
    return encoding["input_ids"], (offsets[:, 1] > len(prompt)).astype(np.uint8)


def _encode_chat(tokenizer, messages: list[dict], where: str) -> tuple[list[int], np.ndarray]:
    full = _render(tokenizer, messages, where)
    _check_tool_turns(messages, full, where)
    spans = _assistant_spans(tokenizer, messages, full, where)
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    offsets = np.asarray(encoding["offset_mapping"], np.int64).reshape(-1, 2)
    mask = np.zeros(len(offsets), bool)
    for start, end in spans:
        mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)  # every token overlapping the span
    return encoding["input_ids"], mask.astype(np.uint8)


def _render(tokenizer, messages: list[dict], where: str, generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # jinja raises anything, including the template's own raise_exception
        if any(message["role"] in sources.TOOL_ROLES for message in messages):
            raise DflashError(f"{where}: the chat template cannot render its tool turns ({exc}); {TOOL_FIX}") from exc
        raise DflashError(
            f"{where}: the chat template cannot render this conversation ({exc}); fix the conversation"
        ) from exc


TOOL_FIX = (
    "use a tokenizer whose chat template renders tool turns, or remove or rewrite those turns in the data "
    "(dflash never drops a turn silently)"
)


def _check_tool_turns(messages: list[dict], full: str, where: str) -> None:
    """A template may skip roles it does not know: every tool turn's content must be in the rendering."""
    for number, message in enumerate(messages):
        if message["role"] in sources.TOOL_ROLES and message["content"].strip() not in full:
            raise DflashError(
                f"{where}: the chat template does not render message {number} (role {message['role']!r}); {TOOL_FIX}"
            )


# ---- assistant spans ----------------------------------------------------------------------------------------


def _assistant_spans(tokenizer, messages: list[dict], full: str, where: str) -> list[tuple[int, int]]:
    """Character span in `full` of every assistant turn as generated: after its header, through its end token.

    First choice: diff renderings of conversation prefixes (exact when the template is prefix-consistent).
    Templates that render a turn differently once later turns follow (Qwen3 drops the think block of earlier
    turns) fail that check for those turns; they are located instead by finding every message's content in
    order in the full rendering, extended over the special token that closes the turn. A turn found by neither
    is an error: a wrong mask would train silently on the wrong tokens.
    """
    spans, content_spans = [], None
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        span = _span_by_prefix(tokenizer, messages, turn, full)
        if span is None:
            if content_spans is None:
                content_spans = _content_spans(messages, full)
                if content_spans is None:
                    raise DflashError(
                        f"{where}: cannot locate assistant message {turn} in the chat template's rendering (the "
                        "template rewrites message content), so its loss mask would be wrong; give this conversation "
                        'as a {"text": ...} line or use a tokenizer whose template renders messages verbatim'
                    )
            closers = _turn_closers(tokenizer, messages[:turn])
            span = _close_turn(full, *content_spans[turn], closers)
        spans.append(span)
    return spans


def _span_by_prefix(tokenizer, messages: list[dict], turn: int, full: str) -> tuple[int, int] | None:
    before = _try_render(tokenizer, messages[:turn], generation_prompt=True)
    through = _try_render(tokenizer, messages[: turn + 1], generation_prompt=False)
    if before is None or through is None or not (through.startswith(before) and full.startswith(through)):
        return None
    return len(before), max(len(before), len(through.rstrip()))


def _try_render(tokenizer, messages: list[dict], generation_prompt: bool) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception:  # e.g. an empty history, or a template that insists on starting with a user turn
        return None


def _content_spans(messages: list[dict], full: str) -> list[tuple[int, int]] | None:
    """Span of every message's (stripped) content, searched in message order; None if one is not there."""
    spans, cursor = [], 0
    for message in messages:
        content = message["content"].strip()
        start = full.find(content, cursor)
        if start < 0:
            return None
        cursor = start + len(content)
        spans.append((start, cursor))
    return spans


def _turn_closers(tokenizer, history: list[dict]) -> list[str]:
    """Special tokens that may close an assistant turn: those not part of the header that opens one."""
    plain = _try_render(tokenizer, history, generation_prompt=False)
    prompted = _try_render(tokenizer, history, generation_prompt=True)
    header = prompted[len(plain) :] if plain is not None and prompted is not None and prompted.startswith(plain) else ""
    return sorted((token for token in tokenizer.all_special_tokens if token not in header), key=len, reverse=True)


def _close_turn(full: str, start: int, end: int, closers: list[str]) -> tuple[int, int]:
    """Extend a content span over the closing special token that follows it after optional whitespace."""
    after = re.compile(r"\s*").match(full, end).end()
    for token in closers:
        if full.startswith(token, after):
            return start, after + len(token)
    return start, end


# ---- overflow -----------------------------------------------------------------------------------------------


def _fit(index: int, ids: np.ndarray, mask: np.ndarray, cfg: DataConfig, stats: DataStats) -> list[Document]:
    """Cut one encoded document to max_length by cfg.overflow; drop pieces without a loss token."""
    limit = cfg.max_length
    if len(ids) <= limit:
        pieces = [(ids, mask)]
    elif cfg.overflow == "truncate":
        stats.truncated += 1
        stats.truncated_tokens += len(ids) - limit
        if len(ids) - limit > TRUNCATION_WARNING * len(ids):
            stats.truncated_most += 1
        if len(ids) - limit > stats.largest_cut:
            stats.largest_cut, stats.largest_cut_line = len(ids) - limit, index
        pieces = [(ids[:limit].copy(), mask[:limit].copy())]
    else:
        pieces = [(ids[s : s + limit].copy(), mask[s : s + limit].copy()) for s in range(0, len(ids), limit)]
        stats.split += 1
        stats.split_pieces += len(pieces)
    documents = [
        Document(index, piece, piece_ids, piece_mask)
        for piece, (piece_ids, piece_mask) in enumerate(pieces)
        if piece_mask.any()
    ]
    stats.dropped_no_loss += len(pieces) - len(documents)
    return documents
