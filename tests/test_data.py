"""load_documents: loss masks checked by decoding, overflow, parallel tokenisation, and every bad input."""

import json
import os

import numpy as np
import pytest
from transformers import AutoTokenizer

from dflash.data import DataConfig, load_documents
from dflash.errors import DflashError
from dflash.tiny import CORPUS, build_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What does a hash map store?"},
    {"role": "assistant", "content": "Key and value pairs, found by hashing the key."},
    {"role": "user", "content": "And a set?"},
    {"role": "assistant", "content": "Only the keys."},
]
ASSISTANT_TURNS = ["Key and value pairs, found by hashing the key.<|im_end|>", "Only the keys.<|im_end|>"]
# Renders a think block in the last assistant turn only, as Qwen3 does: not prefix-consistent for earlier turns.
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Rewrites the content of earlier assistant turns: no mask can be trusted.
REWRITING_TEMPLATE = THINK_TEMPLATE.replace(
    "{{ m['content'] }}", "{{ m['content'] if loop.last else m['content'] | upper }}"
)


def _jsonl(tmp_path, *lines) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def _masked_runs(tokenizer_path, document) -> list[str]:
    """The decoded runs of consecutive loss-masked tokens."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], document.loss_mask, [0]])))
    return [tokenizer.decode(document.input_ids[start:end]) for start, end in zip(edges[::2], edges[1::2])]


def test_chat_mask_is_exactly_the_assistant_turns_and_their_end_token(tmp_path, tokenizer_path):
    documents, stats = load_documents(DataConfig(_jsonl(tmp_path, {"messages": CONVERSATION})), tokenizer_path)
    [document] = documents
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    rendering = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert document.input_ids.tolist() == tokenizer(rendering, add_special_tokens=False)["input_ids"]
    assert document.input_ids.dtype == np.int32 and document.loss_mask.dtype == np.uint8
    assert _masked_runs(tokenizer_path, document) == ASSISTANT_TURNS
    assert (stats.chat, stats.text, stats.documents, stats.loss_tokens) == (1, 0, 1, document.loss_mask.sum())


def test_template_not_prefix_consistent_falls_back_to_content_search(tmp_path, save_tokenizer):
    tokenizer_path = save_tokenizer(tmp_path / "think", THINK_TEMPLATE)
    documents, _ = load_documents(DataConfig(_jsonl(tmp_path, {"messages": CONVERSATION})), tokenizer_path)
    # The earlier turn is found by content; the last one, prefix-consistent, includes the think block it generates.
    assert _masked_runs(tokenizer_path, documents[0]) == [
        ASSISTANT_TURNS[0],
        "<think>\n\n</think>\n\n" + ASSISTANT_TURNS[1],
    ]


def test_template_that_rewrites_content_is_refused(tmp_path, save_tokenizer):
    tokenizer_path = save_tokenizer(tmp_path / "rewrite", REWRITING_TEMPLATE)
    path = _jsonl(tmp_path, {"text": "fine"}, {"messages": CONVERSATION})
    with pytest.raises(DflashError, match=r"line 2: cannot locate assistant message 3"):
        load_documents(DataConfig(path, workers=2), tokenizer_path)  # raised in a worker, reported here


def test_text_documents_have_every_token_on(tmp_path, tokenizer_path):
    text = "def add(a, b):\n    return a + b\n"
    documents, stats = load_documents(DataConfig(_jsonl(tmp_path, {"text": text})), tokenizer_path)
    assert documents[0].input_ids.tolist() == AutoTokenizer.from_pretrained(tokenizer_path)(text)["input_ids"]
    assert documents[0].loss_mask.all() and (stats.text, stats.chat) == (1, 0)


@pytest.mark.parametrize(
    "prompt, completion",
    [
        ("def add(a, b):\n", "    return a + b\n"),  # one token holds the prompt's newline and the indentation
        ("x = 1", "0 + y"),
        ("", "only a completion"),
    ],
)
def test_completion_mask_is_exactly_the_completion_tokens(tmp_path, tokenizer_path, prompt, completion):
    path = _jsonl(tmp_path, {"prompt": prompt, "completion": completion})
    documents, stats = load_documents(DataConfig(path), tokenizer_path)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    ids = documents[0].input_ids.tolist()
    assert ids == tokenizer(prompt + completion)["input_ids"] and stats.completion == 1
    # Reference: where each token ends in the text, by decoding ever longer prefixes of the ids.
    ends = [len(tokenizer.decode(ids[: i + 1], skip_special_tokens=True)) for i in range(len(ids))]
    assert documents[0].loss_mask.tolist() == [int(end > len(prompt)) for end in ends]
    assert _masked_runs(tokenizer_path, documents[0])[-1].endswith(completion)


def test_empty_completion_is_dropped_and_counted(tmp_path, tokenizer_path):
    path = _jsonl(
        tmp_path, {"prompt": "an answer that never came", "completion": ""}, {"prompt": "a", "completion": "b"}
    )
    documents, stats = load_documents(DataConfig(path), tokenizer_path)
    assert [d.doc_id for d in documents] == [1] and (stats.completion, stats.dropped_no_loss) == (2, 1)
    with pytest.raises(DflashError, match="no document of .* holds a token to train on \\(1 dropped"):
        load_documents(DataConfig(_jsonl(tmp_path, {"prompt": "never answered", "completion": ""})), tokenizer_path)


def test_truncate_and_split(tmp_path, tokenizer_path):
    long_text = "The quick brown fox jumps over the lazy dog. " * 20
    path = _jsonl(tmp_path, {"text": "short one"}, "", {"text": long_text})
    whole = load_documents(DataConfig(path, max_length=10_000), tokenizer_path)[0][1]
    n = len(whole.input_ids)
    assert n > 3 * 64

    truncated, stats = load_documents(DataConfig(path, max_length=64, overflow="truncate"), tokenizer_path)
    # doc_id is the record's index: the blank line is not a record.
    assert [(d.doc_id, d.piece, len(d.input_ids)) for d in truncated[1:]] == [(1, 0, 64)]
    assert truncated[1].input_ids.tolist() == whole.input_ids[:64].tolist()
    assert (stats.truncated, stats.truncated_tokens, stats.split, stats.documents) == (1, n - 64, 0, 2)

    pieces, stats = load_documents(DataConfig(path, max_length=64, overflow="split"), tokenizer_path)
    expected_pieces = -(-n // 64)
    assert [(d.doc_id, d.piece) for d in pieces[1:]] == [(1, p) for p in range(expected_pieces)]
    assert np.concatenate([d.input_ids for d in pieces[1:]]).tolist() == whole.input_ids.tolist()
    assert all(len(d.input_ids) <= 64 for d in pieces)
    assert (stats.split, stats.split_pieces, stats.truncated, stats.documents) == (
        1,
        expected_pieces,
        0,
        1 + expected_pieces,
    )
    assert stats.tokens == sum(len(d.input_ids) for d in pieces)


def test_a_truncation_dropping_most_of_a_document_is_warned_about(tmp_path, tokenizer_path, caplog):
    long_text = "The quick brown fox jumps over the lazy dog. " * 20
    path = _jsonl(tmp_path, {"text": "short one"}, {"text": long_text})
    n = len(load_documents(DataConfig(path, max_length=10_000), tokenizer_path)[0][1].input_ids)
    with caplog.at_level("WARNING", logger="dflash"):
        _, stats = load_documents(DataConfig(path, max_length=n - 10, overflow="truncate"), tokenizer_path)
    assert stats.truncated == 1 and stats.truncated_most == 0 and not caplog.records  # a small cut: the count only
    with caplog.at_level("WARNING", logger="dflash"):
        _, stats = load_documents(DataConfig(path, max_length=16, overflow="truncate"), tokenizer_path)
    assert (stats.truncated_most, stats.largest_cut, stats.largest_cut_line) == (1, n - 16, 1)
    (record,) = caplog.records
    message = record.getMessage()
    assert f"dropping {n - 16} tokens" in message and "document 1 alone lost" in message
    assert "--overflow split" in message


def test_split_drops_pieces_without_loss_tokens(tmp_path, tokenizer_path):
    messages = [{"role": "user", "content": "Please read this. " * 30}, {"role": "assistant", "content": "Done."}]
    documents, stats = load_documents(
        DataConfig(_jsonl(tmp_path, {"messages": messages}), max_length=32, overflow="split"), tokenizer_path
    )
    assert stats.dropped_no_loss == stats.split_pieces - len(documents) > 0
    assert all(d.loss_mask.any() for d in documents) and documents[0].piece > 0


def test_two_workers_equal_one(tokenizer_path):
    inline, inline_stats = load_documents(
        DataConfig(CORPUS, max_length=256, overflow="split", workers=1), tokenizer_path
    )
    parallel, parallel_stats = load_documents(
        DataConfig(CORPUS, max_length=256, overflow="split", workers=2), tokenizer_path
    )
    assert inline_stats == parallel_stats and inline_stats.chat > 0 and inline_stats.text > 0
    assert len(inline) == len(parallel)
    for a, b in zip(inline, parallel):
        assert (a.doc_id, a.piece) == (b.doc_id, b.piece)
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)


GOOD = {"text": "a good line"}
BAD_LINES = {
    "malformed JSON": ('{"text": "unterminated', "malformed JSON"),
    "not an object": ('["text"]', "expected a JSON object"),
    "no known key": ({"title": "hi"}, 'none of the keys "messages", "text", "prompt"'),
    "two kinds": ({"text": "hi", "messages": []}, "has the keys messages, text"),
    "prompt without completion": ({"prompt": "hi"}, 'has no "completion", so nothing to train on'),
    "prompt not a string": ({"prompt": None, "completion": "x"}, '"prompt" must be a string'),
    "completion not a string": ({"prompt": "hi", "completion": 3}, '"completion" must be a string'),
    "empty prompt and completion": ({"prompt": " ", "completion": "\n"}, "empty document"),
    "empty text": ({"text": "  "}, "empty document"),
    "text not a string": ({"text": 3}, '"text" must be a string'),
    "messages not a list": ({"messages": "hi"}, "non-empty list"),
    "empty messages": ({"messages": []}, "non-empty list"),
    "message not an object": ({"messages": ["hi"]}, "message 1 must be an object"),
    "content not a string": (
        {"messages": [{"role": "assistant", "content": None}]},
        'message 1 needs a string "content"',
    ),
    "no assistant turn": ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
}


@pytest.mark.parametrize("case", BAD_LINES)
def test_bad_line_is_reported_with_its_line_number(tmp_path, tokenizer_path, case):
    line, problem = BAD_LINES[case]
    # A blank line counts: line numbers are those an editor shows.
    path = _jsonl(tmp_path, GOOD, "", line, {"text": 7})
    with pytest.raises(DflashError) as error:
        load_documents(DataConfig(path), tokenizer_path)
    assert "line 3: " in str(error.value) and problem in str(error.value)


def test_invalid_utf8_is_reported_with_its_line_number(tmp_path, tokenizer_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DflashError, match="line 2: not valid UTF-8"):
        load_documents(DataConfig(path), tokenizer_path)


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda tmp: tmp / "missing.jsonl", "does not exist"),
        (lambda tmp: tmp, "holds no data file"),  # a folder is a source of shards
        (lambda tmp: _touch(tmp / "empty.jsonl", "\n\n"), "holds no documents"),
    ],
)
def test_missing_or_empty_file(tmp_path, tokenizer_path, make, problem):
    with pytest.raises(DflashError, match=problem):
        load_documents(DataConfig(make(tmp_path)), tokenizer_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path, tokenizer_path):
    path = _touch(tmp_path / "locked.jsonl", json.dumps(GOOD))
    path.chmod(0)
    with pytest.raises(DflashError, match="cannot read data file"):
        load_documents(DataConfig(path), tokenizer_path)


def _touch(path, text):
    path.write_text(text)
    return path


def test_bad_options_and_missing_chat_template(tmp_path, tokenizer_path):
    path = _jsonl(tmp_path, {"messages": CONVERSATION})
    with pytest.raises(DflashError, match="overflow must be one of truncate, split"):
        load_documents(DataConfig(path, overflow="wrap"), tokenizer_path)
    with pytest.raises(DflashError, match="max length"):
        load_documents(DataConfig(path, max_length=0), tokenizer_path)
    no_template = build_tokenizer()
    no_template.chat_template = None
    no_template.save_pretrained(tmp_path / "plain")
    with pytest.raises(DflashError, match="no chat template"):
        load_documents(DataConfig(path), str(tmp_path / "plain"))


# A Llama-style template that writes a default system prompt when none is given.
DEFAULT_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    + THINK_TEMPLATE.replace(" and loop.last", " and false")
)
CONVERSATIONS = [
    CONVERSATION,
    CONVERSATION[1:3],
    CONVERSATION[1:4],  # ends with a user turn
    [{"role": "assistant", "content": "I start."}, {"role": "user", "content": "Fine."}] + CONVERSATION[3:],
    [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "get_weather('Oslo')"},
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "  It rains.  "},
    ],
]


def _reference_chat_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The mask as dflash computed it before renderings were shared and batched: every prefix rendered anew."""
    from dflash.data.chat import _close_turn, _content_spans

    def render(history, prompt):
        try:
            return tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=prompt)
        except Exception:
            return None

    full = render(messages, False)
    spans, content = [], _content_spans(messages, full)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:turn], True), render(messages[: turn + 1], False)
        if before is not None and through is not None and through.startswith(before) and full.startswith(through):
            spans.append((len(before), max(len(before), len(through.rstrip()))))
            continue
        plain = render(messages[:turn], False)
        header = before[len(plain) :] if plain is not None and before is not None and before.startswith(plain) else ""
        closers = sorted((t for t in tokenizer.all_special_tokens if t not in header), key=len, reverse=True)
        spans.append(_close_turn(full, *content[turn], closers))
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    offsets = np.asarray(encoding["offset_mapping"]).reshape(-1, 2)
    mask = np.zeros(len(offsets), bool)
    for start, end in spans:
        mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return encoding["input_ids"], mask.astype(np.uint8).tolist()


@pytest.mark.parametrize("template", [None, THINK_TEMPLATE, DEFAULT_SYSTEM_TEMPLATE])
def test_batched_masks_equal_the_reference_algorithm(tmp_path, template, save_tokenizer):
    from dflash.data import _encode_chunk

    tokenizer = AutoTokenizer.from_pretrained(save_tokenizer(tmp_path / "tokenizer", template))
    records = [(f"line {i}", "chat", messages) for i, messages in enumerate(CONVERSATIONS)]
    records.insert(2, ("line t", "text", "plain text between the chats"))
    encoded = _encode_chunk(tokenizer, records)
    del encoded[2]
    for messages, (ids, mask, _) in zip(CONVERSATIONS, encoded, strict=True):
        reference_ids, reference_mask = _reference_chat_mask(tokenizer, messages)
        assert ids.tolist() == reference_ids and mask.tolist() == reference_mask and mask.any()


def test_only_the_turns_the_target_wrote_are_on_the_loss(tmp_path, tokenizer_path):
    marked = [
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "the data's answer"},
        {"role": "user", "content": "More?"},
        {"role": "assistant", "content": "the target's answer", "target": True},
    ]
    documents, stats = load_documents(DataConfig(_jsonl(tmp_path, {"messages": marked})), tokenizer_path)
    assert _masked_runs(tokenizer_path, documents[0]) == ["the target's answer<|im_end|>"]
    assert stats.context_turns == 1
    unmarked = [{k: v for k, v in m.items() if k != "target"} for m in marked]
    documents, stats = load_documents(DataConfig(_jsonl(tmp_path, {"messages": unmarked})), tokenizer_path)
    assert len(_masked_runs(tokenizer_path, documents[0])) == 2 and stats.context_turns == 0
    for bad in ({**marked[0], "target": True}, {**marked[1], "target": "yes"}):
        with pytest.raises(DflashError, match='message 1 has "target"|message 2 has "target"'):
            load_documents(DataConfig(_jsonl(tmp_path, {"messages": [bad, *marked[1:]]})), tokenizer_path)


def test_a_cut_target_answer_keeps_its_end_of_turn_token_out_of_the_loss(tmp_path, tokenizer_path):
    turns = [
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "a whole answer", "target": True},
        {"role": "user", "content": "More?"},
        {"role": "assistant", "content": "an answer cut", "target": True, "unfinished": True},
    ]
    completion = {"prompt": "def f():", "completion": " return", "unfinished": True}
    documents, stats = load_documents(DataConfig(_jsonl(tmp_path, {"messages": turns}, completion)), tokenizer_path)
    assert _masked_runs(tokenizer_path, documents[0]) == ["a whole answer<|im_end|>", "an answer cut"]
    assert stats.unfinished == 2
    for bad in ({**turns[3], "unfinished": False}, {**turns[1], "target": True, "unfinished": 1}):
        with pytest.raises(DflashError, match='has "unfinished"'):
            load_documents(DataConfig(_jsonl(tmp_path, {"messages": [*turns[:3], bad]})), tokenizer_path)
    unmarked = {k: v for k, v in turns[3].items() if k != "target"}
    with pytest.raises(DflashError, match="only a target turn cut at --max-new-tokens is marked"):
        load_documents(DataConfig(_jsonl(tmp_path, {"messages": [*turns[:3], unmarked]})), tokenizer_path)
    with pytest.raises(DflashError, match='"unfinished": False'):
        load_documents(DataConfig(_jsonl(tmp_path, {**completion, "unfinished": False})), tokenizer_path)


# The tiny template, rendering an assistant turn's tool calls after its content.
TOOL_CALL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for call in m.get('tool_calls') or [] %}<tool_call>{{ call['function']['name'] }}"
    "({{ call['function']['arguments'] }})</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
TOOL_CALLS = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "rain, 4 degrees"},
    {"role": "assistant", "content": "It rains."},
]


def test_tool_calls_are_rendered_and_on_the_loss_or_refused_never_dropped(tmp_path, tokenizer_path, save_tokenizer):
    data = _jsonl(tmp_path, {"messages": TOOL_CALLS})
    documents, _ = load_documents(DataConfig(data), save_tokenizer(tmp_path / "tools", TOOL_CALL_TEMPLATE))
    runs = _masked_runs(str(tmp_path / "tools"), documents[0])
    assert runs == ['<tool_call>get_weather({"city": "Oslo"})</tool_call><|im_end|>', "It rains.<|im_end|>"]
    # The tiny template leaves tool calls out: refused, naming the message and the way out.
    with pytest.raises(DflashError, match="does not render the tool_calls of message 2 .*renders tool turns and tool"):
        load_documents(DataConfig(data), tokenizer_path)
    # ShareGPT turns keep their tool calls.
    sharegpt = {"conversations": [{"from": m["role"], "value": m["content"], **m} for m in TOOL_CALLS]}
    sharegpt["conversations"] = [
        {k: v for k, v in t.items() if k not in ("role", "content")} for t in sharegpt["conversations"]
    ]
    same, _ = load_documents(DataConfig(_jsonl(tmp_path, sharegpt)), str(tmp_path / "tools"))
    assert same[0].input_ids.tolist() == documents[0].input_ids.tolist()
    for bad, message in (
        ({**TOOL_CALLS[1], "tool_calls": "get_weather"}, '"tool_calls" must be a list of'),
        ({**TOOL_CALLS[0], "tool_calls": [CALL]}, "only an assistant turn makes tool calls"),
    ):
        with pytest.raises(DflashError, match=message):
            load_documents(DataConfig(_jsonl(tmp_path, {"messages": [bad, *TOOL_CALLS[1:]]})), tokenizer_path)


def test_openai_list_content_is_its_text_parts_joined_and_other_parts_are_refused(tmp_path, tokenizer_path):
    parts = [{"type": "text", "text": "What is 2 + 2?"}, {"type": "text", "text": "Say it in words."}]
    listed = [{"role": "user", "content": parts}, {"role": "assistant", "content": [{"type": "text", "text": "Four."}]}]
    plain = [
        {"role": "user", "content": "What is 2 + 2?\nSay it in words."},
        {"role": "assistant", "content": "Four."},
    ]
    documents, _ = load_documents(DataConfig(_jsonl(tmp_path, {"messages": listed})), tokenizer_path)
    expected, _ = load_documents(DataConfig(_jsonl(tmp_path, {"messages": plain})), tokenizer_path)
    assert documents[0].input_ids.tolist() == expected[0].input_ids.tolist()
    assert documents[0].loss_mask.tolist() == expected[0].loss_mask.tolist()
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    with pytest.raises(DflashError, match="line 1: message 1 has a content part of type 'image_url'; dflash trains"):
        load_documents(
            DataConfig(_jsonl(tmp_path, {"messages": [{**listed[0], "content": [image]}, listed[1]]})), tokenizer_path
        )


def test_a_truncated_chat_then_dropped_is_said_to_be_dropped(tmp_path, tokenizer_path, caplog):
    messages = [{"role": "user", "content": "Please read this. " * 30}, {"role": "assistant", "content": "Done."}]
    path = _jsonl(tmp_path, {"text": "short one"}, {"messages": messages})
    with caplog.at_level("WARNING", logger="dflash"):
        documents, stats = load_documents(DataConfig(path, max_length=32, overflow="truncate"), tokenizer_path)
    assert [d.doc_id for d in documents] == [0] and stats.truncated_dropped == 1
    log = " ".join(record.getMessage() for record in caplog.records)
    assert "keeping" not in log and "document 1 alone lost" in log and "then dropped" in log
    assert "1 truncated document(s)" in log and "were then dropped whole" in log
