"""What a killed harvest leaves behind is finished or cleaned by the next run: a temporary folder of the
projection's write, a self-check that never got recorded, a calibration that no row uses."""

import json

import pytest

import dflash.harvest.driver
import dflash.store
from dflash.config import HarvestConfig
from dflash.errors import DflashError
from dflash.harvest import run_harvest
from dflash.store import Store
from dflash.tiny import CORPUS

OPTIONS = dict(token_budget=256, forward_tokens=512, overflow="split", dtype="float32", workers=1, device="cpu")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("\n".join(CORPUS.read_text().splitlines()[:20]) + "\n")
    return path


def config(tiny_target, data, out, **changes) -> HarvestConfig:
    return HarvestConfig(model=str(tiny_target("qwen3")), data=str(data), out=str(out), **{**OPTIONS, **changes})


def test_a_projection_write_killed_midway_leaves_no_folder_once_the_store_completes(tiny_target, data, tmp_path):
    out = tmp_path / "store"
    half_written = out / ".dflash-tmp-projection.0123abcd"  # what a kill inside zarr.create_array leaves
    (half_written / "c").mkdir(parents=True)
    (half_written / "zarr.json").write_text('{"shape": [')
    run_harvest(config(tiny_target, data, out, subspace="1/4", self_check=0))
    assert Store.open(out).projection is not None
    assert sorted(p.name for p in out.iterdir()) == [
        "harvest.json",
        "manifest.json",
        "parts",
        "projection",
        "zarr.json",
    ]


def test_a_self_check_killed_is_run_by_the_rerun(tiny_target, data, tmp_path, monkeypatch):
    out = tmp_path / "store"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(dflash.harvest.driver.selfcheck, "reforward_check", killed)
        with pytest.raises(DflashError, match="interrupted"):
            run_harvest(config(tiny_target, data, out, self_check=2))
    assert Store.open(out).self_check is None  # complete, never checked
    run_harvest(config(tiny_target, data, out, self_check=2))
    check = Store.open(out).self_check
    assert check is not None and check.passed and check.documents == 2


def test_a_calibration_no_row_uses_is_refused_by_a_harvest_of_other_settings(tiny_target, data, tmp_path, monkeypatch):
    out = tmp_path / "store"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:  # stopped after the calibration, before harvest.json
        patch.setattr(dflash.store, "create_store", killed)
        with pytest.raises(DflashError, match="interrupted"):
            run_harvest(config(tiny_target, data, out, subspace="1/4", self_check=0))
    assert (out / "projection" / "zarr.json").is_file() and not (out / "harvest.json").exists()
    for other, why in ({}, "stores no subspace"), (dict(subspace="1/2"), "has another --subspace"):
        with pytest.raises(DflashError, match=f"projection of a harvest with other settings .*this harvest {why}"):
            run_harvest(config(tiny_target, data, out, self_check=0, **other))
        assert not (out / "harvest.json").exists()
    run_harvest(config(tiny_target, data, out, subspace="1/4", self_check=0))  # the same settings resume with it
    stored = json.loads((out / "projection" / "zarr.json").read_text())["attributes"]
    assert Store.open(out).features.subspace.captured == stored["captured"]


def _exited_pid() -> int:
    import subprocess

    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_rerun_removes_what_killed_writers_left_in_the_store_never_a_live_ones(tiny_target, data, tmp_path):
    """The temporaries of harvest.json and manifest.json (written and renamed into place in a moment) and the
    projection a --repair moved aside (zarr lists that folder as an array of the store): a kill leaves them; the
    next run removes those of dead processes on this host (and untagged ones, of a dflash from before the tag)
    and leaves a live process's and another host's alone."""
    import socket
    import subprocess

    out = tmp_path / "store"
    run_harvest(config(tiny_target, data, out, self_check=0))
    before = sorted(p.name for p in out.iterdir())
    host, dead = socket.gethostname(), _exited_pid()
    live = subprocess.Popen(["sleep", "60"])
    killed = [
        ".dflash-tmp-harvest.json.0123abcd",
        f".dflash-tmp-manifest.json.4567cdef.{dead}@{host}",
        f".dflash-tmp-projection.damaged.89abcdef.{dead}@{host}",
    ]
    kept = [f".dflash-tmp-manifest.json.0000aaaa.{live.pid}@{host}", f".dflash-tmp-harvest.json.1111bbbb.{dead}@other"]
    try:
        for name in killed + kept:
            if "projection" in name:
                (out / name / "c").mkdir(parents=True)
                (out / name / "zarr.json").write_text('{"shape": [')
            else:
                (out / name).write_text('{"format": ')
        run_harvest(config(tiny_target, data, out, self_check=0))  # complete: nothing else to do
        assert sorted(p.name for p in out.iterdir()) == sorted(before + kept)
    finally:
        live.kill()
        live.wait()


def test_a_complete_store_whose_harvest_json_was_deleted_gets_it_back_from_its_manifest(
    tiny_target, data, tmp_path, caplog
):
    """manifest.json holds what harvest.json held (and its parts record the header's digest, which the rebuilt one
    must match): a rerun rebuilds it instead of calling the folder no dflash store."""
    caplog.set_level("INFO", "dflash")
    out = tmp_path / "store"
    run_harvest(config(tiny_target, data, out, self_check=0))
    original = json.loads((out / "harvest.json").read_text())
    (out / "harvest.json").unlink()
    run_harvest(config(tiny_target, data, out, self_check=0))
    assert json.loads((out / "harvest.json").read_text()) == original
    assert "rebuilt" in caplog.text and "already a complete store" in caplog.text
    Store.open(out)
    # A manifest that is not the header the parts were written under: refused, naming the fix, nothing written
    (out / "harvest.json").unlink()
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "token_budget": manifest["token_budget"] * 2}))
    with pytest.raises(DflashError, match="harvest.json is missing.*restore harvest.json from a copy of the store"):
        run_harvest(config(tiny_target, data, out, self_check=0))
    assert not (out / "harvest.json").exists()
