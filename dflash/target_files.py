"""The target checkpoint's files read directly: its config, the config's hash, and two tensors.

Training reads the embedding and LM head from here without loading the model, so this module imports no
transformers modeling code (transformers' config and file lookup are imported only where they are called).
"""

import hashlib
import json
import os
from pathlib import Path

import torch

from dflash.errors import DflashError

MASK_TOKEN = "<|MASK|>"  # the token of the target's vocabulary that fills a drafter block after its first slot
EMBEDDING_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight")
HEAD_KEYS = ("lm_head.weight", "model.lm_head.weight")


def load_embedding_and_head(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embed_tokens [V, H] and lm_head [V, H] weights, read alone from its safetensors files."""
    file_of = tensor_files(path)
    embed_key, head_key = _embedding_and_head_keys(path, file_of)
    tensors = _read_tensors(path, file_of, {embed_key, head_key})
    return tensors[embed_key], tensors[head_key]


def load_head(path: str) -> torch.Tensor:
    """The target's lm_head [V, H] weight alone (the embedding for a tied checkpoint)."""
    file_of = tensor_files(path)
    head_key = _embedding_and_head_keys(path, file_of)[1]
    return _read_tensors(path, file_of, {head_key})[head_key]


def _embedding_and_head_keys(path: str, file_of: dict[str, str]) -> tuple[str, str]:
    embed_key = _find_key(file_of, EMBEDDING_KEYS, "embed_tokens.weight", path)
    return embed_key, embed_key if _tied(path) else _find_key(file_of, HEAD_KEYS, "lm_head.weight", path)


def _read_tensors(path: str, file_of: dict[str, str], keys: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors = {}
    for key in keys:
        with safe_open(checkpoint_file(path, file_of[key]), framework="pt") as shard:
            tensors[key] = shard.get_tensor(key)
    return tensors


def _tied(path: str) -> bool:
    """Whether the LM head is the embedding. Tying is a property of the whole checkpoint, so the top-level config
    decides (not a VL text_config); transformers' config class gives the default when config.json leaves it out."""
    config = read_config_json(path)
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return bool(getattr(load_config(path, "--target"), "tie_word_embeddings", False))


def tensor_files(path: str) -> dict[str, str]:
    """Tensor name -> the checkpoint file (name within the checkpoint) that holds it."""
    from safetensors import safe_open

    index = checkpoint_file(path, "model.safetensors.index.json")
    if index is not None:
        return json.loads(Path(index).read_text())["weight_map"]
    single = checkpoint_file(path, "model.safetensors")
    if single is None:
        raise DflashError(
            f"{path} holds no model.safetensors nor model.safetensors.index.json; save the target as safetensors"
        )
    with safe_open(single, framework="pt") as shard:
        return dict.fromkeys(shard.keys(), "model.safetensors")


def _find_key(file_of: dict[str, str], preferred: tuple[str, ...], suffix: str, path: str) -> str:
    """The first preferred name present, else the one text-model tensor whose name ends with `suffix`."""
    for key in preferred:
        if key in file_of:
            return key
    candidates = [
        k for k in file_of if k.endswith(suffix) and not any(part in k for part in ("mtp", "visual", "vision"))
    ]
    if len(candidates) == 1:
        return candidates[0]
    found = f"candidates {candidates}" if candidates else "no tensor of that name"
    raise DflashError(
        f"cannot find the target's {suffix} in {path} ({found}); is this a complete causal-LM checkpoint?"
    )


def load_config(path: str, flag: str = "--model"):
    """The checkpoint's transformers config; `flag` names the option that takes the checkpoint, for the error."""
    from transformers import AutoConfig

    if Path(path).expanduser().exists() or not _hub_name(path):
        check_target_folder(path, flag)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise DflashError(
            f"cannot load a model config from {path}: {exc}; pass {flag} a transformers checkpoint folder"
        ) from exc


def _hub_name(path: str) -> bool:
    """`org/name` that is no local path: transformers would look it up on the hub."""
    return not (Path(path).is_absolute() or path.startswith((".", "~"))) and path.count("/") == 1


def check_target_folder(path, flag: str = "--model") -> dict:
    """A one-line error for a --model that is not a complete local checkpoint folder; returns its config.json.

    Checked before transformers loads it, which would otherwise take a missing folder for a hub repo id, say only
    "Should have a model_type key", or initialise missing weights at random."""
    from safetensors import safe_open

    folder = Path(path)
    fix = f"pass {flag} the target's checkpoint folder (config.json, tokenizer and *.safetensors)"
    if not folder.exists():
        raise DflashError(f"{flag} {folder} does not exist; {fix}")
    if not folder.is_dir():
        raise DflashError(f"{flag} {folder} is a file, not a folder; {fix}")
    if not (folder / "config.json").is_file():
        raise DflashError(f"{flag} {folder} has no config.json, so it is not a model folder; {fix}")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise DflashError(f"{folder / 'config.json'} is not readable JSON ({exc}); {fix}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise DflashError(f"{folder / 'config.json'} names no model_type, so it is no transformers model; {fix}")
    if "DFlashDraftModel" in (config.get("architectures") or []):
        raise DflashError(f"{flag} {folder} is a DFlash drafter, not a target; pass it as --drafter and {fix}")
    index = folder / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DflashError(f"{index} is damaged ({type(exc).__name__}: {exc}); copy the checkpoint again") from None
    if files is None:
        if not (folder / "model.safetensors").is_file():
            raise DflashError(f"{flag} {folder} holds no model.safetensors (nor an index of shards); {fix}")
        files = ["model.safetensors"]
    names = []
    for name in files:
        try:
            with safe_open(folder / name, framework="pt") as shard:
                names += list(shard.keys())
        except Exception as exc:  # SafetensorError for a damaged or truncated file, OSError for a missing one
            raise DflashError(
                f"{folder / name} is missing, damaged or cut short ({exc}); copy the checkpoint again"
            ) from None
    if not any(name.endswith("embed_tokens.weight") for name in names):
        raise DflashError(
            f"the weights of {flag} {folder} hold no embed_tokens: not a causal-LM checkpoint, it would load with "
            f"random weights; {fix}"
        )
    return config


def read_config_json(path: str) -> dict:
    """The checkpoint's config.json as it is on disk."""
    file = checkpoint_file(path, "config.json")
    if file is None:
        raise DflashError(f"{path} holds no config.json; pass a transformers checkpoint folder")
    return json.loads(Path(file).read_text())


def config_hash(path: str) -> str:
    """sha256 of config.json, canonical (sorted keys, no whitespace)."""
    config = read_config_json(path)
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# The weights' fingerprint (`weights_sha256`): per checkpoint file, its name, its size and the sha256 of
# WEIGHT_SAMPLES samples of WEIGHT_SAMPLE_BYTES at fixed offsets (the first at 0, which holds the safetensors
# header: every tensor's name, dtype, shape and offsets; the last ending at the file's end; the rest evenly
# between). It reads 8 MiB of each file, whatever its size: the cost measured in docs/shard-format.md.
WEIGHT_SAMPLES = 32
WEIGHT_SAMPLE_BYTES = 256 << 10


def weight_files(path: str) -> list[str]:
    """The checkpoint's weight files (names within the checkpoint), sorted."""
    index = checkpoint_file(path, "model.safetensors.index.json")
    if index is not None:
        return sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
    return ["model.safetensors"]


def file_sample_sha256(file: str | Path) -> tuple[int, str]:
    """(size, sha256 of the size and of WEIGHT_SAMPLES fixed-offset samples) of one file."""
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(size.to_bytes(8, "little"))
        last = max(0, size - WEIGHT_SAMPLE_BYTES)
        for offset in sorted({last * i // (WEIGHT_SAMPLES - 1) for i in range(WEIGHT_SAMPLES)}):
            f.seek(offset)
            digest.update(f.read(WEIGHT_SAMPLE_BYTES))
    return size, digest.hexdigest()


def weights_sha256(path: str) -> str:
    """A cheap content fingerprint of the target's weights: sha256 over each weight file's name, size and
    `file_sample_sha256` (8 MiB read per file). Weights rewritten in place under the same config.json change it."""
    entries = []
    for name in weight_files(path):
        file = checkpoint_file(path, name)
        if file is None:
            raise DflashError(f"{path} lists the weight file {name}, which is missing; copy the checkpoint again")
        size, sampled = file_sample_sha256(file)
        entries.append([name, size, sampled])
    return hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()


def checkpoint_file(path: str, filename: str) -> str | None:
    """Local path of a checkpoint file (downloaded when `path` is a hub name), None when there is none."""
    from transformers.utils import cached_file

    try:
        return cached_file(path, filename, _raise_exceptions_for_missing_entries=False)
    except OSError as exc:
        raise DflashError(
            f"cannot read {filename} of {path}: {exc}; pass --model a transformers checkpoint folder"
        ) from exc
