"""The files of `dflash regenerate`, whichever way the answers are made (dflash.regenerate with the target loaded
here, dflash.remote through a serving engine): the prompt records read from the data, the response records
appended to the output, its resume check and the settings recorded beside it.

Resuming: the output is only ever appended whole batches at a time (one write, flushed and fsynced), a
trailing partial line left by a killed run is cut off, and a rerun starts after the lines already there, once
they are checked to answer the same prompts and the settings recorded beside the output (model, length,
sampling, seed: `OUT.settings.json`) are checked to be this run's.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

from dflash import sources
from dflash.config import RegenerateConfig
from dflash.data import check_record
from dflash.errors import DflashError, describe_differences

# ---------------------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------------------


def load_prompts(path: str | Path) -> list[dict]:
    """Read prompt records from a data source of any kind harvest reads (a JSONL, .gz, .zst or Parquet file, or a
    folder of them: docs/data.md), each normalised to `{"messages": [...]}` (ending with a user turn) or
    `{"prompt": ...}`."""
    records = [_prompt_record(*check_record(record, where), where) for where, record in sources.iter_records(path)]
    if not records:
        raise DflashError(
            f"{path} holds no prompts; expected records with 'messages', 'conversations', 'text' or 'prompt'"
        )
    return records


def prompt_records(records: list[dict]) -> list[dict]:
    """In-memory prompt records (any form a prompt file may hold), checked and normalised as load_prompts does."""
    normalised = []
    for number, record in enumerate(records, start=1):
        where = f"prompt {number}"
        normalised.append(_prompt_record(*check_record(record, where), where))
    return normalised


def _prompt_record(kind: str, payload, where: str) -> dict:
    if kind == "text":
        return {"prompt": payload}
    if kind == "completion":
        return {"prompt": payload[0]}
    # The target writes the answer itself: an answer already there is dropped.
    messages = payload[:-1] if payload[-1]["role"] == "assistant" else payload
    if not messages or messages[-1]["role"] != "user":
        raise DflashError(
            f"{where}: the conversation must end with a user turn for the target to answer (a final assistant turn "
            "is dropped first); end it with the user turn to answer or remove the line"
        )
    return {"messages": messages}


def response_record(record: dict, response: str) -> dict:
    if "prompt" in record:
        return {"prompt": record["prompt"], "completion": response}
    return {"messages": [*record["messages"], {"role": "assistant", "content": response}]}


def _answers(line: bytes, record: dict) -> bool:
    """Whether an output line is the response record of prompt `record`."""
    done = json.loads(line.decode("utf-8"))
    if "prompt" in record:
        return done.get("prompt") == record["prompt"] and isinstance(done.get("completion"), str)
    return done.get("messages", [])[:-1] == record["messages"]


# ---------------------------------------------------------------------------------------------------------------
# Resumable output
# ---------------------------------------------------------------------------------------------------------------


def completed_count(out: Path, records: list[dict]) -> int:
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
            same = _answers(line, record)
        except (ValueError, AttributeError):  # not UTF-8, not JSON, not an object
            same = False
        if not same:
            # Earlier versions wrote {"text": prompt + response} for text prompts: say so rather than blame the prompts.
            source = "by an older dflash" if b'"text"' in line and "prompt" in record else "from other prompts"
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
    if isinstance(recorded, dict) and has_answers:
        details = describe_differences(recorded, settings, "the output has", "this run")
        if details:
            raise DflashError(
                f"{out} was written with other generation settings ({details}); rerun with the output's settings to "
                "resume it, or write to a new --out"
            )
        return
    if has_answers and recorded is None:
        import logging

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
        raise DflashError(f"cannot write {path} ({exc.strerror}); choose a writable --out and rerun") from None


def append_lines(out: Path, records: list[dict]) -> None:
    """Append whole lines in one write, then flush to disk, so a kill leaves at most a partial last line."""
    payload = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    with open(out, "a", encoding="utf-8") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())


@dataclass
class RegenerateStats:
    prompts: int
    already_done: int
    written: int


def output_path(cfg: RegenerateConfig) -> Path:
    out = Path(cfg.out)
    if out.is_dir():
        raise DflashError(f"--out {out} is a folder; give the path of a JSONL file to write the responses to")
    return out
