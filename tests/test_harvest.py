"""End-to-end harvests of tiny real-architecture targets on CPU, checked against independent references.

Hidden-state tolerance: the harvest here runs the target in float32 and stores bf16; the reference is a
standalone float32 forward of each document through transformers' own model (`output_hidden_states`, layer k
is index k+1), rounded to bf16. Batching changes float32 results only in the last bits, which can move a bf16
rounding by one unit in the last place, so stored values must be within 1 bf16 ulp (2^-7 relative, plus 1e-6
absolute near zero) of the reference, and almost all of them (>= 99 %) bit-identical.
"""

import dataclasses
import errno
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from dflash import store, store_writer
from dflash.config import HarvestConfig
from dflash.data import DataConfig, load_documents, load_tokenizer
from dflash.harvest import run_harvest
from dflash.store import Store
from dflash.tiny import CORPUS

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 256
OPTIONS = dict(
    token_budget=BUDGET, forward_tokens=2 * BUDGET, overflow="split", dtype="float32", workers=1, device="cpu"
)


def cli_args(model, data, out, **overrides) -> list[str]:
    options = {**OPTIONS, **overrides}
    args = ["harvest", "--model", str(model), "--data", str(data), "--out", str(out)]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """Corpus lines (chat and text) plus a 3-token document and a long one that splits into many pieces."""
    lines = CORPUS.read_text().splitlines()[:100]
    long_text = "\n\n".join(json.loads(line).get("text", "") for line in lines[:60])
    lines += [json.dumps({"text": "Hi."}), json.dumps({"text": long_text})]
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def harvested(tiny_target, data_file, tmp_path_factory):
    """Factory: a complete one-rank store of the data for a tiny target of `arch`, harvested in-process."""
    stores = {}

    def make(arch: str) -> Path:
        if arch not in stores:
            out = tmp_path_factory.mktemp(f"store-{arch}") / "store"
            run_harvest(HarvestConfig(model=str(tiny_target(arch)), data=str(data_file), out=str(out), **OPTIONS))
            stores[arch] = out
        return stores[arch]

    return make


def stored_documents(path) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    """(doc_id, piece) -> that document's slice of every row array, located through the documents table."""
    shards = Store.open(path)
    rows, documents = {}, {}
    for doc_id, piece, row, start, length in shards.documents().tolist():
        if row not in rows:
            rows[row] = shards.read_row(row)
        assert (doc_id, piece) not in documents, f"document {doc_id} piece {piece} stored twice"
        documents[doc_id, piece] = {name: rows[row][name][start : start + length] for name in rows[row]}
    return documents


def bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()


def assert_hidden_close(stored: torch.Tensor, reference: torch.Tensor, what: str) -> float:
    """Within one bf16 ulp; returns the bit-identical fraction."""
    bound = reference.abs() * 2**-7 + 1e-6
    worst = ((stored - reference).abs() - bound).max().item()
    assert worst <= 0, f"{what}: stored hidden states differ from the reference by more than 1 bf16 ulp"
    return (stored == reference).float().mean().item()


def assert_same_content(path, reference_path):
    """Same documents, same tokens, hidden states within the stated tolerance."""
    got, expected = stored_documents(path), stored_documents(reference_path)
    assert got.keys() == expected.keys()
    identical = []
    for key, doc in expected.items():
        for name in ("input_ids", "position_ids", "doc_ids", "loss_mask"):
            np.testing.assert_array_equal(got[key][name], doc[name], err_msg=f"{name} of document {key}")
        identical.append(assert_hidden_close(bf16(got[key]["hidden"]), bf16(doc["hidden"]), f"document {key}"))
    assert np.mean(identical) >= 0.99


def subprocess_env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}


def run_cli(args: list[str]):
    return CliRunner().invoke(main, args, catch_exceptions=False)


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


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_stored_features_are_bit_exact_reruns_of_the_harvest_batches(device, tiny_target, data_file, tmp_path):
    """Results depend on batch shapes on GPU (bf16 kernels), so the exact reference is the harvest's own forward
    batches run again, with random tokens instead of zeros in the padding: every stored document must be
    bit-identical to it (padding does not leak; scatter, streams and host copy move the exact values)."""
    from dflash.packing import PAD_MULTIPLE, PartPlan, forward_batches
    from dflash.target import TappedTarget

    model, out = str(tiny_target("qwen3_5")), tmp_path / "store"
    dtype = "float32" if device == "cpu" else "bfloat16"
    run_harvest(
        HarvestConfig(model=model, data=str(data_file), out=str(out), **{**OPTIONS, "device": device, "dtype": dtype})
    )
    plan = PartPlan.build(load_documents(DataConfig(data_file, BUDGET, "split", 1), model)[0], 0, 1, BUDGET)
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


def test_every_document_once_in_exact_rows_with_padding_masked(harvested, tiny_target, data_file):
    path = harvested("qwen3")
    expected, _ = load_documents(DataConfig(data_file, BUDGET, "split", 1), str(tiny_target("qwen3")))
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


def test_chat_loss_masks_cover_exactly_the_assistant_turns(harvested, tiny_target, data_file):
    tokenizer = load_tokenizer(str(tiny_target("qwen3")))
    stored = stored_documents(harvested("qwen3"))
    records = [json.loads(line) for line in data_file.read_text().splitlines()]
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


# -------------------------------------------------------------------------------------- resume and ranks


def test_killed_harvest_resumes_to_the_same_store(harvested, tiny_target, data_file, tmp_path):
    out = tmp_path / "store"
    # One row per forward group: many commits, so there is time to kill between the first and the last.
    command = [sys.executable, "-m", "cli", *cli_args(tiny_target("qwen3"), data_file, out, forward_tokens=BUDGET)]
    process = subprocess.Popen(
        command, cwd=ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    progress = out / "parts" / "rank00000" / "progress.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if progress.exists() and json.loads(progress.read_text())["rows_committed"] >= 1:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    assert process.wait() == -signal.SIGKILL, process.stderr.read().decode()[-2000:]
    state = json.loads(progress.read_text())
    assert 1 <= state["rows_committed"] < state["rows"] and not (out / "manifest.json").exists()
    result = run_cli(["inspect", str(out)])
    assert result.exit_code == 2 and "incomplete store" in result.output

    resumed = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming after row {state['rows_committed']}" in resumed.stderr
    assert not list(out.rglob("*.partial"))
    assert_same_content(out, harvested("qwen3"))


def test_two_ranks_make_one_store_equal_to_one_rank(harvested, tiny_target, data_file, tmp_path):
    out = tmp_path / "store"
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "cli", *cli_args(tiny_target("qwen3"), data_file, out, rank=rank, world_size=2)],
            cwd=ROOT,
            env=subprocess_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for process in processes:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-2000:]
    manifest = Store.open(out).manifest
    assert [part.name for part in manifest.parts] == ["rank00000", "rank00001"]
    assert all(part.documents > 0 for part in manifest.parts)
    assert_same_content(out, harvested("qwen3"))


@pytest.mark.parametrize(
    "theirs, ours, hook",
    [
        ({}, {"data": "half"}, "driver.load_documents"),
        ({}, {"precision": "fp8"}, "driver.load_documents"),
        ({"subspace": "1/8"}, {"subspace": "1/4"}, "calibration.second_moment"),
    ],
    ids=["data", "precision", "subspace"],
)
def test_ranks_started_together_with_other_settings_are_refused(
    theirs, ours, hook, tiny_target, data_file, tmp_path, monkeypatch
):
    """Rank 1 looks at the empty folder, then rank 0 (other settings) writes harvest.json, its projection and its
    whole part while rank 1 reads its data (or calibrates): rank 1 must refuse before its first row, and the
    store must not complete as a mix of two harvests."""
    from dflash.errors import DflashError

    module_name, name = hook.split(".")
    module = importlib.import_module(f"dflash.harvest.{module_name}")
    half = tmp_path / "half.jsonl"
    half.write_text("\n".join(data_file.read_text().splitlines()[:50]) + "\n")
    out, model = tmp_path / "store", str(tiny_target("qwen3"))

    def config(rank, **options):
        data = str(half) if options.pop("data", None) == "half" else str(data_file)
        return HarvestConfig(model=model, data=data, out=str(out), rank=rank, world_size=2, **{**OPTIONS, **options})

    real, ran = getattr(module, name), []

    def other_rank_runs_meanwhile(*args, **kwargs):
        if not ran:
            ran.append(True)
            run_harvest(config(0, **theirs))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, other_rank_runs_meanwhile)
    with pytest.raises(DflashError, match=r"rank 1 (runs|calibrated) with other settings") as refused:
        run_harvest(config(1, **ours))
    assert ran and "every rank of a harvest must run the same command" in str(refused.value)
    if name == "load_documents":
        assert ("data_sha256" if "data" in ours else "precision: the store has 'bf16', rank 1 has 'fp8'") in str(
            refused.value
        )
    assert not (out / "parts" / "rank00001" / store.PROGRESS_FILE).exists()  # no row of rank 1 was written
    assert not (out / store.MANIFEST_FILE).exists()
    monkeypatch.undo()
    run_harvest(config(1, **theirs))  # the way out: rank 1 with the store's settings completes it
    assert Store.open(out).num_rows > 0


def test_disk_full_fails_cleanly_and_the_rerun_resumes(harvested, tiny_target, data_file, tmp_path, monkeypatch):
    out = tmp_path / "store"
    args = cli_args(tiny_target("qwen3"), data_file, out)

    def fills_at_row_3(path, *args, **kwargs):  # the store's own chunk files: the disk fills at row 3
        if "/hidden/c/3/" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return open(path, *args, **kwargs)

    monkeypatch.setattr(store_writer, "open", fills_at_row_3, raising=False)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "is full" in result.output and "free space and rerun the same command" in result.output
    progress = json.loads((out / "parts" / "rank00000" / "progress.json").read_text())
    assert progress["rows_committed"] == 2 and not (out / "manifest.json").exists()  # groups of 2 rows

    monkeypatch.undo()
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    assert_same_content(out, harvested("qwen3"))


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


def test_folder_with_other_content_is_refused(tiny_target, data_file, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = CliRunner().invoke(main, cli_args(tiny_target("qwen3"), data_file, out))
    assert result.exit_code == 2 and "holds other content (notes.txt) and is not a dflash store" in result.output
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_other_options_into_an_existing_store_are_refused(harvested, tiny_target, data_file, tmp_path):
    path = harvested("qwen3")
    before = {p: p.stat().st_mtime_ns for p in path.rglob("*")}
    result = CliRunner().invoke(
        main, cli_args(tiny_target("qwen3"), data_file, path, token_budget=512, max_length=256, overflow="truncate")
    )
    assert result.exit_code == 2
    assert (
        "different settings (overflow: store has 'split', this run 'truncate'; token_budget: store has 256"
        in result.output
    )
    result = CliRunner().invoke(main, cli_args(tiny_target("qwen3_5"), data_file, path))
    assert result.exit_code == 2 and "model: store has" in result.output
    assert {p: p.stat().st_mtime_ns for p in path.rglob("*")} == before
    result = run_cli(cli_args(tiny_target("qwen3"), data_file, path))  # the same command again: nothing to do
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


def test_a_slow_writer_shows_up_as_forward_thread_waiting(tiny_target, data_file, tmp_path, monkeypatch):
    """The stall accounting the harvest logs (and bench/harvest.py reports) measures where time went: with
    writes slowed to SLOW seconds a group, the forward thread must wait for free host buffers once the
    HOST_BUFFERS in circulation are used up, and for the last write after its last forward."""
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
    run_harvest(HarvestConfig(model=str(tiny_target("qwen3")), data=str(data_file), out=str(out), **options))
    rows = Store.open(out).num_rows
    groups = -(-rows // 8)
    (s,) = stalls
    assert s.groups == groups
    # Group g > HOST_BUFFERS waits for the write of group g - HOST_BUFFERS; half the write time covers the forward.
    assert s.buffer_wait_s >= 0.5 * SLOW * (groups - pipeline.HOST_BUFFERS - 1) > 0
    assert SLOW <= s.drain_s
    assert s.gpu_wait_s < SLOW  # on the CPU the forward and the host copy are synchronous: nothing to wait for


def test_host_buffers_are_pinned_while_the_first_forward_runs_and_a_failure_stops_the_harvest(
    harvested, tiny_target, data_file, tmp_path, monkeypatch
):
    """Pinning the host buffers (seconds at long rows on a GPU) happens on a side thread: the setup before the
    first forward does not include it, the store is the same, and a buffer that cannot be made is the harvest's
    error (not a hang); the rerun resumes to the same store."""
    from dflash.harvest import driver, pipeline

    SLOW = 0.5
    buffers = pipeline.RowEncoder.buffers
    made = []

    def slow_buffers(self, pin=False, device=None):
        if device is None:  # a host buffer (device buffers are made on the main thread, before the first forward)
            made.append(threading.current_thread().name)
            time.sleep(SLOW)
        return buffers(self, pin, device)

    monkeypatch.setattr(pipeline.RowEncoder, "buffers", slow_buffers)
    stalls = []
    run_rows = driver.run_rows
    monkeypatch.setattr(driver, "run_rows", lambda *args: stalls.append(run_rows(*args)) or stalls[-1])
    out = tmp_path / "store"
    run_harvest(HarvestConfig(model=str(tiny_target("qwen3")), data=str(data_file), out=str(out), **OPTIONS))
    (s,) = stalls
    assert set(made) == {"dflash-pin"} and len(made) % pipeline.HOST_BUFFERS == 0  # (the self-check runs rows too)
    assert s.setup_s < SLOW <= s.buffer_wait_s  # the first group waited for its buffer after its forward
    assert_same_content(out, harvested("qwen3"))

    made.clear()

    def fails_at_second(self, pin=False, device=None):
        if device is None:
            made.append(pin)
            if len(made) == 2:
                raise RuntimeError("CUDA error: out of memory (pinned host memory)")
        return buffers(self, pin, device)

    monkeypatch.setattr(pipeline.RowEncoder, "buffers", fails_at_second)
    out = tmp_path / "failed"
    args = cli_args(tiny_target("qwen3"), data_file, out)
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and "pinned host memory" in str(result.exception), result.output
    monkeypatch.undo()
    assert run_cli(args).exit_code == 0
    assert_same_content(out, harvested("qwen3"))


def test_a_forward_out_of_gpu_memory_exits_naming_the_fix_and_the_rerun_resumes(
    harvested, tiny_target, data_file, tmp_path, monkeypatch
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
    args = cli_args(tiny_target("qwen3"), data_file, out)
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


def test_a_failed_check_is_recorded_and_stops_the_harvest(tiny_target, data_file, tmp_path, monkeypatch):
    from dflash.harvest import pipeline

    fill_rows = pipeline.fill_rows

    def padded_wrong(rows, *args):  # a capture bug: every stored feature is off by 5 %
        fill_rows(rows, *args)
        rows.mul_(1.05)

    monkeypatch.setattr(pipeline, "fill_rows", padded_wrong)
    out = tmp_path / "store"
    result = run_cli(cli_args(tiny_target("qwen3"), data_file, out, self_check=2))
    assert result.exit_code == 2 and "self-check against the target FAILED" in result.output, result.output
    check = Store.open(out).self_check
    assert not check.passed and check.documents == 2 and check.failures
    assert json.loads((out / store.MANIFEST_FILE).read_text())["self_check"]["passed"] is False


# ------------------------------------------------------------------------------------------ concurrency, output


def test_a_second_harvest_of_a_locked_part_is_refused_naming_the_holder(harvested, tiny_target, data_file, tmp_path):
    out = tmp_path / "store"
    shutil.copytree(harvested("qwen3"), out)  # a harvest in progress: two rows left, a chunk being written
    (out / store.MANIFEST_FILE).unlink()
    progress_file = out / "parts" / "rank00000" / store.PROGRESS_FILE
    progress = json.loads(progress_file.read_text())
    progress_file.write_text(json.dumps({**progress, "rows_committed": progress["rows"] - 2}))
    row = str(progress["rows"] - 2)  # the first uncommitted row
    in_flight = out / "parts" / "rank00000" / "hidden" / "c" / row / "0" / "0.123.partial"
    in_flight.write_bytes(b"the other run's chunk")
    args = cli_args(tiny_target("qwen3"), data_file, out, self_check=0)
    with store.part_lock(out, 0):  # the other run holds the part (flock conflicts across open files)
        result = run_cli(args)
        assert result.exit_code == 2, result.output
        assert f"is being harvested right now by process {os.getpid()}" in result.output
        assert in_flight.exists() and not (out / store.MANIFEST_FILE).exists()  # nothing of it was touched
    result = run_cli(args)  # the lock goes with its holder: the same command now resumes
    assert result.exit_code == 0, result.output
    assert not in_flight.exists()
    assert_same_content(out, harvested("qwen3"))


def test_a_harvest_stopped_before_harvest_json_leaves_only_a_lock_and_resumes(tiny_target, data_file, tmp_path):
    out = tmp_path / "store"
    with store.part_lock(out, 0):
        pass
    assert store.check_folder(out, {}) == "new"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_unwritable_out_is_refused_before_the_model_loads(tiny_target, data_file, tmp_path, monkeypatch):
    from dflash.harvest import driver

    parent = tmp_path / "readonly"
    parent.mkdir()
    parent.chmod(0o555)
    monkeypatch.setattr(driver, "TappedTarget", None)  # loading the target would fail differently
    try:
        result = run_cli(cli_args(tiny_target("qwen3"), data_file, parent / "store"))
    finally:
        parent.chmod(0o755)
    assert result.exit_code == 2 and "is not writable" in result.output, result.output


def test_an_unwritable_out_is_refused_before_the_model_loads_as_root_too(tiny_target, data_file, tmp_path, monkeypatch):
    from dflash.harvest import driver

    opened = Path.open

    def read_only(self, mode="r", *args, **kwargs):  # every write fails, as on a read-only mount
        if any(flag in mode for flag in "wax+"):
            raise OSError(errno.EROFS, "Read-only file system")
        return opened(self, mode, *args, **kwargs)

    model = tiny_target("qwen3")  # built before Path.open fails
    monkeypatch.setattr(driver, "TappedTarget", None)
    monkeypatch.setattr(Path, "open", read_only)
    result = run_cli(cli_args(model, data_file, tmp_path / "store"))
    assert result.exit_code == 2 and "is on a read-only file system" in result.output, result.output


# ------------------------------------------------------------------------------------------------------ repair


def store_files(path: Path) -> dict[str, bytes]:
    return {
        str(f.relative_to(path)): f.read_bytes() for f in path.rglob("*") if f.is_file() and f.name != store.LOCK_FILE
    }


def test_repair_rewrites_exactly_the_damaged_rows_bit_for_bit(harvested, tiny_target, data_file, tmp_path):
    reference = harvested("qwen3")
    out = tmp_path / "store"
    shutil.copytree(reference, out)
    part = out / "parts" / "rank00000"
    chunk = part / "hidden" / "c" / "5" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[100:104] = bytes(b ^ 0x5A for b in data[100:104])
    chunk.write_bytes(bytes(data))
    (part / "input_ids" / "c" / "2" / "0").unlink()
    (part / "documents" / "c" / "0" / "0").write_bytes(b"torn")
    result = run_cli(["inspect", str(out), "--verify"])
    assert result.exit_code == 1 and "rerun the harvest command with --repair for rank(s) 0" in result.output
    args = cli_args(tiny_target("qwen3"), data_file, out)
    result = run_cli(args)  # without --repair: complete, and it says what to do
    assert result.exit_code == 0 and (out / store.MANIFEST_FILE).exists()
    result = run_cli([*args, "--repair"])
    assert result.exit_code == 0, result.output
    assert store_files(out) == store_files(reference)  # every chunk file, the JSON files too, bit for bit
    result = run_cli(["inspect", str(out), "--verify"])
    assert result.exit_code == 0, result.output


def copied_while_written(reference: Path, out: Path, rows_left: int) -> dict:
    """A copy of `reference` as a copy of a store being written can be: no manifest, `rows_left` rows not yet
    committed, and chunk files of committed row 3 (and a documents chunk) not copied; returns its progress."""
    shutil.copytree(reference, out)
    (out / store.MANIFEST_FILE).unlink()
    part = out / "parts" / "rank00000"
    progress = json.loads((part / store.PROGRESS_FILE).read_text())
    progress["rows_committed"] = progress["rows"] - rows_left
    store.write_json_atomic(part / store.PROGRESS_FILE, progress)
    for chunk in ("hidden/c/3/0/0", "input_ids/c/3/0", "documents/c/0/0"):
        (part / chunk).unlink()
    return progress


def test_a_store_copied_while_written_resumes_from_its_first_hole(harvested, tiny_target, data_file, tmp_path, caplog):
    reference, out = harvested("qwen3"), tmp_path / "store"
    copied_while_written(reference, out, rows_left=2)
    with caplog.at_level("INFO", logger="dflash"):
        result = run_cli(cli_args(tiny_target("qwen3"), data_file, out))
    assert result.exit_code == 0, result.output
    assert "resuming from row 3 instead of" in caplog.text and "resuming after row 3" in caplog.text
    assert_same_content(out, reference)  # resumed row groups batch other documents together: last bits differ
    assert run_cli(["inspect", str(out), "--verify"]).exit_code == 0


def test_a_finished_part_with_holes_is_not_called_complete(harvested, tiny_target, data_file, tmp_path):
    reference, out = harvested("qwen3"), tmp_path / "store"
    copied_while_written(reference, out, rows_left=0)
    args = cli_args(tiny_target("qwen3"), data_file, out)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "chunk files of row 0 and maybe others are missing" in result.output, result.output
    assert "hidden/c/3/0/0" in result.output and "with --repair" in result.output
    assert "store complete" not in result.output and not (out / store.MANIFEST_FILE).exists()
    result = run_cli([*args, "--repair"])
    assert result.exit_code == 0, result.output
    assert store_files(out) == store_files(reference)


@pytest.mark.parametrize(
    "damaged, fix",
    [
        ("manifest.json", "rerun the harvest command, which rewrites it"),
        ("zarr.json", "with --repair, which rebuilds the zarr.json files"),
        ("parts/rank00000/hidden/zarr.json", "with --repair, which rebuilds the zarr.json files"),
        ("parts/rank00000/documents/zarr.json", "with --repair, which rebuilds the zarr.json files"),
        ("parts/rank00000/progress.json", None),  # the store reads without it; --repair rewrites it
    ],
)
def test_damaged_metadata_is_rebuilt_by_the_command_its_error_names(
    damaged, fix, harvested, tiny_target, data_file, tmp_path
):
    """No loop between inspect ("harvest again") and harvest ("already complete"): the command the error names
    rebuilds the file, as the harvest wrote it."""
    reference, out = harvested("qwen3"), tmp_path / "store"
    shutil.copytree(reference, out)
    (out / damaged).write_text("{torn")
    args = cli_args(tiny_target("qwen3"), data_file, out)
    result = CliRunner().invoke(main, ["inspect", str(out), "--verify"])
    if fix is None:
        assert result.exit_code == 0, result.output
        result = CliRunner().invoke(main, [*args, "--repair"])
    else:
        assert result.exit_code == 2 and fix in result.output, result.output
        result = CliRunner().invoke(main, [*args, *(["--repair"] if "--repair" in fix else [])])
    assert result.exit_code == 0, result.output
    assert store_files(out) == store_files(reference)
    assert run_cli(["inspect", str(out), "--verify"]).exit_code == 0


def test_repair_of_an_unfinished_part_is_refused(harvested, tiny_target, data_file, tmp_path):
    out = tmp_path / "store"
    shutil.copytree(harvested("qwen3"), out)
    (out / store.MANIFEST_FILE).unlink()
    progress_file = out / "parts" / "rank00000" / store.PROGRESS_FILE
    progress = json.loads(progress_file.read_text())
    progress_file.write_text(json.dumps({**progress, "rows_committed": 1}))
    result = run_cli([*cli_args(tiny_target("qwen3"), data_file, out), "--repair"])
    assert result.exit_code == 2 and "rerun the same command without --repair" in result.output, result.output


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_say_that_the_rerun_resumes(sig, tiny_target, tmp_path):
    out, data = tmp_path / "store", tmp_path / "long.jsonl"
    # Hundreds of rows of distinct documents: the harvest is still running well after its first committed row,
    # even when the machine is busy and this loop polls late.
    texts = [json.loads(line).get("text") for line in CORPUS.read_text().splitlines()]
    data.write_text("".join(json.dumps({"text": f"{i}: {t}"}) + "\n" for i in range(4) for t in texts if t))
    command = [sys.executable, "-m", "cli", *cli_args(tiny_target("qwen3"), data, out, forward_tokens=BUDGET)]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # A suite started in the background (`make test &`) inherits SIGINT ignored, and Python then keeps it so.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    progress = out / "parts" / "rank00000" / "progress.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if progress.exists() and json.loads(progress.read_text())["rows_committed"] >= 1:
            process.send_signal(sig)
            break
        time.sleep(0.005)
    stdout, stderr = process.communicate(timeout=120)
    output = stdout.decode() + stderr.decode()
    assert process.returncode == 2, output[-2000:]
    assert f"harvest interrupted ({sig.name}); the rows committed so far are kept: rerun the same command" in output
    assert "Aborted!" not in output
    assert 1 <= json.loads(progress.read_text())["rows_committed"]


def test_weights_changed_in_place_are_refused_on_resume_and_reforward_blames_no_layer(
    harvested, tiny_target, data_file, tmp_path
):
    """The same config.json over other weights: the resumed harvest must refuse (it would mix two models), and a
    reforward against the other weights must not name a layer that 'matches better' when none matches."""
    from dflash.tiny import make_tiny_target

    model, other = tmp_path / "target", make_tiny_target(tmp_path / "other", "qwen3", seed=1)
    shutil.copytree(tiny_target("qwen3"), model)
    assert (model / "config.json").read_bytes() == (other / "config.json").read_bytes()
    out = tmp_path / "store"
    rank = dict(world_size=2, self_check=0)
    assert run_cli(cli_args(model, data_file, out, rank=0, **rank)).exit_code == 0
    shutil.copy(other / "model.safetensors", model / "model.safetensors")  # rewritten in place, same size
    result = CliRunner().invoke(main, cli_args(model, data_file, out, rank=1, **rank))
    assert result.exit_code == 2, result.output
    assert "the target's weights at" in result.output and "changed since" in result.output, result.output
    assert "restore the checkpoint the store was started with, or harvest into a new --out folder" in result.output
    assert not (out / "parts" / "rank00001" / store.PROGRESS_FILE).exists()

    result = run_cli(["inspect", str(harvested("qwen3")), "--reforward", "2", "--device", "cpu", "--model", str(other)])
    assert result.exit_code == 1, result.output
    assert "reforward  FAILED" in result.output and "matches layer" not in result.output, result.output
    assert "it matches no tapped layer of the fresh forward" in result.output
    assert "the target checked is not the model that wrote the store" in result.output


def test_weights_fingerprint_reads_fixed_samples_of_each_file(tmp_path):
    from dflash import target_files

    path = tmp_path / "big.bin"
    data = bytearray(np.random.default_rng(0).integers(0, 256, 20 << 20, dtype=np.uint8).tobytes())
    path.write_bytes(data)
    size, digest = target_files.file_sample_sha256(path)
    assert size == len(data)
    last = len(data) - target_files.WEIGHT_SAMPLE_BYTES
    data[last * 16 // (target_files.WEIGHT_SAMPLES - 1) + 1000] ^= 1  # one bit inside a sample in the middle
    path.write_bytes(data)
    assert target_files.file_sample_sha256(path)[1] != digest
    data.append(0)  # the size is part of it
    path.write_bytes(data)
    assert target_files.file_sample_sha256(path)[0] == size + 1


def test_reforward_names_a_target_that_moved(harvested, tmp_path):
    path = tmp_path / "store"
    shutil.copytree(harvested("qwen3"), path)
    raw = json.loads((path / store.MANIFEST_FILE).read_text())
    raw["fingerprint"]["model"] = str(tmp_path / "gone")
    (path / store.MANIFEST_FILE).write_text(json.dumps(raw))
    result = run_cli(["inspect", str(path), "--reforward", "1", "--device", "cpu"])
    assert result.exit_code == 2 and "is not a model folder any more; pass the target's folder" in result.output
