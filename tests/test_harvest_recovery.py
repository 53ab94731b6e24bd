"""Harvests that stop, fail or meet each other, and the store they leave: resume after a kill, ranks, a full disk,
locks, signals, an out-of-memory forward, changed weights, repair of damaged rows."""

import errno
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from harvest_support import (
    BUDGET,
    OPTIONS,
    ROOT,
    assert_same_content,
    cli_args,
    run_cli,
    store_files,
    subprocess_env,
    swap_files,
)

from cli.main import main
from dflash import store
from dflash.config import HarvestConfig
from dflash.harvest import run_harvest
from dflash.store import Store
from dflash.store import writer as store_writer
from dflash.tiny import CORPUS

# -------------------------------------------------------------------------------------- resume and ranks


def test_killed_harvest_resumes_to_the_same_store(harvested, tiny_target, harvest_data, tmp_path):
    out = tmp_path / "store"
    # One row per forward group: many commits, so there is time to kill between the first and the last.
    command = [sys.executable, "-m", "cli", *cli_args(tiny_target("qwen3"), harvest_data, out, forward_tokens=BUDGET)]
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


def test_two_ranks_make_one_store_equal_to_one_rank(harvested, tiny_target, harvest_data, tmp_path):
    out = tmp_path / "store"
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "cli", *cli_args(tiny_target("qwen3"), harvest_data, out, rank=rank, world_size=2)],
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
    theirs, ours, hook, tiny_target, harvest_data, tmp_path, monkeypatch
):
    """Rank 1 looks at the empty folder, then rank 0 (other settings) writes harvest.json, its projection and its
    whole part while rank 1 reads its data (or calibrates): rank 1 must refuse before its first row, and the
    store must not complete as a mix of two harvests."""
    from dflash.errors import DflashError

    module_name, name = hook.split(".")
    module = importlib.import_module(f"dflash.harvest.{module_name}")
    half = tmp_path / "half.jsonl"
    half.write_text("\n".join(harvest_data.read_text().splitlines()[:50]) + "\n")
    out, model = tmp_path / "store", str(tiny_target("qwen3"))

    def config(rank, **options):
        data = str(half) if options.pop("data", None) == "half" else str(harvest_data)
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


def test_disk_full_fails_cleanly_and_the_rerun_resumes(harvested, tiny_target, harvest_data, tmp_path, monkeypatch):
    out = tmp_path / "store"
    args = cli_args(tiny_target("qwen3"), harvest_data, out)

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


# ------------------------------------------------------------------------------------------ concurrency, output


def test_a_second_harvest_of_a_locked_part_is_refused_naming_the_holder(harvested, tiny_target, harvest_data, tmp_path):
    out = tmp_path / "store"
    shutil.copytree(harvested("qwen3"), out)  # a harvest in progress: two rows left, a chunk being written
    (out / store.MANIFEST_FILE).unlink()
    progress_file = out / "parts" / "rank00000" / store.PROGRESS_FILE
    progress = json.loads(progress_file.read_text())
    progress_file.write_text(json.dumps({**progress, "rows_committed": progress["rows"] - 2}))
    row = str(progress["rows"] - 2)  # the first uncommitted row
    in_flight = out / "parts" / "rank00000" / "hidden" / "c" / row / "0" / "0.123.partial"
    in_flight.write_bytes(b"the other run's chunk")
    args = cli_args(tiny_target("qwen3"), harvest_data, out, self_check=0)
    with store.part_lock(out, 0):  # the other run holds the part (flock conflicts across open files)
        result = run_cli(args)
        assert result.exit_code == 2, result.output
        assert f"is being harvested right now by process {os.getpid()}" in result.output
        assert in_flight.exists() and not (out / store.MANIFEST_FILE).exists()  # nothing of it was touched
    result = run_cli(args)  # the lock goes with its holder: the same command now resumes
    assert result.exit_code == 0, result.output
    assert not in_flight.exists()
    assert_same_content(out, harvested("qwen3"))


def test_a_harvest_stopped_before_harvest_json_leaves_only_a_lock_and_resumes(tiny_target, harvest_data, tmp_path):
    out = tmp_path / "store"
    with store.part_lock(out, 0):
        pass
    assert store.check_folder(out, {}) == "new"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_unwritable_out_is_refused_before_the_model_loads(tiny_target, harvest_data, tmp_path, monkeypatch):
    from dflash.harvest import driver

    parent = tmp_path / "readonly"
    parent.mkdir()
    parent.chmod(0o555)
    monkeypatch.setattr(driver, "TappedTarget", None)  # loading the target would fail differently
    try:
        result = run_cli(cli_args(tiny_target("qwen3"), harvest_data, parent / "store"))
    finally:
        parent.chmod(0o755)
    assert result.exit_code == 2 and "is not writable" in result.output, result.output


def test_an_unwritable_out_is_refused_before_the_model_loads_as_root_too(
    tiny_target, harvest_data, tmp_path, monkeypatch
):
    from dflash.harvest import driver

    opened = Path.open

    def read_only(self, mode="r", *args, **kwargs):  # every write fails, as on a read-only mount
        if any(flag in mode for flag in "wax+"):
            raise OSError(errno.EROFS, "Read-only file system")
        return opened(self, mode, *args, **kwargs)

    model = tiny_target("qwen3")  # built before Path.open fails
    monkeypatch.setattr(driver, "TappedTarget", None)
    monkeypatch.setattr(Path, "open", read_only)
    result = run_cli(cli_args(model, harvest_data, tmp_path / "store"))
    assert result.exit_code == 2 and "is on a read-only file system" in result.output, result.output


# ------------------------------------------------------------------------------------------------------ repair


def test_repair_rewrites_exactly_the_damaged_rows_bit_for_bit(harvested, tiny_target, harvest_data, tmp_path):
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
    args = cli_args(tiny_target("qwen3"), harvest_data, out)
    result = run_cli(args)  # without --repair: complete, and it says what to do
    assert result.exit_code == 0 and (out / store.MANIFEST_FILE).exists()
    result = run_cli([*args, "--repair"])
    assert result.exit_code == 0, result.output
    assert store_files(out) == store_files(reference)  # every chunk file, the JSON files too, bit for bit
    result = run_cli(["inspect", str(out), "--verify"])
    assert result.exit_code == 0, result.output


def test_chunks_swapped_between_rows_are_found_by_verify_and_put_back_by_repair(
    harvested, tiny_target, harvest_data, tmp_path
):
    """Rows 4 and 7 exchange their hidden and input_ids chunk files, each CRC32C valid in the other's place: train
    must not read row 4's tokens with row 7's features. The reader and inspect --verify name them, --repair
    re-harvests both rows bit for bit."""
    from dflash.errors import DflashError

    reference, out = harvested("qwen3"), tmp_path / "store"
    shutil.copytree(reference, out)
    part = out / "parts" / "rank00000"
    for chunk in ("hidden/c/{}/0/0", "input_ids/c/{}/0"):
        swap_files(part / chunk.format(4), part / chunk.format(7))
    with pytest.raises(DflashError, match=r"row 4 \(part rank00000, array hidden, row 4\): .*not the chunk written"):
        Store.open(out).read_row(4)
    result = run_cli(["inspect", str(out), "--verify"])
    assert result.exit_code == 1, result.output
    for row in (4, 7):
        for array, chunk in (("hidden", f"({row}, 0, 0)"), ("input_ids", f"({row}, 0)")):
            assert f"array {array} chunk {chunk} (row {row}): chunk file" in result.output, result.output
    assert "rerun the harvest command with --repair for rank(s) 0" in result.output
    result = run_cli([*cli_args(tiny_target("qwen3"), harvest_data, out), "--repair"])
    assert result.exit_code == 0, result.output
    assert store_files(out) == store_files(reference)
    assert run_cli(["inspect", str(out), "--verify"]).exit_code == 0


def test_a_part_of_another_target_in_a_complete_store_is_refused_until_harvested_again(
    tiny_target, harvest_data, tmp_path
):
    """parts/rank00001 of a harvest of another target (same config.json, other weights) copied into a complete
    store: inspect and train refuse it on open, naming the part, both header hashes and the fix, which works."""
    from dflash.tiny import make_tiny_target

    model, other = tiny_target("qwen3"), make_tiny_target(tmp_path / "other", "qwen3", seed=1)
    out, foreign = tmp_path / "store", tmp_path / "foreign"
    ranks = dict(world_size=2, self_check=0)
    for rank in (0, 1):
        assert run_cli(cli_args(model, harvest_data, out, rank=rank, **ranks)).exit_code == 0
    assert run_cli(cli_args(other, harvest_data, foreign, rank=1, **ranks)).exit_code == 0
    shutil.rmtree(out / "parts" / "rank00001")
    shutil.copytree(foreign / "parts" / "rank00001", out / "parts" / "rank00001")
    ours = json.loads((out / "parts" / "rank00000" / store.PROGRESS_FILE).read_text())["header_sha256"]
    theirs = json.loads((foreign / "parts" / "rank00001" / store.PROGRESS_FILE).read_text())["header_sha256"]
    result = CliRunner().invoke(main, ["inspect", str(out), "--verify"])
    assert result.exit_code == 2, result.output
    assert f"rank00001 records header_sha256 {theirs}, the store's is {ours}" in result.output, result.output
    assert "weights_sha256: store has" in result.output
    assert "delete those part folders (parts/rank00001) and manifest.json, then rerun rank(s) 1" in result.output
    shutil.rmtree(out / "parts" / "rank00001")  # the fix it names
    (out / store.MANIFEST_FILE).unlink()
    assert run_cli(cli_args(model, harvest_data, out, rank=1, **ranks)).exit_code == 0
    assert run_cli(["inspect", str(out), "--verify"]).exit_code == 0


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


def test_a_store_copied_while_written_resumes_from_its_first_hole(
    harvested, tiny_target, harvest_data, tmp_path, caplog
):
    reference, out = harvested("qwen3"), tmp_path / "store"
    copied_while_written(reference, out, rows_left=2)
    with caplog.at_level("INFO", logger="dflash"):
        result = run_cli(cli_args(tiny_target("qwen3"), harvest_data, out))
    assert result.exit_code == 0, result.output
    assert "resuming from row 3 instead of" in caplog.text and "resuming after row 3" in caplog.text
    assert_same_content(out, reference)  # resumed row groups batch other documents together: last bits differ
    assert run_cli(["inspect", str(out), "--verify"]).exit_code == 0


def test_a_finished_part_with_holes_is_not_called_complete(harvested, tiny_target, harvest_data, tmp_path):
    reference, out = harvested("qwen3"), tmp_path / "store"
    copied_while_written(reference, out, rows_left=0)
    args = cli_args(tiny_target("qwen3"), harvest_data, out)
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
    damaged, fix, harvested, tiny_target, harvest_data, tmp_path
):
    """No loop between inspect ("harvest again") and harvest ("already complete"): the command the error names
    rebuilds the file, as the harvest wrote it."""
    reference, out = harvested("qwen3"), tmp_path / "store"
    shutil.copytree(reference, out)
    (out / damaged).write_text("{torn")
    args = cli_args(tiny_target("qwen3"), harvest_data, out)
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


def test_a_missing_progress_json_and_a_damaged_chunk_are_mended_by_the_repair_verify_names(
    harvested, tiny_target, harvest_data, tmp_path
):
    """A finished part without its progress.json and with a damaged chunk: verify names --repair, and --repair
    rebuilds the file from the manifest (as for a garbled one) and then the row, instead of calling the part
    unfinished."""
    reference, out = harvested("qwen3"), tmp_path / "store"
    shutil.copytree(reference, out)
    part = out / "parts" / "rank00000"
    (part / store.PROGRESS_FILE).unlink()
    (part / "input_ids" / "c" / "2" / "0").write_bytes(b"torn")
    result = CliRunner().invoke(main, ["inspect", str(out), "--verify"])
    assert result.exit_code == 1 and "with --repair for rank(s) 0" in result.output, result.output
    result = CliRunner().invoke(main, [*cli_args(tiny_target("qwen3"), harvest_data, out), "--repair"])
    assert result.exit_code == 0, result.output
    assert store_files(out) == store_files(reference)
    assert run_cli(["inspect", str(out), "--verify"]).exit_code == 0


def test_inspect_and_harvest_give_a_store_of_a_newer_format_the_same_advice(
    harvested, tiny_target, harvest_data, tmp_path
):
    reference, out = harvested("qwen3"), tmp_path / "store"
    shutil.copytree(reference, out)
    for name in (store.HARVEST_FILE, store.MANIFEST_FILE):
        raw = json.loads((out / name).read_text())
        (out / name).write_text(json.dumps({**raw, "format_version": 4}))
    advice = (
        "was written by a newer dflash (format version 4 > 3, the newest this dflash reads): upgrade dflash to read "
        "it, or harvest again into a new folder with this version"
    )
    for args in (["inspect", str(out)], cli_args(tiny_target("qwen3"), harvest_data, out)):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and advice in " ".join(result.output.split()), result.output


def test_repair_of_an_unfinished_part_is_refused(harvested, tiny_target, harvest_data, tmp_path):
    out = tmp_path / "store"
    shutil.copytree(harvested("qwen3"), out)
    (out / store.MANIFEST_FILE).unlink()
    progress_file = out / "parts" / "rank00000" / store.PROGRESS_FILE
    progress = json.loads(progress_file.read_text())
    progress_file.write_text(json.dumps({**progress, "rows_committed": 1}))
    result = run_cli([*cli_args(tiny_target("qwen3"), harvest_data, out), "--repair"])
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
    harvested, tiny_target, harvest_data, tmp_path
):
    """The same config.json over other weights: the resumed harvest must refuse (it would mix two models), and a
    reforward against the other weights must not name a layer that 'matches better' when none matches."""
    from dflash.tiny import make_tiny_target

    model, other = tmp_path / "target", make_tiny_target(tmp_path / "other", "qwen3", seed=1)
    shutil.copytree(tiny_target("qwen3"), model)
    assert (model / "config.json").read_bytes() == (other / "config.json").read_bytes()
    out = tmp_path / "store"
    rank = dict(world_size=2, self_check=0)
    assert run_cli(cli_args(model, harvest_data, out, rank=0, **rank)).exit_code == 0
    shutil.copy(other / "model.safetensors", model / "model.safetensors")  # rewritten in place, same size
    result = CliRunner().invoke(main, cli_args(model, harvest_data, out, rank=1, **rank))
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
