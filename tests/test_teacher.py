"""`--teacher`: the target's next-token distribution stored beside the features, checked against transformers.

The target is a tiny random-weight Qwen3 whose LM head is scaled up, so that its distributions range from peaked
to flat as a trained model's do (a random head gives near-uniform ones, where top-k ids are near-ties). The harvest
runs it in float32; the reference is transformers' own full model forward of each document alone in float64.
Tolerances: a stored probability (float16) is within 2^-11 of its value, plus float32 compute noise (2^-10 in
all, 1e-6 absolute); the final hidden state (bf16) within one bf16 ulp, as the features are (tests/test_harvest.py).
"""

import json
import re
import shutil

import numpy as np
import pytest
import torch
import zarr
from click.testing import CliRunner
from harvest_support import (
    OPTIONS,
    assert_hidden_close,
    bf16,
    cli_args,
    run_cli,
    store_files,
    stored_documents,
    swap_files,
    write_harvest_data,
)

from cli.main import main
from dflash import selfcheck, store
from dflash.config import HarvestConfig
from dflash.errors import DflashError
from dflash.harvest import run_harvest
from dflash.plan import mode_bytes
from dflash.store import Store

K = 8
HEAD_SCALE = 16.0  # top-1 probabilities of about 0.05 to 0.9 on this target


@pytest.fixture(scope="module")
def peaked_target(tiny_target, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tiny_target("qwen3")
    folder = tmp_path_factory.mktemp("peaked-qwen3")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """Chat and text lines, a 3-token document and a long one split into pieces (positions restart in each)."""
    return write_harvest_data(tmp_path_factory.mktemp("data"), lines=30, long_from=20)


@pytest.fixture(scope="module")
def harvested(peaked_target, data_file, tmp_path_factory):
    """Factory: a complete store of the data with --teacher `teacher`, harvested once per value."""
    stores = {}

    def make(teacher: str):
        if teacher not in stores:
            out = tmp_path_factory.mktemp(f"store-{teacher.replace(':', '')}") / "store"
            cfg = HarvestConfig(model=str(peaked_target), data=str(data_file), out=str(out), teacher=teacher, **OPTIONS)
            run_harvest(cfg)
            stores[teacher] = out
        return stores[teacher]

    return make


def teachers_of(path) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    """(doc_id, piece) -> that document's slice of every teacher array."""
    opened = Store.open(path)
    rows = {}
    documents = {}
    for doc_id, piece, row, start, length in opened.documents().tolist():
        if row not in rows:
            rows[row] = opened.read_teacher(row)
        documents[doc_id, piece] = {name: value[start : start + length] for name, value in rows[row].items()}
    return documents


# ------------------------------------------------------------------------------------------------- content


def test_topk_teacher_equals_a_float64_forward_of_each_document(harvested, peaked_target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(peaked_target, dtype=torch.float64).eval()
    rows = stored_documents(harvested(f"topk:{K}"))
    teachers = teachers_of(harvested(f"topk:{K}"))
    assert min(len(doc["input_ids"]) for doc in rows.values()) <= 4
    same_order, top1 = [], []
    for key, teacher in teachers.items():
        with torch.no_grad():
            logits = model(torch.from_numpy(rows[key]["input_ids"]).long()[None]).logits[0]
        # Position t holds the distribution of token t+1: transformers' logits[t].
        p = logits.softmax(-1)
        top, top_ids = p.topk(K, -1)
        probs = torch.from_numpy(teacher["teacher_probs"].astype(np.float64))
        ids = torch.from_numpy(teacher["teacher_ids"].astype(np.int64))
        tail = torch.from_numpy(teacher["teacher_tail"].astype(np.float64))
        tolerance = dict(rtol=2**-10, atol=1e-6)
        torch.testing.assert_close(probs, top, **tolerance, msg=f"top-{K} probabilities of document {key}")
        # Each stored id has the stored probability (near-equal neighbours may trade places, nothing else).
        torch.testing.assert_close(p.gather(-1, ids), probs, **tolerance, msg=f"ids of document {key}")
        torch.testing.assert_close(tail, 1 - top.sum(-1), **tolerance, msg=f"tail mass of document {key}")
        same_order.append((ids == top_ids).double().mean().item())
        top1.append(top[:, 0])
    assert np.mean(same_order) >= 0.99
    top1 = torch.cat(top1)
    assert top1.min() < 0.2 and top1.max() > 0.8  # flat and peaked distributions were both checked


def test_hidden_teacher_equals_the_final_normed_hidden_state(harvested, peaked_target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(peaked_target, dtype=torch.float64).eval()
    rows = stored_documents(harvested("hidden"))
    identical = []
    for key, teacher in teachers_of(harvested("hidden")).items():
        with torch.no_grad():
            out = model(torch.from_numpy(rows[key]["input_ids"]).long()[None], output_hidden_states=True)
        final = out.hidden_states[-1][0]
        # The last hidden_states entry is the final norm's output, the LM head's input (Qwen3 in transformers).
        assert torch.equal(model.lm_head(final), out.logits[0])
        reference = final.float().to(torch.bfloat16).float()
        identical.append(assert_hidden_close(bf16(teacher["teacher_hidden"]), reference, f"document {key}"))
    assert np.mean(identical) >= 0.99


def test_a_teacher_changes_nothing_else(harvested):
    """Features, tokens and every row array the trainer reads are those of the store without a teacher."""
    plain, taught = Store.open(harvested("none")), Store.open(harvested(f"topk:{K}"))
    assert taught.row_layout == plain.row_layout and plain.teacher_layout == {}
    assert taught.num_rows == plain.num_rows
    for i in range(plain.num_rows):
        a, b = plain.read_row(i), taught.read_row(i)
        for name in plain.row_layout:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"row {i} {name}")
    assert taught.self_check.passed and taught.self_check.teacher is not None
    assert taught.self_check.teacher.worst_error <= taught.self_check.teacher.tolerance


def test_padding_holds_zeros_and_the_layout_matches_the_arrays(harvested):
    for teacher in (f"topk:{K}", "hidden"):
        opened = Store.open(harvested(teacher))
        for i in range(opened.num_rows):
            pad = opened.read_row(i)["doc_ids"] < 0
            for name, value in opened.read_teacher(i).items():
                assert not value[pad].any(), f"{teacher} row {i} {name}"
        raw, _ = mode_bytes(opened.features, opened.token_budget, opened.teacher)
        rows = [a for name, a in opened.parts[0].items() if name not in ("documents", store.DIGESTS)]
        assert raw == sum(a.nbytes for a in rows) / opened.num_rows  # plan's bytes are what the row arrays hold


def test_a_store_without_teacher_is_unchanged(harvested):
    path = harvested("none")
    for name in (store.HARVEST_FILE, store.MANIFEST_FILE):
        assert "teacher" not in (path / name).read_text()
    part = path / "parts" / "rank00000"
    arrays = sorted(p.name for p in part.iterdir() if p.is_dir())
    assert arrays == sorted(["hidden", "input_ids", "position_ids", "doc_ids", "loss_mask", "digests", "documents"])
    opened = Store.open(path)
    assert opened.teacher is None and opened.teacher_layout == {} and opened.self_check.teacher is None
    with pytest.raises(DflashError, match="holds no teacher arrays; harvest it with --teacher topk:K or hidden"):
        opened.read_teacher(0)


def test_read_teacher_into_checks_the_callers_arrays(harvested):
    opened = Store.open(harvested("hidden"))
    (shape, dtype) = opened.teacher_layout["teacher_hidden"]
    out = {"teacher_hidden": np.zeros(shape, np.int16)}  # bf16 bits as int16 (a tensor's view) are accepted
    opened.read_teacher_into(1, out)
    np.testing.assert_array_equal(out["teacher_hidden"].view(np.uint16), opened.read_teacher(1)["teacher_hidden"])
    with pytest.raises(DflashError, match="teacher_hidden is uint16 of shape"):
        opened.read_teacher_into(0, {"teacher_hidden": np.zeros(shape, np.float32)})


# -------------------------------------------------------------------------------- resume, verify, repair


def test_an_interrupted_harvest_resumes_to_the_same_teacher_arrays(
    harvested, peaked_target, data_file, tmp_path, monkeypatch
):
    out = tmp_path / "store"
    cfg = HarvestConfig(model=str(peaked_target), data=str(data_file), out=str(out), teacher=f"topk:{K}", **OPTIONS)
    write_rows, calls = store.PartWriter.write_rows, []

    def interrupted_at_the_third_group(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return write_rows(self, *args)

    monkeypatch.setattr(store.PartWriter, "write_rows", interrupted_at_the_third_group)
    with pytest.raises(DflashError, match="harvest interrupted"):
        run_harvest(cfg)
    progress = json.loads((out / "parts" / "rank00000" / store.PROGRESS_FILE).read_text())
    assert 0 < progress["rows_committed"] < progress["rows"]
    monkeypatch.undo()
    run_harvest(cfg)
    resumed, reference = Store.open(out), Store.open(harvested(f"topk:{K}"))
    for i in range(reference.num_rows):
        got, expected = resumed.read_teacher(i), reference.read_teacher(i)
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=f"row {i} {name}")


@pytest.mark.parametrize("teacher, array", [(f"topk:{K}", "teacher_probs"), ("hidden", "teacher_hidden")])
def test_verify_and_repair_cover_the_teacher_arrays(teacher, array, harvested, peaked_target, data_file, tmp_path):
    reference = harvested(teacher)
    out = tmp_path / "store"
    shutil.copytree(reference, out)
    chunk = next((out / "parts" / "rank00000" / array / "c" / "3").rglob("*"))
    while chunk.is_dir():
        chunk = next(chunk.iterdir())
    data = bytearray(chunk.read_bytes())
    data[10:14] = bytes(b ^ 0x5A for b in data[10:14])
    chunk.write_bytes(bytes(data))
    result = run_cli(["inspect", str(out), "--verify"])
    assert result.exit_code == 1 and f"part rank00000 array {array} chunk (3, 0" in result.output, result.output
    with pytest.raises(DflashError, match=f"array {array}"):
        Store.open(out).read_teacher(3)
    result = run_cli([*cli_args(peaked_target, data_file, out, teacher=teacher), "--repair"])
    assert result.exit_code == 0, result.output
    assert store_files(out) == store_files(reference)


@pytest.mark.parametrize("teacher, array", [(f"topk:{K}", "teacher_ids"), ("hidden", "teacher_hidden")])
def test_teacher_chunks_swapped_between_rows_are_found_and_repaired(
    teacher, array, harvested, peaked_target, data_file, tmp_path
):
    """Rows 1 and 3 exchange a teacher chunk file, each CRC32C valid in the other's place."""
    reference = harvested(teacher)
    out = tmp_path / "store"
    shutil.copytree(reference, out)
    folder = out / "parts" / "rank00000" / array / "c"
    swap_files(folder / "1" / "0" / "0", folder / "3" / "0" / "0")  # both arrays are [rows, T, width]
    with pytest.raises(DflashError, match=rf"array {array}, row 1\): .*not the chunk written there"):
        Store.open(out).read_teacher(1)
    result = run_cli(["inspect", str(out), "--verify"])
    assert result.exit_code == 1, result.output
    for row in (1, 3):
        assert f"part rank00000 array {array} chunk ({row}, 0, 0) (row {row}): chunk file" in result.output
    result = run_cli([*cli_args(peaked_target, data_file, out, teacher=teacher), "--repair"])
    assert result.exit_code == 0, result.output
    assert store_files(out) == store_files(reference)


def test_the_self_check_finds_a_teacher_of_the_next_position(harvested, tmp_path):
    """The commonest teacher bug is an off-by-one alignment: the distribution of token t+2 stored at t."""
    path = tmp_path / "store"
    shutil.copytree(harvested(f"topk:{K}"), path)
    result = run_cli(["inspect", str(path), "--reforward", "3", "--device", "cpu"])
    assert result.exit_code == 0 and "passed: 3 documents" in result.output and "teacher worst error" in result.output
    part = zarr.open_group(path / "parts" / "rank00000", mode="r+")
    for name in ("teacher_ids", "teacher_probs", "teacher_tail"):
        part[name][:] = np.roll(part[name][:], -1, axis=1)
    store.record_digests(path)  # rewritten through zarr: not the chunks the harvest wrote
    check = selfcheck.run_reforward(path, 3, device="cpu")
    assert not check.passed and not check.failures  # the features are right, the teacher is not
    assert len(check.teacher.failures) == 3 and check.teacher.worst_error > 10 * check.teacher.tolerance
    assert "FAILED on 3 slice(s)" in check.describe()


# --------------------------------------------------------------------------------------------- bad options


@pytest.mark.parametrize(
    "value, message",
    [
        ("topk:0", r"--teacher topk:0: K must be an integer from 1 to the vocabulary size \d+; give e.g. topk:32"),
        ("topk:x", r"--teacher topk:x: K must be an integer from 1 to the vocabulary size"),
        ("topk:100000", r"--teacher topk:100000: K must be an integer from 1 to the vocabulary size"),
        ("logits", r"--teacher logits is not one of none, hidden or topk:K; give e.g. topk:32"),
    ],
)
def test_bad_teacher_values_are_refused_before_anything_is_written(value, message, peaked_target, data_file, tmp_path):
    out = tmp_path / "store"
    result = CliRunner().invoke(main, cli_args(peaked_target, data_file, out, teacher=value))
    assert result.exit_code == 2 and result.output.startswith("error: "), result.output
    assert re.search(message, result.output), result.output
    assert not out.exists()


def test_a_store_of_other_teacher_arrays_is_refused_naming_the_fix(harvested, tmp_path):
    path = tmp_path / "store"
    shutil.copytree(harvested(f"topk:{K}"), path)
    raw = json.loads((path / store.MANIFEST_FILE).read_text())
    raw["teacher"]["arrays"]["teacher_probs"] = "bfloat16"
    (path / store.MANIFEST_FILE).write_text(json.dumps(raw))
    with pytest.raises(DflashError, match="use the dflash version that harvested the store, or harvest again"):
        Store.open(path)


def test_plan_counts_the_teacher_bytes(peaked_target, data_file, tmp_path):
    args = ["plan", "--model", str(peaked_target), "--data", str(data_file), "--out", str(tmp_path / "s")]
    args += ["--token-budget", "256", "--workers", "1"]
    result = run_cli([*args, "--teacher", "topk:32"])
    assert result.exit_code == 0, result.output
    assert "--teacher topk:32 adds 194 bytes per token raw" in result.output
    assert "the chosen mode (bf16, --teacher topk:32) needs" in result.output
    result = run_cli(args)
    assert "--teacher hidden adds 2H = 128" in result.output  # hidden size 64, bf16


def test_another_teacher_into_an_existing_store_is_refused(harvested, peaked_target, data_file):
    for store_teacher, run_teacher in ((f"topk:{K}", "hidden"), ("none", f"topk:{K}")):
        path = harvested(store_teacher)
        result = run_cli(cli_args(peaked_target, data_file, path, teacher=run_teacher))
        assert result.exit_code == 2, result.output
        before = "None" if store_teacher == "none" else repr(store_teacher)
        assert f"teacher: store has {before}, this run {run_teacher!r}" in result.output, result.output
