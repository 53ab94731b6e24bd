"""The export folder: never overwrites what is not an earlier export, never left half-written, and loads as our
drafter through transformers' AutoModel (trust_remote_code) as well as through `load_drafter`."""

import json

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from dflash.drafter import DFlashDrafter
from dflash.errors import DflashError
from dflash.export import export_drafter, load_drafter
from tests.test_drafter import small_config

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def drafter(cfg, seed=0):
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg)
    with torch.no_grad():  # norms start at 1: perturb them so that a missing or swapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def inputs(cfg, R=2, T=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    Q = cfg.block_size
    embeds = torch.randn(R, Q, cfg.hidden_size, generator=g)
    features = torch.randn(R, T, cfg.feature_dim, generator=g)
    ctx_pos = torch.arange(T).expand(R, T)
    q_pos = torch.arange(T, T + Q).expand(R, Q)
    visible = torch.rand(R, 1, Q, T + Q, generator=g) > 0.3
    visible[..., 0] = True  # every query sees something
    return embeds, features, q_pos, ctx_pos, visible


# ---------------------------------------------------------------------------------------------- safety


def test_export_refuses_a_folder_that_is_not_an_export(tmp_path):
    out = tmp_path / "target"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"precious")
    (out / "tokenizer.json").write_text("{}")
    cfg = small_config()
    for replace in (False, True):  # not even when replacing earlier exports is allowed
        with pytest.raises(DflashError, match="not a dflash export.*model.safetensors, tokenizer.json"):
            export_drafter(drafter(cfg), cfg, out, replace_export=replace)
    assert (out / "model.safetensors").read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(DflashError, match="is a file"):
        export_drafter(drafter(cfg), cfg, file)


def test_export_replaces_an_earlier_export_only_when_asked(tmp_path):
    cfg = small_config()
    out = export_drafter(drafter(cfg, seed=0), cfg, tmp_path / "d")
    first = (out / "model.safetensors").read_bytes()
    with pytest.raises(DflashError, match="earlier drafter export; pass --force"):
        export_drafter(drafter(cfg, seed=1), cfg, out, replace_export=False)
    assert (out / "model.safetensors").read_bytes() == first
    export_drafter(drafter(cfg, seed=1), cfg, out, replace_export=True)
    assert (out / "model.safetensors").read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temporary folder left
    empty = tmp_path / "empty"
    empty.mkdir()
    export_drafter(drafter(cfg), cfg, empty, replace_export=False)  # an empty folder is fine
    assert (empty / "config.json").exists()


def test_a_failed_export_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    import shutil

    cfg = small_config()
    out = export_drafter(drafter(cfg, seed=0), cfg, tmp_path / "d")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", disk_full)  # the last file of the export
    with pytest.raises(DflashError, match="No space left on device"):
        export_drafter(drafter(cfg, seed=1), cfg, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]

    def interrupted(source, destination):  # Ctrl-C between moving the earlier export aside and the new one in
        if destination == out and source.name.startswith(".d.tmp-"):
            raise KeyboardInterrupt
        return rename(source, destination)

    monkeypatch.undo()
    rename = type(out).rename
    monkeypatch.setattr(type(out), "rename", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_drafter(drafter(cfg, seed=1), cfg, out)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_what_a_killed_export_left_is_cleared_by_the_next_one_never_a_live_ones(tmp_path):
    from dflash.export import is_export
    from dflash.locks import FileLock

    cfg = small_config()
    out = export_drafter(drafter(cfg, seed=0), cfg, tmp_path / "d")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # Killed between moving the earlier export aside and renaming the new one in: the next export puts it back
    # (and, without --force, refuses to replace it), dropping the partial folder.
    out.rename(tmp_path / ".d.old-4000001")
    (tmp_path / ".d.tmp-4000001").mkdir()
    (tmp_path / ".d.tmp-4000001" / "model.safetensors").write_bytes(b"cut short")
    with pytest.raises(DflashError, match="holds an earlier drafter export; pass --force"):
        export_drafter(drafter(cfg, seed=1), cfg, out, replace_export=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    # A live export of the same folder holds its lock: its temporary folder is left alone, the second one refused.
    (tmp_path / ".d.tmp-4000002").mkdir()
    with FileLock(tmp_path / ".d.export-lock", str, remove=True):
        with pytest.raises(DflashError, match="is being exported by process"):
            export_drafter(drafter(cfg, seed=1), cfg, out)
        assert (tmp_path / ".d.tmp-4000002").is_dir()
    export_drafter(drafter(cfg, seed=1), cfg, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"] and is_export(out)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_exported_files_follow_the_umask(umask, tmp_path):
    """A serving engine often runs as another user: model.safetensors (which safetensors creates 0600) must be as
    readable as config.json, both as the umask allows."""
    import os
    import stat

    from dflash.export import EXPORT_FILES

    cfg = small_config()
    previous = os.umask(umask)
    try:
        out = export_drafter(drafter(cfg), cfg, tmp_path / "d")
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes == {name: 0o666 & ~umask for name in EXPORT_FILES}


def _holds(folder, model) -> bool:
    """Whether the export in `folder` holds `model`'s weights."""
    loaded = load_drafter(folder)[0].state_dict()
    return all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_two_exports_into_one_new_folder_write_it_once_and_refuse_the_other(tmp_path, monkeypatch):
    """Issue 53: `dflash export A --out D & dflash export B --out D &`: one export writes D, the other is refused,
    also where the second checked D (still new) before the first wrote it and locks it after the first is done."""
    from dflash.locks import FileLock

    cfg = small_config()
    models = [drafter(cfg, seed=0), drafter(cfg, seed=1)]
    acquire = FileLock.acquire

    def first_export_meanwhile(lock):
        monkeypatch.setattr(FileLock, "acquire", acquire)
        export_drafter(models[0], cfg, tmp_path / "d", replace_export=False)
        return acquire(lock)

    monkeypatch.setattr(FileLock, "acquire", first_export_meanwhile)
    with pytest.raises(DflashError, match="holds an earlier drafter export; pass --force"):
        export_drafter(models[1], cfg, tmp_path / "d", replace_export=False)
    assert _holds(tmp_path / "d", models[0])

    for attempt in range(8):  # two threads let loose on one new folder: whichever wins, the other is refused
        folder = tmp_path / f"race{attempt}"
        outcomes = _race_exports(models, cfg, folder)
        assert outcomes.count("written") == 1, outcomes
        refusal = next(o for o in outcomes if o != "written")
        assert "is being exported by process" in refusal or "holds an earlier drafter export" in refusal, refusal
        assert _holds(folder, models[outcomes.index("written")])


def _race_exports(models, cfg, folder) -> list[str]:
    """Each model exported to `folder` by its own thread, started together: "written" or the refusal, per model."""
    import threading

    start, outcomes = threading.Barrier(len(models)), [""] * len(models)

    def export(i):
        start.wait()
        try:
            export_drafter(models[i], cfg, folder, replace_export=False)
            outcomes[i] = "written"
        except DflashError as exc:
            outcomes[i] = str(exc)

    threads = [threading.Thread(target=export, args=(i,)) for i in range(len(models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def test_export_cli_refuses_before_reading_the_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text('{"model_type": "qwen3"}')
    result = CliRunner().invoke(main, ["export", str(run), "--out", str(target)])
    assert result.exit_code == 2 and "not a dflash export (it holds config.json)" in result.output, result.output
    assert (target / "config.json").read_text() == '{"model_type": "qwen3"}'

    cfg = small_config()
    earlier = export_drafter(drafter(cfg), cfg, tmp_path / "earlier")
    result = CliRunner().invoke(main, ["export", str(run), "--out", str(earlier)])
    assert result.exit_code == 2 and "pass --force" in result.output, result.output
    # --force gets past the check (this run has no checkpoint to export), and the earlier export stays
    config = tmp_path / "export.toml"
    config.write_text(f'[export]\nout = "{earlier}"\nforce = true\n')
    result = CliRunner().invoke(main, ["export", str(run), "--config", str(config)])
    assert result.exit_code == 2 and "has no complete checkpoint" in result.output, result.output
    assert load_drafter(earlier)[1] == cfg


# ---------------------------------------------------------------------------------------------- AutoModel


@pytest.mark.parametrize(
    "overrides",
    [{}, {"num_key_value_heads": 4, "num_layers": 1, "block_size": 5}, {"head_dim": 8, "num_attention_heads": 8}],
)
def test_automodel_with_remote_code_loads_our_drafter(tmp_path, overrides):
    """transformers' AutoModel path gives the shipped modeling file's drafter: every tensor loaded, nothing left
    over, and the same outputs as dflash's own drafter (which this also checks the shipped forward against)."""
    from transformers import AutoModel

    cfg = small_config(**overrides)
    ours = drafter(cfg).float()
    folder = export_drafter(ours, cfg, tmp_path / "d", dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"

    model, info = AutoModel.from_pretrained(
        folder, trust_remote_code=True, output_loading_info=True, dtype=torch.float32
    )
    assert type(model).__name__ == "DFlashDraftModel"
    assert {k: v for k, v in info.items() if v} == {}, info  # no missing, unexpected or mismatched keys
    assert sorted(model.state_dict()) == cfg.checkpoint_keys()
    assert model.target_layer_ids == cfg.target_layer_ids and model.mask_token_id == cfg.mask_token_id
    assert model.block_size == cfg.block_size
    embeds, features, q_pos, ctx_pos, visible = inputs(cfg)
    with torch.no_grad():
        for mask in (None, visible):
            theirs = model(embeds, features, q_pos, ctx_pos, mask)
            torch.testing.assert_close(theirs, ours(embeds, features, q_pos, ctx_pos, mask), rtol=1e-5, atol=1e-5)

    loaded, loaded_cfg = load_drafter(folder)  # dflash's own strict load still takes the folder
    assert loaded_cfg == cfg


def test_shipped_modeling_file_is_self_contained():
    """It is loaded where dflash may not be installed: it imports torch and transformers only."""
    import ast
    from pathlib import Path

    import dflash

    tree = ast.parse((Path(dflash.__file__).parent / "export_modeling.py").read_text())
    modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert modules == {"torch", "transformers"}


def test_export_of_a_damaged_checkpoint_is_one_line(tmp_path):
    import dataclasses

    from dflash.train.checkpoint import Checkpointer

    step = Checkpointer(tmp_path / "run").path(5)
    step.mkdir(parents=True)
    (step / "state.json").write_text(json.dumps({"drafter": dataclasses.asdict(small_config())}))
    (step / "model.pt").write_bytes(b"cut")
    result = CliRunner().invoke(main, ["export", str(tmp_path / "run"), "--step", "5", "--out", str(tmp_path / "d")])
    assert result.exit_code == 2 and "is damaged or incomplete" in result.output, result.output
    assert not (tmp_path / "d").exists()
