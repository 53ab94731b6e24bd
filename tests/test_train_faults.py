"""The trainer under faults (issues 17 and 26): locks, torn checkpoints and metrics, full disks, signals, damaged
rows, runs resumed or refused."""

import io
import json
import math
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from train_support import (
    B,
    config,
    copy_store,
    corrupt_row,
    curve,
    manifest_edit,
    metrics_records,
    row_of_step,
    start_two_ranks,
    train_cli,
)

from dflash.config import HarvestConfig
from dflash.errors import DflashError
from dflash.harvest import run_harvest
from dflash.store import Store
from dflash.target_files import load_embedding_and_head
from dflash.train import Trainer, reader
from dflash.train.checkpoint import Checkpointer
from dflash.train.run import run_training
from dflash.train.setup import init_distributed

# ---------------------------------------------------------------------------------------------- faults (issue 17)


def test_a_second_run_into_a_locked_out_is_refused_naming_the_pid(store, tmp_path):
    from dflash.train.checkpoint import run_lock

    (tmp_path / "run").mkdir()
    held = run_lock(tmp_path / "run").acquire()  # as another live run would hold it
    try:
        with pytest.raises(DflashError, match=rf"in use by another dflash train \(process {os.getpid()} on "):
            run_training(config(store, tmp_path / "run", max_steps=2))
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
    finally:
        held.release()
    run_training(config(store, tmp_path / "run", max_steps=2))  # released: the folder is free again


def test_resume_skips_a_checkpoint_mixing_two_saves_or_cut_short(store, tmp_path, caplog):
    full = curve(run_training(config(store, tmp_path / "full", max_steps=6, ckpt_every=2))["records"])
    run_training(config(store, tmp_path / "other", max_steps=6, ckpt_every=2, seed=1))
    run = tmp_path / "run"
    run_training(config(store, run, max_steps=6, ckpt_every=2))
    ckpts = run / "checkpoints"
    shutil.copy(tmp_path / "other" / "checkpoints" / "step_6" / "model.pt", ckpts / "step_6" / "model.pt")
    optimizer = ckpts / "step_4" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])  # a power loss's leftovers
    with caplog.at_level("WARNING", logger="dflash"):
        resumed = run_training(config(store, run, max_steps=6, ckpt_every=2, resume=True))["records"]
    assert "skipping checkpoint" in caplog.text and "step_6" in caplog.text and "step_4" in caplog.text
    assert curve(resumed) == full[2:]  # from step_2, the newest checkpoint that loads
    # The rng file of another save (another run's) is caught by its digest.
    shutil.copy(tmp_path / "other" / "checkpoints" / "step_6" / "rng_rank0.pt", ckpts / "step_6" / "rng_rank0.pt")
    assert "rng_rank0.pt does not match" in Checkpointer(run).problem(ckpts / "step_6")
    for name in ("model.pt", "optimizer.pt", "state.json", "rng_rank0.pt"):
        (ckpts / "step_2" / name).write_bytes(b"")
    (ckpts / "step_4" / "state.json").write_bytes(b"")
    with pytest.raises(DflashError, match="has no checkpoint that loads .*remove its checkpoints folder"):
        run_training(config(store, run, max_steps=6, ckpt_every=2, resume=True))


def test_an_edited_checkpoint_file_is_refused_naming_it_and_the_resume_stays_exact(store, tmp_path, caplog):
    """Every file of a checkpoint is in its digests (issue 53): an edited state.json (`"step": 4` made 5) is named
    and skipped, the resume continues from the checkpoint before it to the same weights; none left is a refusal."""
    full = curve(run_training(config(store, tmp_path / "full", max_steps=6, ckpt_every=2))["records"])
    run = tmp_path / "run"
    run_training(config(store, run, max_steps=6, ckpt_every=2))
    ckpts = run / "checkpoints"
    shutil.rmtree(ckpts / "step_6")
    state = ckpts / "step_4" / "state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "step": 5}))
    with caplog.at_level("WARNING", logger="dflash"):
        resumed = run_training(config(store, run, max_steps=6, ckpt_every=2, resume=True))["records"]
    assert "skipping checkpoint" in caplog.text and "step_4: state.json does not match" in caplog.text
    assert curve(resumed) == full[2:]  # from step_2
    final = [torch.load(out / "checkpoints" / "step_6" / "model.pt") for out in (tmp_path / "full", run)]
    assert final[0].keys() == final[1].keys() and all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    # Any file, edited, removed or added, is named; a checkpoint with none that verifies is refused.
    step = ckpts / "step_6"
    (step / "optimizer.pt").write_bytes((step / "optimizer.pt").read_bytes() + b"\0")
    assert "optimizer.pt does not match" in Checkpointer(run).problem(step)
    (step / "optimizer.pt").unlink()
    assert "optimizer.pt is missing" in Checkpointer(run).problem(ckpts / "step_6")
    (ckpts / "step_4" / "projection.pt").write_bytes(b"")
    assert "projection.pt is not in" in Checkpointer(run).problem(ckpts / "step_4")
    (ckpts / "step_2" / "digests.json").write_text("{")
    assert "digests.json is unreadable" in Checkpointer(run).problem(ckpts / "step_2")
    with pytest.raises(DflashError, match="has no checkpoint that loads .*step_6: optimizer.pt is missing"):
        run_training(config(store, run, max_steps=6, ckpt_every=2, resume=True))


def test_a_checkpoint_without_digests_resumes_with_a_warning(store, tmp_path, caplog):
    """A checkpoint of an earlier dflash has no digests.json, its state.json the sha256 of the weights: accepted
    (the weights checked), the files that cannot be verified named in a warning."""
    import hashlib

    full = curve(run_training(config(store, tmp_path / "full", max_steps=4, ckpt_every=2))["records"])
    run = tmp_path / "run"
    run_training(config(store, run, max_steps=4, ckpt_every=2))
    shutil.rmtree(run / "checkpoints" / "step_4")
    step = run / "checkpoints" / "step_2"
    (step / "digests.json").unlink()
    files = {name: hashlib.sha256((step / name).read_bytes()).hexdigest() for name in ("model.pt", "optimizer.pt")}
    (step / "state.json").write_text(json.dumps({**json.loads((step / "state.json").read_text()), "files": files}))
    with caplog.at_level("WARNING", logger="dflash"):
        resumed = run_training(config(store, run, max_steps=4, ckpt_every=2, resume=True))["records"]
    assert "step_2 has no digests.json" in caplog.text and "not verified" in caplog.text
    assert curve(resumed) == full[2:]


def test_checkpoint_files_and_folder_are_flushed_before_the_rename(store, tmp_path, monkeypatch):
    from dflash.train import checkpoint

    synced, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def replace(src, dst):
        synced.append(("rename", str(src)))
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    run_training(config(store, tmp_path / "run", max_steps=2, ckpt_every=2))
    rename = next(i for i, s in enumerate(synced) if isinstance(s, tuple))
    tmp = synced[rename][1]
    before = set(synced[:rename])
    written = ("model.pt", "optimizer.pt", "state.json", "rng_rank0.pt", "digests.json")
    assert {f"{tmp}/{n}" for n in written} | {tmp} <= before
    assert str(tmp_path / "run" / "checkpoints") in synced[rename + 1 :]


@pytest.mark.parametrize("error", ["ENOSPC", "EFBIG"])
def test_a_full_disk_while_saving_is_one_line_and_keeps_the_previous_checkpoint(error, store, tmp_path, monkeypatch):
    import errno

    from dflash.train import checkpoint

    real = checkpoint._write

    def write(path, obj):
        if path.name == "optimizer.pt" and "step_4" in str(path.parent):
            raise OSError(getattr(errno, error), os.strerror(getattr(errno, error)), str(path))
        return real(path, obj)

    monkeypatch.setattr(checkpoint, "_write", write)
    result = train_cli(store, tmp_path / "run", "--max-steps", "4", "--ckpt-every", "2")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert "Traceback" not in result.output and len(errors) == 1, result.output
    assert os.strerror(getattr(errno, error)) in errors[0] and "step_2 is intact" in errors[0]
    assert str(tmp_path / "run" / "checkpoints") in errors[0]  # the disk, named by the folder
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_2"]
    assert Checkpointer(tmp_path / "run").problem(tmp_path / "run" / "checkpoints" / "step_2") is None


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_saves_a_checkpoint_and_the_resume_continues_the_curve(signame, store, tmp_path, monkeypatch):
    import signal

    full = curve(run_training(config(store, tmp_path / "full", max_steps=6, log_every=2))["records"])
    commits, real = [0], reader.DeviceFeed.commit

    def commit(self):
        commits[0] += 1
        if commits[0] == 3:  # during step 3
            os.kill(os.getpid(), getattr(signal, signame))
        return real(self)

    monkeypatch.setattr(reader.DeviceFeed, "commit", commit)
    before = signal.getsignal(signal.SIGINT)
    result = train_cli(
        store,
        tmp_path / "run",
        "--max-steps",
        "6",
        "--log-every",
        "2",
        "--val-fraction",
        "0.05",
        "--rows-per-step",
        "2",
    )
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are put back
    assert result.exit_code == 2, result.output
    assert f"stopped by {signame} after step 3 of 6" in result.output and "--resume" in result.output
    assert Checkpointer(tmp_path / "run").latest().name == "step_3"
    monkeypatch.setattr(reader.DeviceFeed, "commit", real)
    run_training(config(store, tmp_path / "run", max_steps=6, log_every=2, resume=True))
    assert curve(metrics_records(tmp_path / "run")) == full


def test_a_signal_in_the_last_step_stops_before_the_final_validation_which_the_resume_runs(
    store, tmp_path, monkeypatch
):
    """A stop asked for during the last step is a stop: the checkpoint, then no final validation (which takes as
    long as the held-out rows do); the resume runs it and writes its record."""
    import signal

    commits, real = [0], reader.DeviceFeed.commit

    def commit(self):
        commits[0] += 1
        if commits[0] == 2:  # during step 2 of 2
            os.kill(os.getpid(), signal.SIGINT)
        return real(self)

    monkeypatch.setattr(reader.DeviceFeed, "commit", commit)
    run = tmp_path / "run"
    result = train_cli(store, run, "--max-steps", "2", "--val-fraction", "0.05", "--rows-per-step", "2")
    assert result.exit_code == 2, result.output
    assert "stopped by SIGINT after the last step (2 of 2)" in result.output, result.output
    assert "before the final validation" in result.output and "--resume" in result.output
    assert commits[0] == 2 and metrics_records(run, "val") == []  # not one held-out batch was read
    assert Checkpointer(run).latest().name == "step_2"
    monkeypatch.setattr(reader.DeviceFeed, "commit", real)
    resumed = run_training(config(store, run, max_steps=2, val_fraction=0.05, rows_per_step=2, resume=True))
    assert resumed["val"] is not None and [r["step"] for r in metrics_records(run, "val")] == [2]


def test_resume_refuses_another_store_naming_both(store, other_store, tmp_path):
    run_training(config(store, tmp_path / "run", max_steps=2))
    with pytest.raises(DflashError, match=rf"store {store} \(identity \w+\), but --shards {other_store} is another"):
        run_training(config(other_store, tmp_path / "run", max_steps=2, resume=True))


def test_a_run_killed_before_its_first_checkpoint_starts_again_on_resume(store, tmp_path, caplog):
    """Without --resume the earlier run's records are kept and the way on named; --resume (what a scheduler's
    requeue passes) starts it again from step 0, saying so, with the records of an uninterrupted run."""
    full = curve(run_training(config(store, tmp_path / "full", max_steps=2))["records"])
    run_training(config(store, tmp_path / "run", max_steps=2))
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # killed before its first checkpoint
    with pytest.raises(DflashError, match="stopped before its first checkpoint; pass --resume to start it again"):
        run_training(config(store, tmp_path / "run", max_steps=2))
    assert [r["step"] for r in metrics_records(tmp_path / "run")] == [1, 2]
    run_training(config(store, tmp_path / "run", max_steps=2, resume=True))
    assert "has no checkpoint (the run stopped before its first one): starting again from step 0" in caplog.text
    assert curve(metrics_records(tmp_path / "run")) == full
    assert [r["step"] for r in metrics_records(tmp_path / "run", "val")] == [2]
    run_training(config(store, tmp_path / "fresh", max_steps=2, resume=True))  # --resume into a new --out: a start
    assert curve(metrics_records(tmp_path / "fresh")) == full


def test_resuming_a_finished_run_writes_no_second_final_validation(store, tmp_path):
    first = run_training(config(store, tmp_path / "run", max_steps=2))
    again = run_training(config(store, tmp_path / "run", max_steps=2, resume=True))
    assert [r["step"] for r in metrics_records(tmp_path / "run", "val")] == [2]
    assert again["val"] == first["val"]


def test_a_resume_removes_the_metrics_rewrites_of_killed_runs_never_a_live_ones(store, tmp_path):
    """`.metrics.jsonl.PID`, the rewrite of metrics.jsonl a resume makes, stays behind when that resume is killed:
    the next resume removes it, unless its process is alive."""
    import subprocess

    run = tmp_path / "run"
    run_training(config(store, run, max_steps=2))
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        for pid in (dead.pid, live.pid):
            (run / f".metrics.jsonl.{pid}").write_text('{"kind": "tr')
        run_training(config(store, run, max_steps=2, resume=True))
        assert sorted(p.name for p in run.glob(".metrics.jsonl.*")) == [f".metrics.jsonl.{live.pid}"]
    finally:
        live.kill()
        live.wait()


def test_a_torn_last_metrics_line_is_dropped_on_resume(store, tmp_path):
    full = curve(run_training(config(store, tmp_path / "full", max_steps=4, ckpt_every=2))["records"])
    run_training(config(store, tmp_path / "run", max_steps=4, ckpt_every=2))
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_4")
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()[:3]) + '{"kind": "tra')
    run_training(config(store, tmp_path / "run", max_steps=4, ckpt_every=2, resume=True))
    assert curve(metrics_records(tmp_path / "run")) == full


def test_resume_gives_the_same_records_when_checkpoints_fall_between_log_steps(store, tmp_path):
    full = curve(run_training(config(store, tmp_path / "full", max_steps=8, log_every=3, ckpt_every=4))["records"])
    run = tmp_path / "run"
    run_training(config(store, run, max_steps=8, log_every=3, ckpt_every=4))
    shutil.rmtree(run / "checkpoints" / "step_8")  # interrupted after step 4's checkpoint
    run_training(config(store, run, max_steps=8, log_every=3, ckpt_every=4, resume=True))
    assert [r[0] for r in full] == [3, 6, 8]
    assert curve(metrics_records(run)) == full


def test_a_damaged_row_stops_with_a_checkpoint_and_can_be_skipped(store, tmp_path):
    shards = copy_store(store, tmp_path / "store")
    row = row_of_step(shards, 2)  # read by step 3
    corrupt_row(shards, row)
    with pytest.raises(DflashError, match=rf"row {row} .*stopped after step 2 with checkpoint .*step_2.*--resume"):
        run_training(config(shards, tmp_path / "run", max_steps=6))
    assert Checkpointer(tmp_path / "run").latest().name == "step_2"
    result = run_training(config(shards, tmp_path / "run", max_steps=6, resume=True, max_damaged_rows=1))
    assert result["damaged_rows"] == [row]
    records = metrics_records(tmp_path / "run")
    assert [r["damaged_rows"] for r in records] == [0, 0, 1, 0, 0, 0]
    assert all(math.isfinite(r["loss"]) for r in records)


def test_a_skipped_row_gets_zero_loss_weight(store, tmp_path):
    """Skipping a row is training on its step's other row alone: same blocks, same loss as that row's."""
    shards = copy_store(store, tmp_path / "store")
    row = row_of_step(shards, 0)
    corrupt_row(shards, row)
    cfg = config(shards, tmp_path / "run", max_damaged_rows=1, embedding="host")
    trainer = Trainer(cfg, init_distributed("cpu"))
    rows = trainer._reader(trainer.store, trainer.plan.steps(0, 1), trainer.shape)
    try:
        batch = rows.next()
        assert not batch.tensors["loss_mask"][0, 0].any() and (batch.tensors["doc_ids"][0, 0] == -1).all()
        assert not batch.tensors["token_embeds"][0, 0].any()
        assert batch.tensors["loss_mask"][0, 1].any()
        # the other row's token embeddings: its tokens' rows of the table
        embed, _ = load_embedding_and_head(trainer.target_path)
        torch.testing.assert_close(
            batch.tensors["token_embeds"][0, 1], embed.float()[batch.tensors["input_ids"][0, 1].long()], rtol=0, atol=0
        )
        batch.release()
    finally:
        rows.close()
    assert trainer.damaged.rows == [row]
    with pytest.raises(DflashError, match="the 1 damaged rows allowed are used up"):
        trainer.damaged.met(row + 1, DflashError("corrupt data"))


def test_a_damaged_held_out_row_does_not_cost_the_export(store, tmp_path):
    shards = copy_store(store, tmp_path / "store")
    _, val_rows = reader.split_rows(Store.open(shards).num_rows, 0.05)
    corrupt_row(shards, int(val_rows[0]))
    with pytest.raises(DflashError, match=f"row {int(val_rows[0])} "):
        run_training(config(shards, tmp_path / "run", max_steps=2, export=True))
    assert (tmp_path / "run" / "drafter" / "model.safetensors").exists()
    assert Checkpointer(tmp_path / "run").latest().name == "step_2"
    result = run_training(config(shards, tmp_path / "skip", max_steps=2, max_damaged_rows=1))
    assert result["damaged_rows"] == [int(val_rows[0])] and result["val"]["damaged_rows"] == 1


@pytest.mark.parametrize("longest, blocks_fit", [(1, "blocks fit 1 token,"), (3, "blocks fit 3 tokens,")])
def test_a_store_too_short_for_a_block_names_the_longest_document(longest, blocks_fit):
    from types import SimpleNamespace

    import numpy as np

    from dflash.train.setup import check_anchorable

    counts = SimpleNamespace(loss_tokens=1, documents=1, tokens=longest)
    store = SimpleNamespace(
        manifest=SimpleNamespace(counts=counts), documents=lambda: np.array([[0, 0, 0, 0, longest]])
    )
    with pytest.raises(DflashError, match=f"the longest has {longest}\\), .*--block-size whose {blocks_fit} or"):
        check_anchorable(store, 16, "s")


@pytest.mark.parametrize("case", ["file", "inside_store", "unwritable", "not_a_run"])
def test_a_bad_out_is_one_line_before_any_work(case, store, tmp_path):
    if case == "file":
        out = tmp_path / "run"
        out.write_text("not a folder")
        expected = f"--out {out} is a file"
    elif case == "not_a_run":  # export's rule: a command never writes among other files
        out = tmp_path / "home"
        (out / "src").mkdir(parents=True)
        (out / "notes.txt").write_text("mine")
        expected = f"{out} is not empty and is not a dflash training run (it holds notes.txt, src/)"
        before = sorted(p.name for p in out.iterdir())
    elif case == "inside_store":
        shards = copy_store(store, tmp_path / "store")
        out, expected = shards / "run", "is inside the store"
        before = sorted(p.name for p in shards.iterdir())
    else:
        (tmp_path / "file").write_text("")
        out, expected = tmp_path / "file" / "run", "cannot write to --out"
    result = train_cli(shards if case == "inside_store" else store, out)
    assert result.exit_code == 2, result.output
    assert expected in result.output and len(result.output.strip().splitlines()) == 1, result.output
    if case == "inside_store":
        assert sorted(p.name for p in shards.iterdir()) == before
    if case == "not_a_run":
        assert sorted(p.name for p in out.iterdir()) == before


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(store, tmp_path):
    """The ranks agree on a stop at log steps: a SIGTERM to rank 1 alone ends both with one checkpoint."""
    import signal

    args = ["-m", "cli", "train", "--shards", str(store), "--out", str(tmp_path / "ranks"), "--draft-layers", "1"]
    args += ["--block-size", str(B), "--max-steps", "400", "--log-every", "5", "--rows-per-step", "1"]
    args += ["--no-tensorboard", "--no-export", "--device", "cpu", "--reader-workers", "1"]
    procs = start_two_ranks(args)
    metrics, deadline = tmp_path / "ranks" / "metrics.jsonl", time.time() + 180
    while not (metrics.exists() and metrics.read_text().strip()) and time.time() < deadline:
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outputs
    assert "stopped by a signal to another rank after step" in outputs[0], outputs[0]
    assert "stopped by SIGTERM after step" in outputs[1] and "--resume" in outputs[1], outputs[1]
    checkpoint = Checkpointer(tmp_path / "ranks", 0, 2).latest()
    assert int(checkpoint.name.removeprefix("step_")) % 5 == 0 and not checkpoint.name.endswith("_400")
    assert Checkpointer(tmp_path / "ranks", 0, 2).problem(checkpoint) is None


def test_a_damaged_held_out_row_in_a_mid_run_validation_stops_with_a_checkpoint(store, tmp_path):
    shards = copy_store(store, tmp_path / "store")
    _, val_rows = reader.split_rows(Store.open(shards).num_rows, 0.05)
    corrupt_row(shards, int(val_rows[0]))
    with pytest.raises(DflashError, match=r"stopped after step 2 with checkpoint .*step_2.*--resume"):
        run_training(config(shards, tmp_path / "run", max_steps=4, val_every=2))
    assert Checkpointer(tmp_path / "run").latest().name == "step_2"


def test_a_damaged_row_on_one_of_two_ranks_stops_both_with_a_checkpoint(store, tmp_path):
    shards = copy_store(store, tmp_path / "store")
    train, _ = reader.split_rows(Store.open(shards).num_rows, 0.05)
    row = int(reader.epoch_order(train, 0, 0, 1, 2)[2])  # rank 1's third step
    corrupt_row(shards, row)
    args = ["-m", "cli", "train", "--shards", str(shards), "--out", str(tmp_path / "ranks"), "--draft-layers", "1"]
    args += ["--block-size", str(B), "--max-steps", "8", "--log-every", "2", "--rows-per-step", "1"]
    args += ["--no-tensorboard", "--no-export", "--device", "cpu", "--reader-workers", "1", "--val-fraction", "0.05"]
    procs = start_two_ranks(args)
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outputs
    assert "another rank met a damaged row" in outputs[0], outputs[0]
    assert f"row {row} " in outputs[1] and "--max-damaged-rows" in outputs[1], outputs[1]
    checkpoint = Checkpointer(tmp_path / "ranks", 0, 2).latest()
    assert (
        checkpoint.name in ("step_2", "step_4") and Checkpointer(tmp_path / "ranks", 0, 2).problem(checkpoint) is None
    )


def test_an_interrupt_before_the_first_step_is_one_line(store, tmp_path, monkeypatch):
    import dflash.train.run

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(dflash.train.run, "run_training", interrupted)
    result = train_cli(store, tmp_path / "run")
    assert result.exit_code == 130 and "Traceback" not in result.output, result.output
    assert "interrupted without a new checkpoint" in result.output and "--resume" in result.output


def test_a_store_that_failed_its_self_check_is_refused_unless_allowed(store, tmp_path):
    failed = copy_store(store, tmp_path / "failed")
    manifest = json.loads((failed / "manifest.json").read_text())
    assert manifest["self_check"]["passed"], "the harvest's own check passed on this store"
    manifest["self_check"]["passed"] = False
    (failed / "manifest.json").write_text(json.dumps(manifest))
    result = train_cli(failed, tmp_path / "run")
    assert result.exit_code == 2 and "failed its check against the target" in result.output, result.output
    assert "--allow-failed-self-check" in result.output
    run_training(config(failed, tmp_path / "allowed", max_steps=1, allow_failed_self_check=True))


def test_a_val_fraction_that_leaves_no_step_is_named(store, tmp_path):
    rows = Store.open(store).num_rows
    assert rows >= 4  # a step of half the store fits without held-out rows
    with pytest.raises(DflashError, match=rf"--val-fraction 0.9 holds out \d+ of its {rows} rows"):
        run_training(config(store, tmp_path / "run", val_fraction=0.9, rows_per_step=rows // 2))


def test_drafter_options_cannot_override_what_the_store_fixes(store, tmp_path):
    for key, value in (("target_layer_ids", [2, 3, 4, 5, 6]), ("block_size", 8), ("hidden_size", 128)):
        with pytest.raises(DflashError, match=rf"--drafter-option cannot set {key}: the store fixes them"):
            run_training(config(store, tmp_path / key, drafter_overrides={key: value}))


def test_a_run_whose_export_folder_holds_other_files_is_refused_before_training(store, tmp_path):
    (tmp_path / "run" / "drafter").mkdir(parents=True)
    (tmp_path / "run" / "drafter" / "notes.txt").write_text("mine")
    with pytest.raises(DflashError, match="notes.txt"):
        run_training(config(store, tmp_path / "run", export=True))
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------- faults (issue 26)


class _DiskFullAfter(io.RawIOBase):
    """A file that takes `lines` lines, then fails every write with ENOSPC as a full disk does (what is still
    buffered fails again at close)."""

    def __init__(self, real, lines: int):
        self.real, self.lines = real, lines

    name = property(lambda self: self.real.name)

    def writable(self):
        return True

    def write(self, data):
        import errno

        if self.lines <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.lines -= bytes(data).count(b"\n")
        return self.real.write(data)


def test_a_full_disk_while_writing_metrics_is_one_line_and_resumes_exactly(store, tmp_path, monkeypatch):
    full = curve(run_training(config(store, tmp_path / "full", max_steps=6, ckpt_every=2))["records"])
    real_open = Path.open

    def open_metrics(self, mode="r", *args, **kwargs):
        if self.name != "metrics.jsonl" or mode != "a":
            return real_open(self, mode, *args, **kwargs)
        return io.TextIOWrapper(io.BufferedWriter(_DiskFullAfter(real_open(self, "ab", buffering=0), lines=3)))

    monkeypatch.setattr(Path, "open", open_metrics)
    args = (
        "--max-steps",
        "6",
        "--ckpt-every",
        "2",
        "--log-every",
        "1",
        "--rows-per-step",
        "2",
        "--val-fraction",
        "0.05",
    )
    result = train_cli(store, tmp_path / "run", *args)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and "Traceback" not in result.output and len(errors) == 1, result.output
    assert "writing metrics.jsonl failed: No space left on device" in errors[0] and "--resume" in errors[0]
    monkeypatch.setattr(Path, "open", real_open)
    run_training(config(store, tmp_path / "run", max_steps=6, ckpt_every=2, resume=True))
    assert curve(metrics_records(tmp_path / "run")) == full


def test_a_full_disk_inside_torch_save_is_one_line_and_keeps_the_previous_checkpoint(store, tmp_path, monkeypatch):
    """torch.save turns its file's OSError into a RuntimeError of its own: the disk's error is still the one named."""
    import errno

    from dflash.train import checkpoint

    class SecondWriteFails(io.FileIO):  # torch.save reports a failure of its second write as "unexpected pos"
        writes = 0

        def write(self, data):
            self.writes += 1
            if self.writes == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(data)

    def open_(path, mode="r", *args, **kwargs):
        if path.name == "model.pt" and "step_4" in path.parent.name:
            return SecondWriteFails(path, "wb")
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "open", open_, raising=False)
    result = train_cli(store, tmp_path / "run", "--max-steps", "4", "--ckpt-every", "2")
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and "Traceback" not in result.output and len(errors) == 1, result.output
    assert "writing checkpoint step_4 failed: No space left on device" in errors[0] and "step_2 is intact" in errors[0]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_2"]


def test_a_damaged_held_out_row_mid_run_keeps_every_record_exact_across_the_resume(store, tmp_path):
    """The step's train record is written before the stop, its checkpoint holds no sums of steps already recorded,
    and the resume runs the validation that failed: the records are those of a run on the repaired store."""
    options = dict(max_steps=6, val_every=2, log_every=2)
    full = run_training(config(store, tmp_path / "full", **options))["records"]
    val_full = [(r["step"], r["loss"], r["tau"]) for r in metrics_records(tmp_path / "full", "val")]
    shards = copy_store(store, tmp_path / "store")
    _, val_rows = reader.split_rows(Store.open(shards).num_rows, 0.05)
    backup = copy_store(shards, tmp_path / "backup")
    corrupt_row(shards, int(val_rows[0]))
    with pytest.raises(DflashError, match=r"stopped after step 2 with checkpoint"):
        run_training(config(shards, tmp_path / "run", **options))
    assert [r["step"] for r in metrics_records(tmp_path / "run")] == [2]
    shutil.rmtree(shards)
    shutil.copytree(backup, shards)  # repaired
    run_training(config(shards, tmp_path / "run", **options, resume=True))
    assert curve(metrics_records(tmp_path / "run")) == curve(full)
    assert [(r["step"], r["loss"], r["tau"]) for r in metrics_records(tmp_path / "run", "val")] == val_full


def test_a_cpu_run_past_the_available_memory_is_refused_before_any_model_is_built(store, tmp_path, monkeypatch):
    """With a tiny MemAvailable the defaults are refused before the embedding is read or the drafter made, naming the
    --anchors that fit; those anchors then train under the same memory."""
    from dflash import train
    from dflash.drafter import memory

    env = init_distributed("cpu")
    estimates = {a: Trainer(config(store, tmp_path / f"e{a}", anchors=a, rows_per_step=1), env) for a in (4, 11)}
    estimates = {a: trainer.memory_estimate for a, trainer in estimates.items()}
    available = (estimates[4] + estimates[11]) // 2
    (tmp_path / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available // 1024} kB\n")
    monkeypatch.setattr(memory, "MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(memory, "CGROUP", tmp_path / "no-cgroup")
    real_load = train.load_frozen
    monkeypatch.setattr(train, "load_frozen", lambda *a: pytest.fail("the target's tensors were read"))
    result = train_cli(store, tmp_path / "run", "--anchors", "11")
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and "Traceback" not in result.output and len(errors) == 1, result.output
    assert "available to this process (MemAvailable; 90% of it counts)" in errors[0] and "(11 now)" in errors[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "checkpoints").exists()
    anchors = int(errors[0].split("--anchors ")[1].split()[0])
    assert 4 <= anchors < 11
    monkeypatch.setattr(train, "load_frozen", real_load)
    assert train_cli(store, tmp_path / "fits", "--anchors", str(anchors)).exit_code == 0
    assert train_cli(store, tmp_path / "ignored", "--anchors", "11", "--ignore-memory-estimate").exit_code == 0


def test_a_held_out_store_of_the_same_target_read_from_another_path_is_accepted(store, other_store, tmp_path):
    val = copy_store(other_store, tmp_path / "val")
    manifest = json.loads((val / "manifest.json").read_text())
    tokenizer = {**manifest["tokenizer"], "name": "/elsewhere/a-copy-of-the-target"}
    manifest_edit(val, tokenizer=tokenizer)
    run_training(config(store, tmp_path / "run", max_steps=1, val_store=str(val)))
    manifest_edit(val, tokenizer={**tokenizer, "special_ids": {**tokenizer["special_ids"], "eos": 5}})
    with pytest.raises(DflashError, match=r"differs from the training store in tokenizer \(vocabulary size or special"):
        run_training(config(store, tmp_path / "other", max_steps=1, val_store=str(val)))


def test_a_finished_run_resumed_says_so_before_any_work_and_cannot_be_extended(store, tmp_path, monkeypatch, caplog):
    caplog.set_level("INFO", logger="dflash")
    first = run_training(config(store, tmp_path / "run", max_steps=2, export=True))
    weights = (tmp_path / "run" / "drafter" / "model.safetensors").read_bytes()
    monkeypatch.setattr(Trainer, "prepare", lambda *a: pytest.fail("a finished run warmed up"))
    again = run_training(config(store, tmp_path / "run", max_steps=2, export=True, resume=True))
    assert "finished all its 2 steps (checkpoint step_2): nothing left to train" in caplog.text
    assert again["val"] == first["val"] and again["export"] == first["export"] and again["finished"]
    assert (tmp_path / "run" / "drafter" / "model.safetensors").read_bytes() == weights  # exported again, the same
    with pytest.raises(DflashError, match=r"max_steps: checkpoint 2, now 4.*cannot be extended or shortened exactly"):
        run_training(config(store, tmp_path / "run", max_steps=4, resume=True))


def test_a_store_where_no_document_holds_a_block_is_refused_naming_the_block_size_that_fits(tiny_target, tmp_path):
    """Every document shorter than a block: no position can anchor one, so a run would train on nothing and
    export an untrained drafter. Refused before any work; the block size it names trains."""
    data = tmp_path / "short.jsonl"
    data.write_text("".join(json.dumps({"text": f"Hi there {i}."}) + "\n" for i in range(40)))
    shards = tmp_path / "store"
    run_harvest(
        HarvestConfig(
            model=str(tiny_target("qwen3")), data=str(data), out=str(shards), token_budget=64, workers=1, device="cpu"
        )
    )
    longest = int(Store.open(shards).documents()[:, 4].max())
    assert B < longest < 16
    result = train_cli(shards, tmp_path / "run", "--block-size", "16")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert f"no document of {shards} holds a block of 16 tokens (the longest has {longest})" in result.output
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
    run_training(config(shards, tmp_path / "fits", block_size=longest, max_steps=1, val_fraction=0))


@pytest.mark.parametrize("window", [1, 0, -5])
def test_a_window_that_leaves_a_block_no_context_is_refused_before_any_work(store, tmp_path, window):
    result = train_cli(store, tmp_path / "run", "--drafter-option", f"sliding_window={window}")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert f"sliding_window {window} leaves a block no context" in result.output
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("method", ["dflash", "dflash2", "dspark"])
def test_a_window_below_the_block_size_is_refused_naming_both(method, store, tmp_path):
    """z-lab's reference and the engines hide a block's own tokens farther apart than the window from each other,
    which dflash's training and decoding never do: below the block size the two would draft differently."""
    result = train_cli(store, tmp_path / "run", "--method", method, "--drafter-option", f"sliding_window={B - 1}")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert f"sliding_window {B - 1} is below block_size {B}" in result.output
    assert f"sliding_window={B}" in result.output  # the fix
    assert not (tmp_path / "run" / "checkpoints").exists()
