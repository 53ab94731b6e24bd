"""The files of `dflash regenerate`, whichever way the answers are made (dflash.regenerate with the target loaded
here, dflash.regenerate.remote through a serving engine): the prompt records read from the data, the response records
appended to the output, its resume check and the settings recorded beside it.

Which turns the target writes (`--turns`): `last` answers the conversation's last user turn (a final assistant
turn of the data is dropped first) and keeps the earlier assistant turns as the data wrote them; `all` writes
every assistant turn in order, each answering the history the target itself wrote before it (an assistant turn
holding `tool_calls` stays the data's, since the tool results after it answer that call). Every assistant turn
the target wrote is marked `"target": true` in the output; `dflash harvest` puts the loss on the marked turns
only, so an earlier turn kept from the data is context, never training text (dflash/data/__init__.py). An answer cut at
`--max-new-tokens` before the target ended it is marked `"unfinished": true` (on its turn, or on a completion
record): harvest keeps the end-of-turn token the template closes it with out of the loss, since the target never
wrote it there.

Resuming: the output is only ever appended whole batches at a time (one write, flushed and fsynced), a
trailing partial line left by a killed run is cut off, and a rerun starts after the lines already there, once
they are checked to answer the same prompts and the settings recorded beside the output (model, length,
sampling, seed: `OUT.settings.json`) are checked to be this run's.
"""

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from dflash.config import RegenerateConfig
from dflash.data import jsonl_lines, sources
from dflash.data.records import check_record
from dflash.errors import DISK_ERRORS, DflashError, describe_differences, disk_error

TARGET = "target"  # on an assistant message: the target wrote it (dflash harvest puts the loss on those only)
UNFINISHED = "unfinished"  # on a target turn or completion: cut at --max-new-tokens, the target did not end it
MARKS = (TARGET, UNFINISHED)  # dflash's own keys on a message, never shown to a chat template or a server

# ---------------------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------------------


class Unanswerable(DflashError):
    """A conversation that does not end with a user turn for the target to answer."""


def load_prompts(path: str | Path, skipped: list[str] | None = None) -> list[dict]:
    """Read prompt records from a data source of any kind harvest reads (a JSONL, .gz, .zst or Parquet file, or a
    folder of them: docs/data.md), each normalised to `{"messages": [...]}` (ending with a user turn) or
    `{"prompt": ...}`. A conversation with no user turn to answer is refused, or left out with its place appended
    to `skipped` when that is given (eval measures the other prompts)."""
    records = _prompts(sources.iter_records(path), skipped)
    if not records:
        raise DflashError(
            f"{path} holds no prompts; expected records with 'messages', 'conversations', 'text' or 'prompt'"
            + (f" ending with a user turn ({len(skipped)} do not)" if skipped else "")
        )
    return records


def answerable_prompts(data, does: str) -> list[dict]:
    """The prompts of `data` (a path, or the records themselves), leaving out with a count the conversations that
    end with no user turn to answer (e.g. with a tool result): one such line should not stop the others, which the
    command `does` (e.g. "eval measures") something with."""
    skipped: list[str] = []
    records = load_prompts(data, skipped) if isinstance(data, (str, Path)) else prompt_records(data, skipped)
    if skipped:
        logging.getLogger("dflash").warning(
            "skipping %d prompt(s) that do not end with a user turn for the target to answer (%s%s); %s the other %d",
            len(skipped),
            ", ".join(skipped[:3]),
            ", ..." if len(skipped) > 3 else "",
            does,
            len(records),
        )
    return records


def check_positions(encoded: list, max_new_tokens: int, text_config, first: int = 0) -> None:
    """Refuse, before any decoding, prompts whose answers would run past the positions the target was made for
    (transformers would only remind, and the measurement would be of a target out of its range). `first`: the
    number the first prompt goes by (eval's report counts from 0, regenerate's messages from 1)."""
    limit = getattr(text_config, "max_position_embeddings", None)
    longest = max(range(len(encoded)), key=lambda i: encoded[i].numel(), default=None)
    if limit is None or longest is None or encoded[longest].numel() + max_new_tokens <= limit:
        return
    tokens = encoded[longest].numel()
    fix = f"pass --max-new-tokens {limit - tokens} or less" if tokens < limit else "shorten or remove that prompt"
    raise DflashError(
        f"prompt {longest + first} has {tokens} tokens: with --max-new-tokens {max_new_tokens} it reaches position "
        f"{tokens + max_new_tokens}, past the target's max_position_embeddings {limit}; {fix}"
    )


def prompt_records(records: list[dict], skipped: list[str] | None = None) -> list[dict]:
    """In-memory prompt records (any form a prompt file may hold), checked and normalised as load_prompts does."""
    return _prompts(((f"prompt {number}", record) for number, record in enumerate(records, start=1)), skipped)


def _prompts(where_records, skipped: list[str] | None) -> list[dict]:
    normalised = []
    for where, record in where_records:
        try:
            normalised.append(_prompt_record(*check_record(record, where), where))
        except Unanswerable:
            if skipped is None:
                raise
            skipped.append(where)
    return normalised


def _prompt_record(kind: str, payload, where: str) -> dict:
    if kind == "text":
        return {"prompt": payload}
    if kind == "completion":
        return {"prompt": payload[0]}
    # The target writes the answer itself: an answer already there is dropped, and a mark of an earlier run's
    # target is not this run's.
    messages = plain_messages(payload)
    messages = messages[:-1] if messages[-1]["role"] == "assistant" else messages
    if not messages or messages[-1]["role"] != "user":
        raise Unanswerable(
            f"{where}: the conversation must end with a user turn for the target to answer (a final assistant turn "
            "is dropped first); end it with the user turn to answer or remove the line"
        )
    return {"messages": messages}


def plain_messages(messages: list[dict]) -> list[dict]:
    """The messages without dflash's marks, as a chat template or a server is given them."""
    return [{key: value for key, value in message.items() if key not in MARKS} for message in messages]


def rewritten_turns(messages: list[dict], turns: str) -> list[int]:
    """The indices of a prompt's assistant turns the target writes anew under `--turns` (besides the answer to
    its last user turn)."""
    if turns == "last":
        return []
    return [i for i, message in enumerate(messages) if message["role"] == "assistant" and not message.get("tool_calls")]


class Conversation:
    """The response record of one prompt, written turn by turn: `prompt()` is what the target answers next,
    `answer(text, unfinished)` records it, until `todo` is empty."""

    def __init__(self, record: dict, turns: str):
        self.record = record
        if "prompt" in record:
            self.todo, self.messages = [None], None
        else:
            given = record["messages"]
            self.messages = [*given, {"role": "assistant", "content": ""}]
            self.todo = [*rewritten_turns(given, turns), len(given)]

    def prompt(self) -> dict:
        if self.messages is None:
            return {"prompt": self.record["prompt"]}
        return {"messages": plain_messages(self.messages[: self.todo[0]])}

    def answer(self, text: str, unfinished: bool) -> None:
        turn = self.todo.pop(0)
        cut = {UNFINISHED: True} if unfinished else {}
        if self.messages is None:
            self.completion = {"completion": text, **cut}
        else:
            self.messages[turn] = {"role": "assistant", "content": text, TARGET: True, **cut}

    def result(self) -> dict:
        if self.messages is None:
            return {"prompt": self.record["prompt"], **self.completion}
        return {"messages": self.messages}


def answer_records(records: list[dict], turns: str, generate) -> list[dict]:
    """The response records of `records`: `generate(prompt records) -> [(text, unfinished)]` is called once per
    round, each round answering the next turn of every conversation that has one left (its turns in order)."""
    conversations = [Conversation(record, turns) for record in records]
    pending = conversations
    while pending:
        for conversation, answer in zip(pending, generate([c.prompt() for c in pending]), strict=True):
            conversation.answer(*answer)
        pending = [c for c in pending if c.todo]
    return [c.result() for c in conversations]


def response_record(record: dict, response: str, unfinished: bool = False) -> dict:
    """The response record of a prompt answered by one turn (`--turns last`)."""
    [done] = answer_records([record], "last", lambda prompts: [(response, unfinished)])
    return done


def _answers(line: bytes, record: dict, turns: str) -> bool:
    """Whether an output line is the response record of prompt `record` under `turns`."""
    done = json.loads(line.decode("utf-8"))
    if "prompt" in record:
        return done.get("prompt") == record["prompt"] and isinstance(done.get("completion"), str)
    messages = done.get("messages")
    given = record["messages"]
    written = {*rewritten_turns(given, turns), len(given)}
    if not isinstance(messages, list) or len(messages) != len(given) + 1:
        return False
    for turn, message in enumerate(messages):
        if turn in written:
            if not (isinstance(message, dict) and message.get(TARGET) is True and message.get("role") == "assistant"):
                return False
        elif message != given[turn]:
            return False
    return True


def output_counts(out: Path) -> tuple[int, int, int]:
    """(assistant turns the data wrote, kept as context with no loss; conversations holding them; answers cut at
    --max-new-tokens) in `out`."""
    turns = conversations = unfinished = 0
    if out.exists():
        for _, line in jsonl_lines(out.read_bytes()):
            record = json.loads(line)
            messages = record.get("messages") or []
            kept = sum(1 for m in messages if m.get("role") == "assistant" and not m.get(TARGET))
            turns += kept
            conversations += kept > 0
            unfinished += sum(1 for m in messages if m.get(UNFINISHED)) + bool(record.get(UNFINISHED))
    return turns, conversations, unfinished


# ---------------------------------------------------------------------------------------------------------------
# Resumable output
# ---------------------------------------------------------------------------------------------------------------


def completed_count(out: Path, records: list[dict], turns: str = "last") -> int:
    """Number of prompts already answered in `out`, after cutting off a partial last line."""
    if not out.exists():
        return 0
    data = out.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) < len(data):
        with open(out, "r+b") as handle:
            handle.truncate(len(whole))
    # Split bytes, as jsonl_lines does, but keep blank lines: each output line answers one prompt.
    lines = whole.splitlines()
    if len(lines) > len(records):
        raise DflashError(f"{out} has {len(lines)} responses for {len(records)} prompts; write to a new --out")
    for number, (line, record) in enumerate(zip(lines, records), start=1):
        try:
            same = _answers(line, record, turns)
        except (ValueError, AttributeError):  # not UTF-8, not JSON, not an object
            same = False
        if not same:
            # Earlier versions wrote {"text": prompt + response} for text prompts: say so rather than blame the prompts.
            older = (b'"text"' in line and "prompt" in record) or (b'"messages"' in line and b'"target"' not in line)
            source = "by an older dflash (or with another --turns)" if older else "from other prompts or --turns"
            raise DflashError(
                f"{out} line {number} does not answer prompt {number} of the data file; it was written {source}: "
                "write to a new --out"
            )
    return len(lines)


def settings_path(out: Path) -> Path:
    """Where the generation settings of an output are recorded: beside it, `responses.jsonl.settings.json`."""
    return out.with_name(out.name + ".settings.json")


def generation_settings(cfg: RegenerateConfig, model: str | None = None) -> dict:
    """What decides the answers (beside the prompts, which are checked line by line): a resumed output must have
    been written with the same. `model` is the name a server serves the target under; by default the local one."""
    if model is None:
        model = str(Path(cfg.model).resolve()) if Path(cfg.model).exists() else str(cfg.model)
    return {
        "model": model,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "seed": cfg.seed,
        "turns": cfg.turns,
    }


def check_output(out: Path, settings: dict) -> None:
    """Before any work: `out` must be writable, and an output already holding answers must have been written with
    the same settings (refused otherwise, naming the fields); records the settings beside a new output."""
    path = settings_path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "ab"):
            pass
    except OSError as exc:
        raise DflashError(f"--out {out} cannot be written ({exc.strerror}); choose a writable path and rerun") from None
    try:
        recorded = json.loads(path.read_text()) if path.exists() else None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise DflashError(
            f"{path} is damaged ({exc}); delete it if {out} was written with this run's settings"
        ) from None
    has_answers = out.stat().st_size > 0
    if isinstance(recorded, dict) and has_answers and "turns" not in recorded:
        raise DflashError(
            f"{out} was written by an older dflash, which did not mark the turns the target wrote (harvest would put "
            "the loss on turns the data wrote); write to a new --out"
        )
    if isinstance(recorded, dict) and has_answers:
        details = describe_differences(recorded, settings, "the output has", "this run")
        if details:
            raise DflashError(
                f"{out} was written with other generation settings ({details}); rerun with the output's settings to "
                "resume it, or write to a new --out"
            )
        return
    if has_answers and recorded is None:
        logging.getLogger("dflash").warning(
            "%s has no record of the settings it was written with (an older dflash); resuming with this run's, "
            "recorded in %s",
            out,
            path,
        )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(settings, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno in DISK_ERRORS:
            raise disk_error(exc, f"writing {path} failed", path.parent, "rerun the same command") from None
        raise DflashError(f"cannot write {path} ({exc.strerror}); choose a writable --out and rerun") from None


RESUMES = "rerun the same command: it resumes after the last whole answer"


def append_lines(out: Path, records: list[dict]) -> None:
    """Append whole lines in one write, then flush to disk, so a kill leaves at most a partial last line; a failed
    write (a full disk) is cut back off, leaving the output as it was."""
    payload = memoryview("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode())
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    size = os.fstat(fd).st_size
    try:
        while payload:
            payload = payload[os.write(fd, payload) :]
        os.fsync(fd)
    except OSError as exc:
        os.ftruncate(fd, size)
        if exc.errno not in DISK_ERRORS:
            raise DflashError(f"writing {out} failed ({exc.strerror}); {RESUMES} once the cause is fixed") from None
        raise disk_error(exc, f"writing {out} failed", out.parent, RESUMES) from None
    finally:
        os.close(fd)


@dataclass
class RegenerateStats:
    prompts: int
    already_done: int
    written: int
    context_turns: int = 0  # assistant turns of the output the data wrote, kept as context (no loss) ...
    context_conversations: int = 0  # ... in this many conversations
    unfinished: int = 0  # answers of the output cut at --max-new-tokens


def output_path(cfg: RegenerateConfig) -> Path:
    out = Path(cfg.out)
    if out.is_dir():
        raise DflashError(f"--out {out} is a folder; give the path of a JSONL file to write the responses to")
    return out
