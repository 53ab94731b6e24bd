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
