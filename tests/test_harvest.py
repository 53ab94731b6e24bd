"""End-to-end harvests of tiny real-architecture targets on CPU, checked against independent references: what the
store holds, what it refuses, what inspect and the self-check find.

Hidden-state tolerance: the harvest here runs the target in float32 and stores bf16; the reference is a
standalone float32 forward of each document through transformers' own model (`output_hidden_states`, layer k
is index k+1), rounded to bf16. Batching changes float32 results only in the last bits, which can move a bf16
rounding by one unit in the last place, so stored values must be within 1 bf16 ulp (2^-7 relative, plus 1e-6
absolute near zero) of the reference, and almost all of them (>= 99 %) bit-identical.
"""

import dataclasses
import json
import re
import shutil
import threading
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from devices import CPU_AND_CUDA
from harvest_support import (
    BUDGET,
    OPTIONS,
    assert_hidden_close,
    assert_same_content,
    bf16,
    cli_args,
    run_cli,
    stored_documents,
)

from cli.main import main
from dflash import store
from dflash.config import HarvestConfig
from dflash.data import DataConfig, load_documents, load_tokenizer
from dflash.harvest import run_harvest
from dflash.store import Store

# ------------------------------------------------------------------------------------------------- content


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_features_equal_a_standalone_forward_of_each_document(arch, harvested, tiny_target):
    from transformers import AutoModelForCausalLM

    documents = stored_documents(harvested(arch))
    lengths = [len(doc["input_ids"]) for doc in documents.values()]
    assert min(lengths) <= 4 and max(lengths) == BUDGET  # very different lengths share rows and batches
    layers = list(Store.open(harvested(arch)).manifest.layer_ids)
    model = AutoModelForCausalLM.from_pretrained(tiny_target(arch), dtype=torch.float32).eval()
    identical = []
    with torch.no_grad():
        for key, doc in documents.items():
            states = model(torch.from_numpy(doc["input_ids"]).long()[None], output_hidden_states=True).hidden_states
            reference = torch.cat([states[k + 1][0] for k in layers], dim=-1).to(torch.bfloat16).float()
            identical.append(assert_hidden_close(bf16(doc["hidden"]), reference, f"{arch} document {key}"))
    assert np.mean(identical) >= 0.99


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_stored_features_are_bit_exact_reruns_of_the_harvest_batches(device, tiny_target, harvest_data, tmp_path):
    """Results depend on batch shapes on GPU (bf16 kernels), so the exact reference is the harvest's own forward
    batches run again, with random tokens instead of zeros in the padding: every stored document must be
    bit-identical to it (padding does not leak; scatter, streams and host copy move the exact values)."""
    from dflash.packing import PAD_MULTIPLE, PartPlan, forward_batches
    from dflash.target import TappedTarget

    model, out = str(tiny_target("qwen3_5")), tmp_path / "store"
    dtype = "float32" if device == "cpu" else "bfloat16"
    run_harvest(
        HarvestConfig(
            model=model, data=str(harvest_data), out=str(out), **{**OPTIONS, "device": device, "dtype": dtype}
        )
    )
    plan = PartPlan.build(load_documents(DataConfig(harvest_data, BUDGET, "split", 1), model)[0], 0, 1, BUDGET)
    target = TappedTarget(model, None, device, getattr(torch, dtype))
    stored = stored_documents(out)
    rows_per_group, generator = OPTIONS["forward_tokens"] // BUDGET, torch.Generator().manual_seed(0)
    for first in range(0, len(plan.rows), rows_per_group):
        for batch in forward_batches(
            plan, first, min(first + rows_per_group, len(plan.rows)), OPTIONS["forward_tokens"]
        ):
            docs = [plan.docs[d] for _, d in batch]
            width = -(-len(docs[0].input_ids) // PAD_MULTIPLE) * PAD_MULTIPLE
            ids = torch.randint(0, 1000, (len(docs), width), generator=generator)
            for b, doc in enumerate(docs):
                ids[b, : len(doc.input_ids)] = torch.from_numpy(doc.input_ids)
            features = target.features(ids).to(torch.bfloat16).cpu()
            for b, doc in enumerate(docs):
                got = torch.from_numpy(stored[doc.doc_id, doc.piece]["hidden"].view(np.int16)).view(torch.bfloat16)
                assert torch.equal(got, features[b, : len(doc.input_ids)]), f"document {doc.doc_id} piece {doc.piece}"


def test_every_document_once_in_exact_rows_with_padding_masked(harvested, tiny_target, harvest_data):
    path = harvested("qwen3")
    expected, _ = load_documents(DataConfig(harvest_data, BUDGET, "split", 1), str(tiny_target("qwen3")))
    stored = stored_documents(path)
    assert sorted(stored) == sorted((doc.doc_id, doc.piece) for doc in expected)
    assert any(doc.piece > 0 for doc in expected)  # the long document was split
    for doc in expected:
        got = stored[doc.doc_id, doc.piece]
        np.testing.assert_array_equal(got["input_ids"], doc.input_ids)
        np.testing.assert_array_equal(got["loss_mask"], doc.loss_mask)
        np.testing.assert_array_equal(got["position_ids"], np.arange(len(doc.input_ids)))
        assert (got["doc_ids"] == doc.doc_id).all()

    shards = Store.open(path)
    covered = np.zeros((shards.num_rows, BUDGET), np.int64)
    for _, _, row, start, length in shards.documents().tolist():
        covered[row, start : start + length] += 1
    assert covered.max() == 1  # documents never overlap
    for i in range(shards.num_rows):
        row = shards.read_row(i)
        assert row["hidden"].shape == (BUDGET, shards.feature_dim) and row["input_ids"].shape == (BUDGET,)
        pad = covered[i] == 0
        assert (row["doc_ids"][pad] == -1).all() and (row["doc_ids"][~pad] >= 0).all()
        assert (
            not row["loss_mask"][pad].any() and not row["input_ids"][pad].any() and not row["position_ids"][pad].any()
        )
        assert not row["hidden"][pad].any()
    counts = dataclasses.asdict(shards.manifest.counts)
    assert counts["documents"] == len(expected) and counts["tokens"] == int((covered == 1).sum())
    assert counts["padding_tokens"] == int((covered == 0).sum()) < 0.05 * covered.size  # tight packing


def test_chat_loss_masks_cover_exactly_the_assistant_turns(harvested, tiny_target, harvest_data):
    tokenizer = load_tokenizer(str(tiny_target("qwen3")))
    stored = stored_documents(harvested("qwen3"))
    records = [json.loads(line) for line in harvest_data.read_text().splitlines()]
    checked = 0
    for (doc_id, _), doc in stored.items():
        record = records[doc_id]
        if (doc_id, 1) in stored:
            continue  # split documents: their pieces cut turns anywhere
        if "text" in record:
            assert doc["loss_mask"].all()
            continue
        learned = tokenizer.decode(doc["input_ids"][doc["loss_mask"] == 1].tolist(), skip_special_tokens=False)
        answers = "".join(m["content"] + "<|im_end|>" for m in record["messages"] if m["role"] == "assistant")
        assert learned == answers, f"document {doc_id}"
        checked += 1
    assert checked >= 10


# -------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "lines, extra, message",
    [
        (None, {}, r"cannot read data file .*missing.jsonl"),
        (['{"text": "fine"}', '{"text": "broken'], {}, r"line 2: malformed JSON"),
        (
            ['{"text": "fine"}', '{"title": "no"}'],
            {},
            r"line 2: the object has none of the keys \"messages\", \"text\", \"prompt\"",
        ),
        (['{"text": ""}'], {}, r"line 1: empty document"),
        (['{"messages": [{"role": "user", "content": "hi"}]}'], {}, r"line 1: the conversation has no assistant turn"),
        (['{"text": "fine"}'], {"layers": "1,99"}, r"\[99\] outside the target's 8 layers"),
        (['{"text": "fine"}'], {"token_budget": 8}, r"token budget 8 is too small to hold a block of 16 tokens"),
    ],
    ids=["missing-file", "malformed-line", "neither-key", "empty-doc", "no-assistant", "layer-range", "small-budget"],
)
def test_bad_input_is_refused_before_anything_is_written(lines, extra, message, tiny_target, tmp_path):
    data = tmp_path / "missing.jsonl"
    if lines is not None:
        data = tmp_path / "data.jsonl"
        data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "store"
    result = CliRunner().invoke(main, cli_args(tiny_target("qwen3"), data, out, **extra))
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ")
    assert re.search(message, result.output), result.output
    assert not out.exists()


def test_folder_with_other_content_is_refused(tiny_target, harvest_data, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = CliRunner().invoke(main, cli_args(tiny_target("qwen3"), harvest_data, out))
    assert result.exit_code == 2 and "holds other content (notes.txt) and is not a dflash store" in result.output
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_other_options_into_an_existing_store_are_refused(harvested, tiny_target, harvest_data, tmp_path):
    path = harvested("qwen3")
    before = {p: p.stat().st_mtime_ns for p in path.rglob("*")}
    result = CliRunner().invoke(
        main, cli_args(tiny_target("qwen3"), harvest_data, path, token_budget=512, max_length=256, overflow="truncate")
    )
    assert result.exit_code == 2
    assert (
        "different settings (overflow: store has 'split', this run 'truncate'; token_budget: store has 256"
        in result.output
    )
    result = CliRunner().invoke(main, cli_args(tiny_target("qwen3_5"), harvest_data, path))
    assert result.exit_code == 2 and "model: store has" in result.output
    assert {p: p.stat().st_mtime_ns for p in path.rglob("*")} == before
    result = run_cli(cli_args(tiny_target("qwen3"), harvest_data, path))  # the same command again: nothing to do
    assert result.exit_code == 0
    assert {p: p.stat().st_mtime_ns for p in path.rglob("*")} == before


# ---------------------------------------------------------------------------------------------- inspect


def test_inspect_summarises_and_verify_finds_flipped_bytes(harvested, tmp_path):
    path = tmp_path / "store"
    shutil.copytree(harvested("qwen3"), path)
    result = run_cli(["inspect", str(path), "--verify"])
    assert result.exit_code == 0, result.output
    for expected in ("qwen3", "padding", "bytes per token", "every chunk present and its checksum correct"):
        assert expected in result.output
    chunk = path / "parts" / "rank00000" / "hidden" / "c" / "5" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[100:104] = bytes(b ^ 0x5A for b in data[100:104])
    chunk.write_bytes(bytes(data))
    result = run_cli(["inspect", str(path), "--verify"])
    assert result.exit_code == 1
    assert (
        "1 damaged chunks" in result.output and "part rank00000 array hidden chunk (5, 0, 0) (row 5)" in result.output
    )


def test_a_slow_writer_shows_up_as_forward_thread_waiting(tiny_target, harvest_data, tmp_path, monkeypatch):
    """The stall accounting the harvest logs (and bench/harvest.py reports) measures where time went: with
    writes slowed to SLOW seconds a group, the forward thread must pin host buffers up to HOST_BUFFERS, wait for
    free ones once those are used up, and wait for the last write after its last forward."""
    from dflash.harvest import driver, pipeline

    SLOW = 0.3
    write_rows = store.PartWriter.write_rows

    def slow_write_rows(self, *args):
        time.sleep(SLOW)
        return write_rows(self, *args)

    monkeypatch.setattr(store.PartWriter, "write_rows", slow_write_rows)
    stalls = []
    run_rows = driver.run_rows
    monkeypatch.setattr(driver, "run_rows", lambda *args: stalls.append(run_rows(*args)) or stalls[-1])
    out, options = tmp_path / "store", {**OPTIONS, "forward_tokens": 8 * BUDGET}  # 8 rows a group: fewer groups
    run_harvest(HarvestConfig(model=str(tiny_target("qwen3")), data=str(harvest_data), out=str(out), **options))
    rows = Store.open(out).num_rows
    groups = -(-rows // 8)
    (s,) = stalls
    assert s.groups == groups and s.host_buffers == pipeline.HOST_BUFFERS
    # Group g > HOST_BUFFERS waits for the write of group g - HOST_BUFFERS; half the write time covers the forward.
    assert s.buffer_wait_s >= 0.5 * SLOW * (groups - pipeline.HOST_BUFFERS - 1) > 0
    assert SLOW <= s.drain_s
    assert s.gpu_wait_s < SLOW  # on the CPU the forward and the host copy are synchronous: nothing to wait for


def test_host_buffers_are_pinned_only_when_none_is_free():
    """Pinning costs about 1 s per GB before the first forward: the pipeline makes HOST_BUFFERS_FIRST up front and
    another only when the forward asks while every buffer is out, up to HOST_BUFFERS, then waits for one back."""
    from dflash.harvest import pipeline

    made = []
    buffers = pipeline.HostBuffers(lambda: made.append(len(made)) or {"hidden": len(made) - 1})
    assert made == list(range(pipeline.HOST_BUFFERS_FIRST))
    for _ in range(20):  # a writer that keeps up: each buffer comes back before the next is asked for
        buffers.free.put(buffers.get())
    assert buffers.made == len(made) == pipeline.HOST_BUFFERS_FIRST
    out = [buffers.get() for _ in range(pipeline.HOST_BUFFERS)]  # a writer behind: none comes back
    assert buffers.made == pipeline.HOST_BUFFERS and sorted(b["hidden"] for b in out) == list(range(len(made)))
    threading.Timer(0.2, buffers.free.put, args=(out[0],)).start()
    start = time.perf_counter()
    assert buffers.get() is out[0] and time.perf_counter() - start >= 0.15  # waited for the writer: no fourth
    assert buffers.made == pipeline.HOST_BUFFERS


def test_a_host_buffer_that_cannot_be_pinned_stops_the_harvest_and_the_rerun_resumes(
    harvested, tiny_target, harvest_data, tmp_path, monkeypatch
):
    """Pinning the host buffers can fail (pinned memory is the host's scarcest): that is the harvest's error,
    not a hang, and the rerun makes the same store."""
    from dflash.harvest import pipeline

    buffers = pipeline.RowEncoder.buffers
    made = []

    def fails_at_second(self, pin=False, device=None):
        if device is None:  # a host buffer
            made.append(pin)
            if len(made) == 2:
                raise RuntimeError("CUDA error: out of memory (pinned host memory)")
        return buffers(self, pin, device)

    monkeypatch.setattr(pipeline.RowEncoder, "buffers", fails_at_second)
    out = tmp_path / "failed"
    args = cli_args(tiny_target("qwen3"), harvest_data, out)
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and "pinned host memory" in str(result.exception), result.output
    monkeypatch.undo()
    assert run_cli(args).exit_code == 0
    assert_same_content(out, harvested("qwen3"))


def test_a_forward_out_of_gpu_memory_exits_naming_the_fix_and_the_rerun_resumes(
    harvested, tiny_target, harvest_data, tmp_path, monkeypatch
):
    """torch's out-of-memory error in a target forward becomes the harvest's error (exit 2) naming the batch and
    the option to change; rows committed before it stay, and the rerun completes the same store."""
    from dflash.harvest import pipeline

    forward = pipeline.TappedTarget.forward
    calls = []

    def out_of_memory_at_call_5(self, input_ids):
        calls.append(tuple(input_ids.shape))
        if len(calls) == 5:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(self, input_ids)

    monkeypatch.setattr(pipeline.TappedTarget, "forward", out_of_memory_at_call_5)
    out = tmp_path / "store"
    args = cli_args(tiny_target("qwen3"), harvest_data, out)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    batch, length = calls[-1]
    what = f"{batch} documents of up to {length} tokens" if batch > 1 else f"one document of {length} tokens"
    assert f"the target's forward of {what} ran out of memory on cpu" in result.output
    assert "the rerun resumes after them" in result.output and "Traceback" not in result.output
    progress = json.loads((out / "parts" / "rank00000" / "progress.json").read_text())
    assert 0 < progress["rows_committed"] < progress["rows"]
    monkeypatch.undo()
    assert run_cli(args).exit_code == 0
    assert_same_content(out, harvested("qwen3"))


# ------------------------------------------------------------------------------------ self-check (reforward)


def test_harvest_records_a_passed_check_against_the_target(harvested):
    check = Store.open(harvested("qwen3")).self_check
    assert check is not None and check.passed, check
    assert check.documents == HarvestConfig.self_check and not check.failures
    assert check.worst_relative_error <= check.tolerance and check.bit_equal >= 0.99


def test_inspect_reforward_passes_a_good_store_and_names_a_shifted_layer(harvested, tmp_path):
    path = tmp_path / "store"
    shutil.copytree(harvested("qwen3"), path)
    result = run_cli(["inspect", str(path), "--reforward", "3", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "reforward  passed: 3 documents re-run alone" in result.output
    assert "self-check passed" in result.output  # the harvest's own check, from the manifest
    # An off-by-one between the recorded layer ids and what was captured: the store says layer 6, holds layer 5.
    manifest_path = path / store.MANIFEST_FILE
    raw = json.loads(manifest_path.read_text())
    assert raw["layer_ids"] == [1, 2, 3, 4, 5]
    raw["layer_ids"][-1] = raw["fingerprint"]["layers"][-1] = 6
    manifest_path.write_text(json.dumps(raw))
    result = run_cli(["inspect", str(path), "--reforward", "2", "--device", "cpu"])
    assert result.exit_code == 1, result.output
    assert "reforward  FAILED on 2 slice(s)" in result.output
    assert re.search(
        r"document \d+ .*\(row \d+\): layer 6 off by .*; it matches layer 5 of the fresh forward", result.output
    )


def test_a_failed_check_is_recorded_and_stops_the_harvest(tiny_target, harvest_data, tmp_path, monkeypatch):
    from dflash.harvest import pipeline

    fill_rows = pipeline.fill_rows

    def padded_wrong(rows, *args):  # a capture bug: every stored feature is off by 5 %
        fill_rows(rows, *args)
        rows.mul_(1.05)

    monkeypatch.setattr(pipeline, "fill_rows", padded_wrong)
    out = tmp_path / "store"
    result = run_cli(cli_args(tiny_target("qwen3"), harvest_data, out, self_check=2))
    assert result.exit_code == 2 and "self-check against the target FAILED" in result.output, result.output
    check = Store.open(out).self_check
    assert not check.passed and check.documents == 2 and check.failures
    assert json.loads((out / store.MANIFEST_FILE).read_text())["self_check"]["passed"] is False
