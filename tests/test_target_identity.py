"""Nothing silent about the target (issue 53): the store, a held-out store, the --target checkpoint and an exported
drafter each name the target they were made from by its weights' digest (`weights_sha256`). Train refuses a
--target or a --val-shards store of other weights and a held-out store of the training data; the export records its
target (config.json's `dflash_target`), which eval compares with --model. Each refusal names both sides and the
flag for a deliberate choice."""

import json

import pytest
from test_eval_checks import PROMPTS, _drafter_for, _eval
from train_support import config, copy_store, train_cli

from dflash.config import EvalConfig, HarvestConfig
from dflash.drafter import DrafterConfig
from dflash.errors import DflashError
from dflash.evaluate import evaluate
from dflash.harvest import run_harvest
from dflash.manifest import TargetIdentity, check_same_weights
from dflash.store import Store
from dflash.target_files import read_config_json, weights_sha256
from dflash.train.run import run_training


@pytest.fixture(scope="module")
def other_weights(tiny_target, target):
    """The tiny Qwen3 target's config with other random weights: a fine-tune, as far as the files tell."""
    other = tiny_target("qwen3", seed=1)
    assert read_config_json(str(other)) == read_config_json(str(target))
    assert weights_sha256(str(other)) != weights_sha256(str(target))
    return other


def identity(path) -> dict:
    return {"name": path.name, "weights_sha256": weights_sha256(str(path))}


def short(path) -> str:
    return weights_sha256(str(path))[:12]


# ---------------------------------------------------------------------------------------------- the shared check


def test_other_weights_are_refused_naming_both_digests_unless_allowed_and_an_unrecorded_side_is_noted(caplog):
    a, b = TargetIdentity("base", "a" * 64), TargetIdentity("tuned", "b" * 64)
    check_same_weights(a, TargetIdentity("copy", "a" * 64), "x", "fix it", "--flag", allowed=False)
    with pytest.raises(
        DflashError,
        match=r"x differ \(weights_sha256 bbbbbbbbbbbb \(tuned\) against aaaaaaaaaaaa \(base\)\): fix it, or pass --flag",
    ):
        check_same_weights(a, b, "x", "fix it", "--flag", allowed=False)
    with caplog.at_level("INFO", logger="dflash"):
        check_same_weights(a, b, "x", "fix it", "--flag", allowed=True)
        check_same_weights(a, TargetIdentity("old", None), "y", "fix it", "--flag", allowed=False)
    warning, note = caplog.records
    assert warning.levelname == "WARNING" and "bbbbbbbbbbbb" in warning.message and "--flag" in warning.message
    assert note.levelname == "INFO" and "y" in note.message and "not compared" in note.message


# ---------------------------------------------------------------------------------------------- train (items 5-7)


def test_a_target_of_other_weights_is_refused_before_any_work_unless_allowed(store, target, other_weights, tmp_path):
    result = train_cli(store, tmp_path / "run", "--target", str(other_weights))
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert short(other_weights) in result.output and short(target) in result.output
    assert "--allow-other-target-weights" in result.output
    assert not (tmp_path / "run" / "checkpoints").exists()
    ok = dict(max_steps=1, target=str(other_weights), export=True, allow_other_target_weights=True)
    run_training(config(store, tmp_path / "ok", **ok))
    # Served with the checkpoint whose embedding and LM head it learned: the export names that one.
    exported = json.loads((tmp_path / "ok" / "drafter" / "config.json").read_text())
    assert exported["dflash_target"] == identity(other_weights)


def test_the_export_records_the_target_it_was_trained_for(store, target, tmp_path):
    run_training(config(store, tmp_path / "run", max_steps=1, export=True))
    exported = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert exported["dflash_target"] == identity(target)
    assert DrafterConfig.from_hf_config(exported).target_identity == identity(target)


def test_a_held_out_store_of_other_target_weights_is_refused_unless_allowed(
    store, target, other_store, other_weights, tmp_path
):
    val = tmp_path / "val"  # the held-out documents, harvested from the fine-tune
    data = other_store.parent / "other.jsonl"
    run_harvest(HarvestConfig(model=str(other_weights), data=str(data), out=str(val), token_budget=64, workers=1))
    with pytest.raises(DflashError, match=rf"--val-shards {val} .*{short(other_weights)} .*against {short(target)}"):
        run_training(config(store, tmp_path / "run", max_steps=1, val_store=str(val)))
    run_training(config(store, tmp_path / "ok", max_steps=1, val_store=str(val), allow_other_target_weights=True))


def test_a_held_out_store_of_the_training_data_is_refused_with_the_overlap_unless_allowed(store, tmp_path, caplog):
    val = copy_store(store, tmp_path / "val")
    documents = Store.open(store).manifest.counts.documents
    with pytest.raises(DflashError, match=rf"all {documents} documents of --val-shards {val} are training documents"):
        run_training(config(store, tmp_path / "run", max_steps=1, val_store=str(val)))
    with caplog.at_level("WARNING", logger="dflash"):
        run_training(config(store, tmp_path / "ok", max_steps=1, val_store=str(val), allow_val_overlap=True))
    assert f"all {documents} documents of --val-shards {val} are training documents" in caplog.text


# ---------------------------------------------------------------------------------------------- eval (item 9)


def test_eval_refuses_a_drafter_trained_for_other_weights_unless_allowed(target, other_weights, tmp_path):
    drafter = _drafter_for(target, tmp_path / "d", target_identity=identity(target))
    with pytest.raises(
        DflashError, match=rf"{short(target)} .*against {short(other_weights)} .*--allow-other-target-weights"
    ):
        _eval(other_weights, drafter)
    assert _eval(target, drafter).methods["dflash"].mismatches == 0
    options = dict(max_new_tokens=4, device="cpu", prompt_lookup=0, allow_other_target_weights=True)
    cfg = EvalConfig(str(other_weights), PROMPTS, **options)
    assert evaluate(cfg, drafters=[str(drafter)]).methods["dflash"].new_tokens > 0


def test_eval_takes_an_export_without_a_target_record_with_a_note(target, tmp_path, caplog):
    drafter = _drafter_for(target, tmp_path / "d")
    assert "dflash_target" not in json.loads((drafter / "config.json").read_text())
    with caplog.at_level("INFO", logger="dflash"):
        _eval(target, drafter)
    assert f"the drafter {drafter}" in caplog.text and "not compared" in caplog.text
