"""`harvest --projection-from`: a held-out store takes its training store's projection, and only from a store of
the same target (config.json and weights) at the same layers: another target's P fits the shapes but projects
other features, and its captured share would be shown as this store's."""

import json
import shutil

import numpy as np
import pytest

from dflash.config import HarvestConfig
from dflash.errors import DflashError
from dflash.harvest import run_harvest
from dflash.store import Store
from dflash.tiny import CORPUS, make_tiny_target

OPTIONS = dict(token_budget=256, forward_tokens=512, overflow="split", dtype="float32", workers=1, device="cpu")


@pytest.fixture(scope="module")
def source(tiny_target, tmp_path_factory):
    """(target, data of a held-out store, the training store with a 1/4 subspace)."""
    root = tmp_path_factory.mktemp("projection-from")
    lines = CORPUS.read_text().splitlines()
    train, held_out = root / "train.jsonl", root / "val.jsonl"
    train.write_text("\n".join(lines[:20]) + "\n")
    held_out.write_text("\n".join(lines[20:30]) + "\n")
    target = tiny_target("qwen3")
    out = root / "train-store"
    run_harvest(
        HarvestConfig(model=str(target), data=str(train), out=str(out), subspace="1/4", self_check=0, **OPTIONS)
    )
    return target, held_out, out


def held_out_config(model, data, out, source, **changes) -> HarvestConfig:
    options = dict(subspace="1/4", projection_from=str(source), self_check=0, **OPTIONS)
    return HarvestConfig(model=str(model), data=str(data), out=str(out), **{**options, **changes})


def test_a_store_of_the_same_target_lends_its_projection(source, tmp_path):
    target, held_out, train = source
    run_harvest(held_out_config(target, held_out, tmp_path / "val", train))
    lent, own = Store.open(tmp_path / "val"), Store.open(train)
    np.testing.assert_array_equal(lent.projection, own.projection)
    assert lent.features.subspace == own.features.subspace
    recorded = json.loads((train / "projection" / "zarr.json").read_text())["attributes"]["sha256"]
    assert lent.manifest.fingerprint["projection_sha256"] == recorded


def test_a_store_of_another_targets_weights_is_refused(source, tmp_path):
    target, held_out, train = source
    other = make_tiny_target(tmp_path / "other", "qwen3", seed=1)  # the same config.json, other weights
    assert (other / "config.json").read_text() == (target / "config.json").read_text()
    with pytest.raises(DflashError, match=r"harvested from other features .*its target's weights differ"):
        run_harvest(held_out_config(other, held_out, tmp_path / "val", train))
    assert not (tmp_path / "val").exists()


def test_a_store_of_another_config_is_refused(source, tmp_path):
    target, held_out, train = source
    other = shutil.copytree(target, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))  # same shapes, other model
    with pytest.raises(DflashError, match=r"its target .* has another config\.json"):
        run_harvest(held_out_config(other, held_out, tmp_path / "val", train))
    assert not (tmp_path / "val").exists()


def test_a_store_of_other_layers_is_refused(source, tmp_path):
    target, held_out, train = source
    with pytest.raises(DflashError, match=r"it taps layers \[1, 2, 3, 4, 5\], this harvest \[0, 1, 2, 3, 4\]"):
        run_harvest(held_out_config(target, held_out, tmp_path / "val", train, layers=[0, 1, 2, 3, 4]))
    assert not (tmp_path / "val").exists()
