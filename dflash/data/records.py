"""The record kinds of dflash's data, checked for shape before anything is tokenised (docs/data.md).

`check_record` turns one decoded record (ShareGPT already normalised to messages by dflash.data.sources) into
("chat", messages), ("text", text) or ("completion", (prompt, completion, unfinished)), raising a DflashError that
names `where` (the file and line) and the fix. OpenAI list content becomes its text parts joined; an assistant
turn of tool calls only (`"content": null`) gets content "". The marks `dflash regenerate` writes (`"target"`,
`"unfinished"`) are checked here and read by dflash/data/__init__.py's loss masks.
"""

from dflash.data.sources import LINE_EXAMPLE, normalise
from dflash.errors import DflashError

KINDS = {"messages": "chat", "text": "text", "prompt": "completion"}  # the key that names a line's kind
TARGET = "target"  # an assistant message's mark that the target wrote it (dflash regenerate)
UNFINISHED = "unfinished"  # a target answer's mark that it was cut at --max-new-tokens (dflash regenerate)


def check_record(record, where: str) -> tuple[str, object]:
    """data.parse_line for a record already decoded (a prompt given in memory, say); ShareGPT records are accepted."""
    record = normalise(record, where)
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


def _check_completion(record: dict, where: str) -> tuple[str, str | None, bool]:
    """(prompt, completion, unfinished); the completion may be absent (a prompt to answer), but not of another
    type."""
    prompt, completion = record["prompt"], record.get("completion")
    if record.get(UNFINISHED, True) is not True or (UNFINISHED in record and completion is None):
        raise DflashError(
            f'{where}: "{UNFINISHED}": {record[UNFINISHED]!r}; only a completion cut at --max-new-tokens is marked, '
            f'"{UNFINISHED}": true (dflash regenerate writes it): remove the key or fix it'
        )
    if not isinstance(prompt, str):
        raise DflashError(f'{where}: "prompt" must be a string, got {type(prompt).__name__}')
    if completion is not None and not isinstance(completion, str):
        raise DflashError(f'{where}: "completion" must be a string, got {type(completion).__name__}')
    if not (prompt + (completion or "")).strip():
        raise DflashError(f"{where}: empty document (no characters besides whitespace); remove the line")
    return prompt, completion, UNFINISHED in record


def _check_messages(messages, where: str) -> list[dict]:
    """The messages, checked; an assistant turn of tool calls only (OpenAI's `"content": null`) gets content "", and
    OpenAI list content (`[{"type": "text", "text": ...}, ...]`) its text parts joined by line breaks (as vLLM
    joins them for a text-only model)."""
    if not isinstance(messages, list) or not messages:
        raise DflashError(f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": ...}} objects')
    messages = list(messages)
    for index, message in enumerate(messages):
        number = index + 1  # named from 1, as the lines and rows around it are
        if not isinstance(message, dict):
            raise DflashError(
                f'{where}: message {number} must be an object with "role" and "content", got {type(message).__name__}'
            )
        if "tool_calls" in message:
            _check_tool_calls(message, number, where)
            if message.get("content") is None:
                messages[index] = message = {**message, "content": ""}
        if isinstance(message.get("content"), list):
            messages[index] = message = {**message, "content": _joined_text(message["content"], number, where)}
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise DflashError(f'{where}: message {number} needs a string "{key}", got {message.get(key)!r:.60}')
        if TARGET in message and (message[TARGET] is not True or message["role"] != "assistant"):
            raise DflashError(
                f'{where}: message {number} has "{TARGET}": {message[TARGET]!r}; only an assistant turn the target '
                f'wrote is marked, "{TARGET}": true (dflash regenerate writes it): remove the key or fix it'
            )
        if UNFINISHED in message and (message[UNFINISHED] is not True or message.get(TARGET) is not True):
            raise DflashError(
                f'{where}: message {number} has "{UNFINISHED}": {message[UNFINISHED]!r}; only a target turn cut at '
                f'--max-new-tokens is marked, "{UNFINISHED}": true beside "{TARGET}": true: remove the key or fix it'
            )
    return messages


def _joined_text(parts: list, number: int, where: str) -> str:
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise DflashError(
                f"{where}: message {number} has a content part of type {kind!r}; dflash trains on text only: give "
                'the content as a string or as text parts, [{"type": "text", "text": ...}], and leave the others out'
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _check_tool_calls(message: dict, number: int, where: str) -> None:
    """`tool_calls` of an assistant turn: a list of OpenAI calls, `{"function": {"name": ..., "arguments": ...}}`."""
    calls = message["tool_calls"]
    shape = 'a list of {"type": "function", "function": {"name": ..., "arguments": ...}} objects'
    if message.get("role") != "assistant":
        raise DflashError(
            f'{where}: message {number} (role {message.get("role")!r}) has "tool_calls"; only an '
            "assistant turn makes tool calls: move them to the assistant turn or remove them"
        )
    if not isinstance(calls, list) or not all(
        isinstance(call, dict)
        and isinstance(call.get("function"), dict)
        and isinstance(call["function"].get("name"), str)
        for call in calls
    ):
        raise DflashError(f'{where}: message {number}: "tool_calls" must be {shape}, got {calls!r:.80}')
