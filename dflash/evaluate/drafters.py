"""The drafters an eval runs: their names in the report, the untrained baseline, and a folder's drafter checked
against the target before its weights are loaded."""

from pathlib import Path

import torch

from dflash.drafter import DFlashDrafter, DrafterConfig
from dflash.errors import DflashError
from dflash.export import load_drafter, read_drafter_config
from dflash.manifest import TargetIdentity, check_same_weights
from dflash.target import default_layer_ids
from dflash.target_files import MASK_TOKEN


def drafter_label(drafter) -> str:
    return str(drafter) if isinstance(drafter, (str, Path)) else "in-memory"


def drafter_names(drafters: list) -> dict:
    """{method name: drafter}: "dflash" for one trained drafter (the name readers of a report look up, whatever
    its method), "METHOD[FOLDER]" for each of several (its method's name: dflash, dflash2, dspark),
    "untrained-dflash" for the baseline."""
    several = sum(d != "untrained" for d in drafters) > 1
    named = {}
    for drafter in drafters:
        name = (
            "untrained-dflash"
            if drafter == "untrained"
            else f"{_method_of(drafter)}[{drafter_label(drafter)}]"
            if several
            else "dflash"
        )
        if name in named:
            raise DflashError(f"two drafters would both be reported as {name!r}; evaluate them in separate runs")
        named[name] = drafter
    return named


def _method_of(drafter) -> str:
    """The method of a drafter folder (from its config.json alone) or of a (model, config) pair."""
    return (drafter[1] if isinstance(drafter, tuple) else read_drafter_config(drafter)).method


def untrained_drafter(target, tokenizer, block_size: int = 16, seed: int = 0, mask_token_id: int | None = None):
    """A randomly initialised drafter shaped from the target's config: the baseline a trained one must beat."""
    if mask_token_id is None:
        mask_token_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
        if mask_token_id is None or mask_token_id == tokenizer.unk_token_id:
            raise DflashError(f"the target's tokenizer has no {MASK_TOKEN} token; pass a mask token id")
    depth = target.config.get_text_config(decoder=True).num_hidden_layers
    try:
        layer_ids = default_layer_ids(depth)
    except DflashError:
        raise DflashError(
            f"the target has {depth} layers, too few for an untrained drafter's 5 tapped layers by the DFlash rule "
            "(1 to L-3); evaluate a trained --drafter instead of --untrained"
        ) from None
    config = DrafterConfig.from_target_config(
        target.config,
        target_layer_ids=layer_ids,
        mask_token_id=mask_token_id,
        block_size=block_size,
    )
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config).to(device=target.device, dtype=target.dtype).eval()
    return drafter, config


def drafter_and_config(drafter, target, tokenizer, block_size: int, seed: int):
    """`drafter` is a folder, "untrained", or a (model, config) pair already in memory; checked against the target
    before its weights are loaded."""
    if drafter == "untrained":
        return untrained_drafter(target, tokenizer, block_size, seed)
    text = target.config.get_text_config(decoder=True)
    mask = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    mask = None if mask is None or mask == tokenizer.unk_token_id else mask
    if isinstance(drafter, tuple):
        check_drafter_fits(drafter[1], text, mask, "in-memory", str(target.name_or_path))
        return drafter
    check_drafter_fits(read_drafter_config(drafter), text, mask, str(drafter), str(target.name_or_path))
    model, config = load_drafter(drafter, target.device, target.dtype)
    return model.eval(), config


def check_drafter_fits(config: DrafterConfig, text_config, tokenizer_mask: int | None, drafter: str, target: str):
    """Refuse a drafter made for another target: width, vocabulary, depth, tapped layers and mask token are compared
    with the target's config (a dict or a transformers config) and the id of its tokenizer's <|MASK|> token (None:
    the tokenizer has none, or is not loaded yet). The mask id is checked against the embedding's rows, not the
    tokenizer's length: the public Qwen3 drafters use a row past the stock tokenizer's last token (151669)."""

    def get(name):
        return text_config.get(name) if isinstance(text_config, dict) else getattr(text_config, name, None)

    depth = get("num_hidden_layers")
    differences = [
        f"{name}: drafter {mine}, target {theirs}"
        for name, mine, theirs in (
            ("hidden_size", config.hidden_size, get("hidden_size")),
            ("vocab_size", config.vocab_size, get("vocab_size")),
            ("num_target_layers", config.num_target_layers, depth),
        )
        if mine is not None and theirs is not None and mine != theirs
    ]
    if depth is not None and any(not 0 <= i < depth for i in config.target_layer_ids):
        differences.append(f"target_layer_ids: drafter {config.target_layer_ids}, target layers 0..{depth - 1}")
    vocabulary = min(v for v in (get("vocab_size"), config.vocab_size) if v is not None)
    if not 0 <= config.mask_token_id < vocabulary:
        differences.append(f"mask_token_id: drafter {config.mask_token_id}, target vocabulary 0..{vocabulary - 1}")
    elif tokenizer_mask is not None and tokenizer_mask != config.mask_token_id:
        differences.append(
            f"mask_token_id: drafter {config.mask_token_id}, target tokenizer's {MASK_TOKEN} {tokenizer_mask}"
        )
    if differences:
        raise DflashError(
            f"the drafter {drafter} was not made for the target {target} ({'; '.join(differences)}); "
            "pass --drafter a drafter trained on this target's features, or --model the target it was trained for"
        )


def check_trained_for(config: DrafterConfig, target: TargetIdentity, drafter: str, model: str, allowed: bool) -> None:
    """Refuse a drafter whose export names a target of other weights than --model's (`target`): a fine-tune of the
    same shape passes `check_drafter_fits`, and the eval would measure the drafter on a model it was not trained
    for. `allowed`: --allow-other-target-weights."""
    check_same_weights(
        target,
        TargetIdentity.from_record(config.target_identity),
        f"the weights of the target the drafter {drafter} was trained for and of --model {model}",
        "its acceptance would be measured on a model it was not trained for; pass --model that target",
        "--allow-other-target-weights",
        allowed,
    )
