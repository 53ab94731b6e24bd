"""Drafter folders: export in the layout the engines load (config.json, model.safetensors, our modeling file), and
loading them back, for every drafter method (dflash.methods dispatches on config.json's `architectures`).

The export's own modeling file (dflash/export_modeling.py, copied as modeling_dflash.py, named by `auto_map`) makes
`AutoModel.from_pretrained(folder, trust_remote_code=True)` give the drafter without dflash installed.
"""

import glob
import json
from pathlib import Path

import torch
from torch import Tensor

from dflash import methods
from dflash.drafter import DFlashDrafter, DrafterConfig
from dflash.errors import DflashError, check_not_foreign
from dflash.locks import FileLock


def fold_projection(state: dict, config: DrafterConfig, projection: Tensor) -> dict:
    """The weights of a drafter trained on a subspace store for full features: it saw the lifted features
    P^T (P h) in training, so fc <- fc P^T P (a float64 product) gives it the same input from h."""
    if projection.ndim != 2 or projection.shape[1] != config.feature_dim:
        raise DflashError(
            f"the projection is {tuple(projection.shape)} but the drafter fuses {config.feature_dim} features; "
            "export with the store the drafter was trained on"
        )
    fc, p = state["fc.weight"], projection.to(state["fc.weight"].device, torch.float64)
    folded = ((fc.double() @ p.T) @ p).to(fc.dtype)
    return {**state, "fc.weight": folded}


EXPORT_MODELING = "modeling_dflash.py"  # dflash/export_modeling.py, copied: AutoModel(trust_remote_code) loads it
EXPORT_FILES = ("config.json", "model.safetensors", EXPORT_MODELING)
# The target's embedding and LM head under the names of DeepSpec's Qwen3DSparkModel, which owns both and whose
# evaluator never copies the target's into it: written only on request (`target_embeddings`), ignored on load.
TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight")


def is_export(folder) -> bool:
    """Whether `folder` holds an earlier dflash export (a DFlash config.json and nothing but the export's files)."""
    folder = Path(folder)
    try:
        names = {p.name for p in folder.iterdir()}
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        names <= {*EXPORT_FILES, "__pycache__"}
        and isinstance(config, dict)
        and methods.of_architectures(config.get("architectures")) is not None
    )


def check_export_target(folder, replace_export: bool, force_flag: str = "--force") -> Path:
    """Refuse to export into `folder` unless it is absent, empty, or (with `replace_export`) an earlier export."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise DflashError(f"{folder} is a file, not a folder; give --out a new folder for the drafter")
    try:
        if not folder.is_dir() or not any(folder.iterdir()):
            return folder
    except OSError as exc:
        raise DflashError(f"cannot read {folder} ({exc.strerror}); give --out a folder you can write") from None
    fix = "give --out a new or empty folder: an export never overwrites other files"
    check_not_foreign(folder, is_export, "a dflash export", fix)
    if not replace_export:
        raise DflashError(f"{folder} holds an earlier drafter export; pass {force_flag} to replace it")
    return folder


def export_drafter(
    model,
    config: DrafterConfig,
    folder,
    dtype: torch.dtype | None = None,
    projection: Tensor | None = None,
    replace_export: bool = True,
    target_embeddings: tuple[Tensor, Tensor] | None = None,
) -> Path:
    """Write `config.json` + `model.safetensors` in the public layout, plus `modeling_dflash.py` and an `auto_map`
    so that `AutoModel.from_pretrained(folder, trust_remote_code=True)` gives the drafter; returns the folder.

    model: the drafter (compiled or not) or a full state dict (e.g. gathered from FSDP).
    dtype: the saved dtype; None keeps the parameters' dtype, which makes a reload reproduce outputs exactly.
    projection: P [k, n*H] of the subspace store it was trained on, folded into fc (`fold_projection`).
    replace_export: whether an earlier dflash export in `folder` may be replaced. A folder holding anything else is
    always refused. The files are written into a temporary sibling folder that is renamed into place, so that an
    interruption leaves either the earlier folder or the whole new export, never half of one.
    target_embeddings: the target's (embed_tokens, lm_head) weights [V, H], written too as `TARGET_TENSORS` (for
    DeepSpec's evaluator; `read_target_embeddings`). None: the drafter's tensors only, as every engine else reads.
    """
    folder = check_export_target(folder, replace_export)
    state = model if isinstance(model, dict) else getattr(model, "_orig_mod", model).state_dict()
    if projection is not None:
        state = fold_projection(state, config, projection)
    expected = config.checkpoint_keys()
    if sorted(state) != expected:
        extra, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
        raise DflashError(
            f"the drafter's weights do not match the {config.architecture} layout (unexpected {extra[:5]}, missing {missing[:5]}); "
            "pass the bare drafter or its full state dict, not a DDP/FSDP wrapper"
        )
    saved_dtype = dtype or next(iter(state.values())).dtype
    if target_embeddings is not None:
        state = {**state, **dict(zip(TARGET_TENSORS, _checked_embeddings(target_embeddings, config)))}
    tensors = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in state.items()}
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DflashError(f"cannot create {folder.parent} ({exc.strerror}); give --out a writable folder") from None
    with FileLock(folder.parent / f".{folder.name}.export-lock", lambda holder: _busy(folder, holder), remove=True):
        _recover_killed_export(folder)
        # Checked again under the lock: another export may have written the folder since the check above, or a
        # killed one's earlier export may be back in place.
        check_export_target(folder, replace_export)
        _write_export(tensors, config, saved_dtype, folder)
    return folder


def _checked_embeddings(weights: tuple[Tensor, Tensor], config: DrafterConfig) -> tuple[Tensor, Tensor]:
    want = (config.vocab_size, config.hidden_size)
    for name, w in zip(("embedding", "LM head"), weights):
        if tuple(w.shape) != want:
            raise DflashError(
                f"the target's {name} is {tuple(w.shape)}, the drafter's target has {want} (vocabulary, hidden size); "
                "give the target checkpoint the drafter was trained with"
            )
    return weights


def read_target_embeddings(path: str, config: DrafterConfig) -> tuple[Tensor, Tensor]:
    """The embedding and LM head of the target checkpoint `path`, for an export that carries them: refused when
    the export names a target of other weights (`dflash_target`), whose embedding the drafter was not trained with."""
    from dflash.manifest import TargetIdentity, check_same_weights
    from dflash.target_files import load_embedding_and_head

    check_same_weights(
        TargetIdentity.from_record(config.target_identity),
        TargetIdentity.of_checkpoint(path),
        f"the weights of the target the drafter was trained with and of {path}",
        f"{path} holds other weights, whose embedding and LM head are not the drafter's; pass --target that checkpoint",
    )
    return load_embedding_and_head(path)


def _busy(folder: Path, holder: str) -> str:
    return f"{folder} is being exported by {holder}; wait for it to finish or export to another folder"


def _recover_killed_export(folder: Path) -> None:
    """Clear what an export of `folder` killed mid-way left beside it (its lock held: no live export's): a partial
    `.NAME.tmp-PID` is removed; an earlier export moved aside as `.NAME.old-PID` is put back if the new one never
    took its place, removed otherwise."""
    import shutil

    for leftover in sorted(folder.parent.glob(f".{glob.escape(folder.name)}.old-*")):
        if not folder.exists() and is_export(leftover):
            leftover.rename(folder)
        else:
            shutil.rmtree(leftover, ignore_errors=True)
    for leftover in folder.parent.glob(f".{glob.escape(folder.name)}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _write_export(tensors: dict, config: DrafterConfig, saved_dtype: torch.dtype, folder: Path) -> None:
    """Write the export into a temporary sibling folder, then rename it into place (an earlier one moved aside)."""
    import os
    import shutil
    import stat

    from safetensors.torch import save_file

    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    old = folder.parent / f".{folder.name}.old-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        auto_map = {"AutoModel": f"{EXPORT_MODELING.removesuffix('.py')}.{config.architecture}"}
        hf_config = {**config.to_hf_config(saved_dtype), "auto_map": auto_map}
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        # safetensors creates its file 0600: an engine serving as another user must read it as it reads
        # config.json, which open() created as the umask allows
        os.chmod(tmp / "model.safetensors", stat.S_IMODE((tmp / "config.json").stat().st_mode))
        shutil.copyfile(Path(__file__).with_name("export_modeling.py"), tmp / EXPORT_MODELING)
        if folder.exists():  # empty, or an earlier export (checked above): moved aside, removed once replaced
            folder.rename(old)
        tmp.rename(folder)
    except BaseException as exc:  # a full disk, or Ctrl-C: put the earlier folder back, drop the partial one
        if old.exists() and not folder.exists():
            old.rename(folder)
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, Exception) or isinstance(exc, DflashError):  # Ctrl-C, or already worded
            raise
        # OSError, or safetensors' SafetensorError wrapping one
        reason = getattr(exc, "strerror", None) or str(exc)
        raise DflashError(
            f"cannot write the drafter to {folder} ({reason}); give --out a writable folder with free space"
        ) from None
    shutil.rmtree(old, ignore_errors=True)


def read_drafter_config(folder) -> DrafterConfig:
    """The DrafterConfig of an exported (or public) drafter folder, without reading its weights."""
    folder = Path(folder)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise DflashError(f"{folder} is not a drafter folder: it needs config.json and model.safetensors")
    try:
        config = json.loads((folder / "config.json").read_text())
        return methods.config_class(config).from_hf_config(config)
    except DflashError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DflashError(
            f"{folder / 'config.json'} is not a DFlash drafter config ({type(exc).__name__}: {exc}); "
            "export the drafter again with `dflash export`"
        ) from None


def load_drafter(folder, device="cpu", dtype: torch.dtype | None = None) -> tuple[DFlashDrafter, DrafterConfig]:
    """Load an exported (or public) drafter of any method; dtype None keeps the file's dtype. The target's tensors
    an export may carry (`TARGET_TENSORS`) are not read: dflash applies the target's own."""
    from safetensors import safe_open

    folder = Path(folder)
    config = read_drafter_config(folder)
    try:
        with safe_open(folder / "model.safetensors", framework="pt", device=str(device)) as f:
            state = {key: f.get_tensor(key) for key in f.keys() if key not in TARGET_TENSORS}
    except Exception as exc:  # safetensors raises its own SafetensorError for damaged files, OSError for I/O
        raise DflashError(
            f"cannot read {folder / 'model.safetensors'}: it is damaged or cut short ({exc}); export the drafter again"
        ) from None
    expected = config.checkpoint_keys()
    if sorted(state) != expected:
        extra, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
        raise DflashError(
            f"{folder / 'model.safetensors'} does not match its config.json (unexpected {extra[:5]}, missing "
            f"{missing[:5]}); export the drafter again"
        )
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    with torch.device("meta"):  # no random init of weights that are overwritten right away
        model = methods.model_for(config)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:  # a shape that does not match the config
        raise DflashError(
            f"{folder / 'model.safetensors'} does not match its config.json ({str(exc).splitlines()[-1].strip()}); "
            "export the drafter again"
        ) from None
    return model, config
