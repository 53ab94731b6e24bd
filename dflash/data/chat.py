"""A chat rendered through the target's chat template, and the character spans of the assistant turns on the
loss (dflash/data/__init__.py's module docstring has the rules: from the first character after the generation prompt to the
end of the turn, its end-of-turn token included, the whitespace after it excluded)."""

import re

from dflash.data.records import TARGET, UNFINISHED
from dflash.data.sources import TOOL_ROLES
from dflash.errors import DflashError


def rendered_with_spans(tokenizer, payload: list[dict], where: str) -> tuple[str, list[tuple[int, int]], tuple]:
    """(the rendered chat, the spans on the loss, (context turns, cut turns)): the turns `dflash regenerate` marked
    as the target's, else every assistant turn; a cut turn without its end-of-turn token."""
    messages = [
        {key: value for key, value in message.items() if key not in (TARGET, UNFINISHED)} for message in payload
    ]
    full = _render(tokenizer, messages, where)
    _check_tool_turns(messages, full, where)
    _check_tool_calls_rendered(tokenizer, messages, full, where)
    assistant = [turn for turn, message in enumerate(payload) if message["role"] == "assistant"]
    marked = [turn for turn in assistant if payload[turn].get(TARGET)]
    turns = marked or assistant  # none marked: the data's own answers, every one on the loss
    spans = _assistant_spans(tokenizer, messages, full, where, turns)
    cut = [i for i, turn in enumerate(turns) if payload[turn].get(UNFINISHED)]
    for i in cut:  # the target never wrote the end-of-turn token the template closes a cut answer with
        spans[i] = _without_closer(tokenizer, full, *spans[i], messages[turns[i]]["content"])
    return full, spans, (len(assistant) - len(turns), len(cut))


def _render(tokenizer, messages: list[dict], where: str, generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # jinja raises anything, including the template's own raise_exception
        if any(message["role"] in TOOL_ROLES for message in messages):
            raise DflashError(f"{where}: the chat template cannot render its tool turns ({exc}); {TOOL_FIX}") from exc
        raise DflashError(
            f"{where}: the chat template cannot render this conversation ({exc}); fix the conversation"
        ) from exc


TOOL_FIX = (
    "use a tokenizer whose chat template renders tool turns and tool calls, or remove or rewrite those turns in the data "
    "(dflash never drops a turn silently)"
)


def _check_tool_turns(messages: list[dict], full: str, where: str) -> None:
    """A template may skip roles it does not know, or the tool calls of an assistant turn: every tool turn's
    content, and every tool call's function name, must be in the rendering."""
    for number, message in enumerate(messages):
        if message["role"] in TOOL_ROLES and message["content"].strip() not in full:
            raise DflashError(
                f"{where}: the chat template does not render message {number + 1} (role {message['role']!r}); "
                f"{TOOL_FIX}"
            )


def _check_tool_calls_rendered(tokenizer, messages: list[dict], full: str, where: str) -> None:
    """A template that ignores `tool_calls` renders the conversation without them as it does with them."""
    calls = [number for number, message in enumerate(messages) if message.get("tool_calls")]
    if not calls:
        return
    without = [{k: v for k, v in message.items() if k != "tool_calls"} for message in messages]
    if _try_render(tokenizer, without, False) == full:
        raise DflashError(
            f"{where}: the chat template does not render the tool_calls of message {calls[0] + 1} (its rendering is "
            f"the same without them); {TOOL_FIX}"
        )


# ---- assistant spans ----------------------------------------------------------------------------------------


def _assistant_spans(tokenizer, messages: list[dict], full: str, where: str, turns: list[int]) -> list[tuple[int, int]]:
    """Character span in `full` of the assistant turns `turns` as generated: after the header, through the end token.

    First choice: diff renderings of conversation prefixes (exact when the template is prefix-consistent).
    Templates that render a turn differently once later turns follow (Qwen3 drops the think block of earlier
    turns) fail that check for those turns; they are located instead by finding every message's content in
    order in the full rendering, extended over the special token that closes the turn. A turn found by neither
    is an error: a wrong mask would train silently on the wrong tokens.
    """
    render = _prefix_renderer(tokenizer, messages, full)
    spans, content_spans = [], None
    for turn in turns:
        span = _span_by_prefix(render, turn, full)
        if span is None and messages[turn].get("tool_calls"):
            raise DflashError(
                f"{where}: cannot locate assistant message {turn + 1}, which makes tool calls, in the chat template's "
                "rendering (the template renders it otherwise once later turns follow), so its loss mask would be "
                f"wrong; {TOOL_FIX}"
            )
        if span is None:
            if content_spans is None:
                content_spans = _content_spans(messages, full)
                if content_spans is None:
                    raise DflashError(
                        f"{where}: cannot locate assistant message {turn + 1} in the chat template's rendering (the "
                        "template rewrites message content), so its loss mask would be wrong; give this conversation "
                        'as a {"text": ...} line or use a tokenizer whose template renders messages verbatim'
                    )
            span = _close_turn(full, *content_spans[turn], _turn_closers(tokenizer, render, turn))
        spans.append(span)
    return spans


def _prefix_renderer(tokenizer, messages: list[dict], full: str):
    """render(k, generation_prompt): the rendering of messages[:k], None if the template refuses it.

    Rendering is a third of a conversation's cost, mostly transformers' work around the template: the prefixes the
    assistant turns need are rendered in one batched call per generation-prompt setting (each alone if the batch
    raises), the whole conversation is `full`, and none is rendered twice."""
    renderings = {(len(messages), False): full}
    turns = [turn for turn, message in enumerate(messages) if message["role"] == "assistant"]
    # The empty history (an assistant turn first) stays out: rendered alone, it raises, as it must here too.
    for prompt, ends in ((True, turns), (False, [turn + 1 for turn in turns])):
        ends = [k for k in ends if 0 < k < len(messages)]
        if ends:
            batch = _try_render(tokenizer, [messages[:k] for k in ends], prompt)
            renderings.update(zip([(k, prompt) for k in ends], batch or []))

    def render(k: int, generation_prompt: bool) -> str | None:
        if (k, generation_prompt) not in renderings:
            renderings[k, generation_prompt] = _try_render(tokenizer, messages[:k], generation_prompt)
        return renderings[k, generation_prompt]

    return render


def _span_by_prefix(render, turn: int, full: str) -> tuple[int, int] | None:
    before, through = render(turn, True), render(turn + 1, False)
    if before is None or through is None or not (through.startswith(before) and full.startswith(through)):
        return None
    return len(before), max(len(before), len(through.rstrip()))


def _try_render(tokenizer, messages: list, generation_prompt: bool):
    """The rendering of a conversation (or the list of those of a batch of them), None if the template raises."""
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


def _turn_closers(tokenizer, render, turn: int) -> list[str]:
    """Special tokens that may close an assistant turn: those not part of the header that opens one."""
    plain, prompted = render(turn, False), render(turn, True)
    header = prompted[len(plain) :] if plain is not None and prompted is not None and prompted.startswith(plain) else ""
    return sorted((token for token in tokenizer.all_special_tokens if token not in header), key=len, reverse=True)


def _without_closer(tokenizer, full: str, start: int, end: int, content: str) -> tuple[int, int]:
    """A turn's span without the special token (and the whitespace after it) that the template closed it with."""
    text = full[start:end].rstrip()
    for token in sorted(tokenizer.all_special_tokens, key=len, reverse=True):
        if text.endswith(token) and not content.rstrip().endswith(token):
            return start, start + len(text) - len(token)
    return start, start + len(text)


def _close_turn(full: str, start: int, end: int, closers: list[str]) -> tuple[int, int]:
    """Extend a content span over the closing special token that follows it after optional whitespace."""
    after = re.compile(r"\s*").match(full, end).end()
    for token in closers:
        if full.startswith(token, after):
            return start, after + len(token)
    return start, end
