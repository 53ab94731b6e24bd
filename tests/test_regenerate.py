"""`dflash regenerate`: harvestable output, equal to transformers' generate, resumable without duplicates."""

import dataclasses
import errno
import json
import os

import pytest
import torch
from click.testing import CliRunner

from dflash.config import RegenerateConfig
from dflash.data import DataConfig, load_documents
from dflash.errors import DflashError
from dflash.regenerate import encode_prompt, eos_token_ids, regenerate
from dflash.regenerate.answers import append_lines, completed_count, load_prompts, prompt_records, response_record
from dflash.target import load_target

PROMPTS = [
    {"messages": [{"role": "user", "content": "Explain what `uuid` in the Python standard library does."}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What does io.IOBase do?"},
            {"role": "assistant", "content": "an answer written by someone else, to be dropped"},
        ]
    },
    {"text": "import os\n"},
    {"prompt": "def area(r):\n", "completion": "    an answer written by someone else, to be dropped"},
    {
        "messages": [
            {"role": "user", "content": "Tell me about the statistics.median_grouped function, in detail please."}
        ]
    },
]
MAX_NEW_TOKENS = 10
# Line breaks to str.splitlines that json.dumps(ensure_ascii=False) writes raw inside a string.
UNICODE_BREAKS = "one\u2028two\u0085three\u2029four"


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def prompts_file(tmp_path):
    return write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_greedy_regenerate_matches_generate_and_is_harvestable(tiny_target, prompts_file, tmp_path):
    target_path = tiny_target("qwen3_5")
    out = tmp_path / "responses.jsonl"
    cfg = RegenerateConfig(target_path, prompts_file, out, max_new_tokens=MAX_NEW_TOKENS, batch_size=3, device="cpu")
    stats = regenerate(cfg, progress=False)
    assert (stats.prompts, stats.already_done, stats.written) == (5, 0, 5)
    lines = read_lines(out)
    assert lines[1]["messages"][:2] == PROMPTS[1]["messages"][:2]  # the original answer was dropped
    assert lines[2]["prompt"] == "import os\n" and lines[3]["prompt"] == "def area(r):\n"
    assert "someone else" not in lines[3]["completion"]

    # Each response is what transformers' generate says for that prompt alone (no padding, no batch).
    model, tokenizer = load_target(target_path, "cpu", "float32")
    eos_ids = eos_token_ids(model, tokenizer)
    for record, line in zip(load_prompts(prompts_file), lines):
        ids = torch.tensor([encode_prompt(tokenizer, record)])
        new = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)[0, ids.shape[1] :].tolist()
        new = new[: next((i for i, t in enumerate(new) if t in eos_ids), len(new))]
        response = line["messages"][-1]["content"] if "messages" in line else line["completion"]
        assert response == tokenizer.decode(new, skip_special_tokens=False)

    documents, data_stats = load_documents(DataConfig(out), str(target_path))
    assert (data_stats.chat, data_stats.completion) == (3, 2) and len(documents) == 5
    # Text prompts: the loss is on the target's response, not on the prompt it was given.
    for document, line in zip(documents[2:4], lines[2:4]):
        on = document.loss_mask.astype(bool)
        assert line["prompt"].startswith(tokenizer.decode(document.input_ids[~on], skip_special_tokens=True))
        assert tokenizer.decode(document.input_ids[on]).endswith(line["completion"]) and on.any()


def test_resume_after_a_killed_run_adds_only_the_missing_prompts(tiny_target, prompts_file, tmp_path):
    from cli.main import main

    target_path = tiny_target("qwen3_5")
    full = tmp_path / "full.jsonl"
    cfg = RegenerateConfig(target_path, prompts_file, full, max_new_tokens=MAX_NEW_TOKENS, batch_size=2, device="cpu")
    regenerate(cfg, progress=False)
    complete = full.read_text().splitlines(keepends=True)

    partial = tmp_path / "partial.jsonl"
    partial.write_text(complete[0] + complete[1][:17])  # a run killed in the middle of writing line 2
    args = ["regenerate", "--model", str(target_path), "--data", str(prompts_file), "--out", str(partial)]
    result = CliRunner().invoke(main, args + ["--max-new-tokens", "10", "--batch-size", "2", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "4 responses written, 1 already there" in result.output
    assert partial.read_text() == full.read_text()

    again = CliRunner().invoke(main, args + ["--max-new-tokens", "10", "--device", "cpu"])
    assert "0 responses written, 5 already there" in again.output
    assert partial.read_text() == full.read_text()

    with pytest.raises(DflashError, match="--out .* is a folder"):
        regenerate(dataclasses.replace(cfg, out=tmp_path), progress=False)
    bad = CliRunner().invoke(main, args + ["--top-p", "0"])
    assert bad.exit_code == 2 and "--top-p must be in (0, 1]" in bad.output
    bad = CliRunner().invoke(main, args + ["--batch-size", "0"])
    assert bad.exit_code == 2 and "--batch-size must be at least 1" in bad.output


def test_a_generate_out_of_gpu_memory_names_the_fix_and_the_rerun_resumes(
    tiny_target, prompts_file, tmp_path, monkeypatch
):
    """torch's out-of-memory error in a batch's generate is one clear error (exit 2) naming the batch and what to
    change; the answers of the batches before it stay, and a rerun completes the same output."""
    from transformers import GenerationMixin

    from cli.main import main

    target_path = tiny_target("qwen3_5")
    full = tmp_path / "full.jsonl"
    cfg = RegenerateConfig(target_path, prompts_file, full, max_new_tokens=MAX_NEW_TOKENS, batch_size=2, device="cpu")
    regenerate(cfg, progress=False)

    generate, calls = GenerationMixin.generate, []

    def out_of_memory_at_call_2(self, *args, **kwargs):
        calls.append(len(calls))
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", out_of_memory_at_call_2)
    out = tmp_path / "responses.jsonl"
    args = ["regenerate", "--model", str(target_path), "--data", str(prompts_file), "--out", str(out)]
    args += ["--max-new-tokens", str(MAX_NEW_TOKENS), "--batch-size", "2", "--device", "cpu"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert f"generating 2 answers of up to {MAX_NEW_TOKENS} new tokens" in result.output
    assert "--batch-size (now 2)" in result.output and "--server" in result.output
    assert "Traceback" not in result.output
    assert len(read_lines(out)) == 2  # the first batch's answers
    monkeypatch.undo()
    assert CliRunner().invoke(main, args).exit_code == 0
    assert out.read_text() == full.read_text()


def test_resume_refuses_output_from_other_prompts(tmp_path):
    out = write_jsonl(
        tmp_path / "out.jsonl",
        [{"messages": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "x"}]}],
    )
    with pytest.raises(DflashError, match="out.jsonl line 1 does not answer prompt 1"):
        completed_count(out, [{"messages": [{"role": "user", "content": "mine"}]}])
    out = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "other", "completion": "x"}])
    with pytest.raises(DflashError, match="written from other prompts"):
        completed_count(out, [{"prompt": "mine"}])
    out = write_jsonl(tmp_path / "old.jsonl", [{"text": "mine and its answer"}])
    with pytest.raises(DflashError, match="written by an older dflash"):
        completed_count(out, [{"prompt": "mine"}])


def test_in_memory_prompts_are_checked_and_normalised_like_a_file():
    records = [
        {"text": "a"},
        {"prompt": "b", "completion": "dropped"},
        {"messages": [{"role": "user", "content": "c"}]},
    ]
    assert prompt_records(records) == [{"prompt": "a"}, {"prompt": "b"}, records[2]]
    with pytest.raises(DflashError, match="prompt 1: the object has none of the keys"):
        prompt_records([{"title": "x"}])


def test_resume_counts_responses_holding_unicode_line_breaks(tmp_path):
    records = [{"prompt": "a"}, {"messages": [{"role": "user", "content": "b"}]}, {"prompt": "c"}]
    out = tmp_path / "out.jsonl"
    append_lines(out, [response_record(record, UNICODE_BREAKS) for record in records[:2]])
    whole = out.read_bytes()
    with open(out, "ab") as handle:  # a run killed while writing the third line
        handle.write(json.dumps(response_record(records[2], UNICODE_BREAKS), ensure_ascii=False).encode()[:-5])
    assert completed_count(out, records) == 2
    assert out.read_bytes() == whole


def test_prompts_with_unicode_line_breaks_load_whole(tmp_path):
    records = [{"text": UNICODE_BREAKS}, {"messages": [{"role": "user", "content": UNICODE_BREAKS}]}]
    assert load_prompts(write_jsonl(tmp_path / "prompts.jsonl", records)) == [{"prompt": UNICODE_BREAKS}, records[1]]


def test_prompts_load_from_every_kind_of_data_source(tmp_path):
    """A folder holding ShareGPT prompts in gzipped JSONL and text prompts in Parquet: the records of its files in
    path order, normalised as a plain JSONL of OpenAI messages and text prompts gives them."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "prompts"
    folder.mkdir()
    sharegpt = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"}]}
    (folder / "a.jsonl.gz").write_bytes(gzip.compress((json.dumps(sharegpt) + "\n").encode()))
    pq.write_table(pa.table({"text": ["def f(x):", "for i in"]}), folder / "b.parquet")
    plain = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]},
        {"text": "def f(x):"},
        {"text": "for i in"},
    ]
    assert load_prompts(folder) == load_prompts(write_jsonl(tmp_path / "plain.jsonl", plain))
    assert len(load_prompts(folder)) == 3


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 2: malformed JSON"),
        (
            '{"messages": [{"role": "assistant", "content": "hi"}]}',
            "line 2: the conversation must end with a user turn",
        ),
        ('{"messages": [{"role": "user"}]}', 'line 2: message 1 needs a string "content"'),
        ('{"text": "a", "messages": []}', "line 2: the object has the keys messages, text"),
        ('{"prompt": 3}', 'line 2: "prompt" must be a string'),
        ('{"text": ""}', "line 2: empty document"),
        ('{"messages": []}', 'line 2: "messages" must be a non-empty list'),
    ],
)
def test_bad_prompts_name_the_line(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(PROMPTS[0]) + "\n" + line + "\n")
    with pytest.raises(DflashError, match=message):
        load_prompts(path)


def test_resume_with_other_generation_settings_is_refused_naming_them(tiny_target, prompts_file, tmp_path):
    from dflash.regenerate.answers import settings_path

    target_path = tiny_target("qwen3_5")
    out = tmp_path / "responses.jsonl"
    cfg = RegenerateConfig(target_path, prompts_file, out, max_new_tokens=4, batch_size=5, device="cpu")
    lines = [json.dumps({"messages": [*PROMPTS[0]["messages"], {"role": "assistant", "content": "x"}]}) + "\n"]
    out.write_text(lines[0])  # one answer of an earlier run, which recorded its settings
    from dflash.regenerate.answers import generation_settings

    settings_path(out).write_text(json.dumps(generation_settings(cfg)))
    for change, field in (
        ({"max_new_tokens": 5}, "max_new_tokens: the output has 4, this run 5"),
        ({"temperature": 0.7}, "temperature: the output has 0.0, this run 0.7"),
        ({"top_p": 0.9}, "top_p"),
        ({"seed": 3}, "seed"),
        ({"model": str(tiny_target("qwen3"))}, "model"),
    ):
        with pytest.raises(DflashError, match=f"other generation settings \\(.*{field}"):
            regenerate(dataclasses.replace(cfg, **change), progress=False)
    assert out.read_text() == lines[0]  # nothing was appended


def test_an_unwritable_out_is_refused_before_generating(tiny_target, prompts_file, tmp_path, monkeypatch):
    import dflash.target

    monkeypatch.setattr(dflash.target, "load_target", None)  # the model must not even load
    (tmp_path / "file").write_text("")
    cfg = RegenerateConfig(tiny_target("qwen3_5"), prompts_file, tmp_path / "file" / "out.jsonl", device="cpu")
    with pytest.raises(DflashError, match="cannot be written"):
        regenerate(cfg, progress=False)


MULTI_TURN = {
    "messages": [
        {"role": "user", "content": "What does os.sep hold?"},
        {"role": "assistant", "content": "WRITTEN BY THE DATA, not the target"},
        {"role": "user", "content": "And os.pathsep?"},
    ]
}


def loss_text(tokenizer, document) -> str:
    return tokenizer.decode(document.input_ids[document.loss_mask.astype(bool)], skip_special_tokens=False)


def test_multi_turn_keeps_the_datas_turns_as_context_without_loss_by_default(tiny_target, tmp_path):
    """--turns last (the default): the earlier assistant turn stays the data's, unmarked, and harvest puts no loss on
    it; the target's answer is marked and on the loss; both commands say how many turns are context."""
    from cli.main import main

    target_path = tiny_target("qwen3_5")
    prompts, out = write_jsonl(tmp_path / "multi.jsonl", [MULTI_TURN]), tmp_path / "out.jsonl"
    args = ["regenerate", "--model", str(target_path), "--data", str(prompts), "--out", str(out), "--device", "cpu"]
    result = CliRunner().invoke(main, args + ["--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    assert "1 earlier assistant turns of 1 conversations are the data's, not the target's" in result.output
    [line] = read_lines(out)
    assert line["messages"][:3] == MULTI_TURN["messages"]  # the data's turn, unmarked
    assert line["messages"][3]["target"] is True and line["messages"][3]["role"] == "assistant"

    documents, stats = load_documents(DataConfig(out), str(target_path))
    _, tokenizer = load_target(target_path, "cpu", "float32")
    text = loss_text(tokenizer, documents[0])
    assert "WRITTEN BY THE DATA" not in text and text.startswith(line["messages"][3]["content"])
    assert stats.context_turns == 1

    # Regenerated again (say with another target), the earlier run's mark is not this run's.
    again = write_jsonl(tmp_path / "again.jsonl", [{"messages": [*line["messages"], MULTI_TURN["messages"][2]]}])
    [record] = load_prompts(again)
    assert all("target" not in message for message in record["messages"])


def test_turns_all_has_the_target_write_every_assistant_turn_in_order(tiny_target, tmp_path):
    target_path = tiny_target("qwen3_5")
    prompts, out = write_jsonl(tmp_path / "multi.jsonl", [MULTI_TURN, PROMPTS[2]]), tmp_path / "out.jsonl"
    cfg = RegenerateConfig(target_path, prompts, out, max_new_tokens=6, turns="all", device="cpu")
    stats = regenerate(cfg, progress=False)
    assert (stats.written, stats.context_turns) == (2, 0)
    messages = read_lines(out)[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[1]["target"] is messages[3]["target"] is True and "DATA" not in messages[1]["content"]

    # Each turn is what generate says for the history the target itself wrote before it.
    model, tokenizer = load_target(target_path, "cpu", "float32")
    eos_ids = eos_token_ids(model, tokenizer)
    for turn in (1, 3):
        history = [{"role": m["role"], "content": m["content"]} for m in messages[:turn]]
        ids = torch.tensor([encode_prompt(tokenizer, {"messages": history})])
        new = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :].tolist()
        new = new[: next((i for i, t in enumerate(new) if t in eos_ids), len(new))]
        assert messages[turn]["content"] == tokenizer.decode(new, skip_special_tokens=False)

    documents, data_stats = load_documents(DataConfig(out), str(target_path))
    assert data_stats.context_turns == 0
    assert loss_text(tokenizer, documents[0]).startswith(messages[1]["content"])
    # Resuming with the other --turns would mix two kinds of answers: refused, naming it.
    with pytest.raises(DflashError, match="turns: the output has 'all', this run 'last'"):
        regenerate(dataclasses.replace(cfg, turns="last"), progress=False)


def test_an_output_without_the_record_of_target_turns_is_not_resumed(tmp_path):
    from dflash.regenerate.answers import check_output, settings_path

    out = write_jsonl(
        tmp_path / "old.jsonl",
        [{**MULTI_TURN, "messages": [*MULTI_TURN["messages"], {"role": "assistant", "content": "x"}]}],
    )
    old = {"model": "m", "max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}
    settings_path(out).write_text(json.dumps(old))
    with pytest.raises(DflashError, match="older dflash, which did not mark the turns the target wrote"):
        check_output(out, {**old, "turns": "last"})
    with pytest.raises(DflashError, match="written by an older dflash"):
        completed_count(out, load_prompts(write_jsonl(tmp_path / "p.jsonl", [MULTI_TURN])))


def test_answers_cut_at_max_new_tokens_are_marked_counted_and_keep_no_end_token_on_the_loss(tiny_target, tmp_path):
    from cli.main import main

    target_path = tiny_target("qwen3_5")
    prompts, out = write_jsonl(tmp_path / "p.jsonl", [PROMPTS[0], PROMPTS[2], PROMPTS[4]]), tmp_path / "out.jsonl"
    args = ["regenerate", "--model", str(target_path), "--data", str(prompts), "--out", str(out), "--device", "cpu"]
    result = CliRunner().invoke(main, args + ["--max-new-tokens", "3"])
    assert result.exit_code == 0, result.output
    lines = read_lines(out)
    model, tokenizer = load_target(target_path, "cpu", "float32")
    eos_ids = eos_token_ids(model, tokenizer)
    cut = 0
    for record, line in zip(load_prompts(prompts), lines):
        ids = torch.tensor([encode_prompt(tokenizer, record)])
        new = model.generate(ids, max_new_tokens=3, do_sample=False)[0, ids.shape[1] :].tolist()
        unfinished = not set(new) & eos_ids
        mark = line["messages"][-1].get("unfinished") if "messages" in line else line.get("unfinished")
        assert mark is (True if unfinished else None)
        cut += unfinished
    assert cut >= 2  # random weights rarely end a turn within 3 tokens
    assert f"{cut} answers were cut at --max-new-tokens 3 before the target ended them" in result.output

    documents, stats = load_documents(DataConfig(out), str(target_path))
    assert stats.unfinished == cut
    for document, line in zip(documents, lines):
        text = loss_text(tokenizer, document)
        if "messages" in line:
            assert text.endswith("<|im_end|>") is not line["messages"][-1].get("unfinished", False)


def test_prompts_with_openai_list_content_are_their_text():
    listed = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert prompt_records([listed]) == [{"messages": [{"role": "user", "content": "a\nb"}]}]
    with pytest.raises(DflashError, match="prompt 1: message 1 has a content part of type 'input_audio'"):
        prompt_records([{"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}])


def fail_writes_to(monkeypatch, path, after: int, error: int = errno.ENOSPC):
    """os.write of `path` writes `after` more bytes, then fails with `error` (the disk fills up mid-line)."""
    real_write, left = os.write, [after]

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}") != str(path):
            return real_write(fd, data)
        if left[0] <= 0:
            raise OSError(error, os.strerror(error))
        written = real_write(fd, bytes(data[: left[0]]))
        left[0] -= written
        return written

    monkeypatch.setattr(os, "write", write)


def test_a_full_disk_stops_regenerate_in_one_line_with_the_output_whole(
    tiny_target, prompts_file, tmp_path, monkeypatch
):
    from cli.main import main

    model = str(tiny_target("qwen3_5"))
    reference = tmp_path / "reference.jsonl"
    regenerate(RegenerateConfig(model, prompts_file, reference, max_new_tokens=MAX_NEW_TOKENS, device="cpu"), False)
    first_two = sum(len(line) + 1 for line in reference.read_bytes().split(b"\n")[:2])
    out = tmp_path / "out.jsonl"
    args = ["regenerate", "--model", model, "--data", str(prompts_file), "--out", str(out), "--device", "cpu"]
    args += ["--max-new-tokens", str(MAX_NEW_TOKENS), "--batch-size", "2"]
    fail_writes_to(monkeypatch, out, after=first_two + 5)  # the second batch's first line is half written
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and result.exception is not None and isinstance(result.exception, SystemExit)
    message = "error: " + result.output.split("error: ", 1)[1].strip()  # after the progress bar
    assert "\n" not in message and message.startswith(f"error: writing {out} failed: No space left on device")
    assert "rerun the same command" in message
    assert out.read_bytes() == reference.read_bytes()[:first_two]  # the two whole answers, no half line
    monkeypatch.undo()
    assert CliRunner().invoke(main, args).exit_code == 0
    assert out.read_bytes() == reference.read_bytes()  # the rerun resumed after them


def test_max_new_tokens_past_the_targets_positions_is_refused_before_loading(tiny_target, prompts_file, tmp_path):
    from cli.main import main

    out = tmp_path / "out.jsonl"
    args = ["regenerate", "--model", str(tiny_target("qwen3_5")), "--data", str(prompts_file), "--out", str(out)]
    result = CliRunner().invoke(main, args + ["--max-new-tokens", "100000", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert "error: prompt 5 has " in result.output  # the longest, PROMPTS[4]: counted from 1, as lines are
    assert "with --max-new-tokens 100000 it reaches position" in result.output
    assert "past the target's max_position_embeddings 4096; pass --max-new-tokens" in result.output
    assert len(result.output.strip().splitlines()) == 1 and sorted(tmp_path.iterdir()) == [prompts_file]


def test_the_progress_bar_shows_the_new_tokens_of_the_batch(tiny_target, prompts_file, tmp_path, capsys):
    cfg = RegenerateConfig(tiny_target("qwen3_5"), prompts_file, tmp_path / "out.jsonl", max_new_tokens=4, device="cpu")
    regenerate(cfg, progress=True)
    assert "/4 new tokens of the batch" in capsys.readouterr().err


def test_a_prompt_ending_in_a_tool_turn_is_skipped_with_a_count_as_eval_skips_it(tiny_target, tmp_path, caplog):
    from cli.main import main

    tool_call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    called = [
        {"role": "user", "content": "Call a tool."},
        {"role": "assistant", "content": "", "tool_calls": [tool_call]},
        {"role": "tool", "content": "42"},
    ]
    prompts = write_jsonl(tmp_path / "p.jsonl", [PROMPTS[2], {"messages": called}, PROMPTS[3]])
    out = tmp_path / "out.jsonl"
    args = ["regenerate", "--model", str(tiny_target("qwen3_5")), "--data", str(prompts), "--out", str(out)]
    args += ["--max-new-tokens", "2", "--device", "cpu"]
    with caplog.at_level("WARNING", logger="dflash"):
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "2 responses written, 0 already there, 2 prompts" in result.output
    skipped = f"skipping 1 prompt(s) that do not end with a user turn for the target to answer ({prompts} line 2)"
    assert f"{skipped}; regenerate answers the other 2" in caplog.text
    assert [line["prompt"] for line in read_lines(out)] == [PROMPTS[2]["text"], PROMPTS[3]["prompt"]]
    again = CliRunner().invoke(main, args)  # the same prompts are left out: the output resumes
    assert again.exit_code == 0 and "0 responses written, 2 already there" in again.output, again.output
