"""harvest.json's content that the target and the data decide: the target's and tokenizer's records and the
data source of each document."""

import logging
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from dflash import __version__, manifest, store
from dflash.config import HarvestConfig
from dflash.data import Document, load_tokenizer
from dflash.drafter import rope_theta_of
from dflash.errors import DflashError
from dflash.harvest.options import feature_encoding
from dflash.target import TappedTarget
from dflash.target_files import MASK_TOKEN, load_config

logger = logging.getLogger("dflash")


def _tokenizer_spec(model: str) -> manifest.TokenizerSpec:
    tokenizer = load_tokenizer(model)
    vocab = tokenizer.get_vocab()
    mask_id = vocab.get(MASK_TOKEN)
    if mask_id is None:
        logger.warning("the tokenizer of %s has no %s token; the drafter will need a mask token id", model, MASK_TOKEN)
    special = {name: getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "pad", "unk")}
    return manifest.TokenizerSpec(model, len(tokenizer), {**special, "mask": mask_id})


def target_spec(model: str, target: TappedTarget) -> manifest.TargetSpec:
    """The target as the manifest records it: identity plus the text-model fields the drafter is shaped from."""
    config = load_config(model)
    text = config.get_text_config()
    return manifest.TargetSpec(
        **asdict(target.info),
        intermediate_size=getattr(text, "intermediate_size", None),
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None),
        head_dim=getattr(text, "head_dim", None),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
        rope_theta=rope_theta_of(text),
        max_position_embeddings=text.max_position_embeddings,
        tie_word_embeddings=bool(
            getattr(config, "tie_word_embeddings", False)
        ),  # the checkpoint's, not a VL text part's
    )


def document_sources(documents: list[Document], doc_ids: int) -> np.ndarray:
    """int16 [doc_ids]: the data source of each doc id, -1 for a record of the mixture that gave no document."""
    sources = np.full(doc_ids, -1, np.int16)
    sources[[d.doc_id for d in documents]] = [d.source for d in documents]
    return sources


def harvest_header(cfg: HarvestConfig, fingerprint: dict, target: TappedTarget, stats, teacher) -> manifest.Manifest:
    """harvest.json: everything the manifest states that no part's progress decides."""
    # How the processes were laid out, and the kernels, do not decide the content: a store may be resumed with
    # another layout.
    launch = ("rank", "device", "tensor_parallel", "expert_parallel", "experts")
    options = {k: v for k, v in asdict(cfg).items() if k not in launch}
    if teacher is None:
        del options["teacher"]  # a store without a teacher records what it did before the option existed
    header = store.new_manifest(
        target=target_spec(cfg.model, target),
        layer_ids=target.layer_ids,
        token_budget=cfg.token_budget,
        tokenizer=_tokenizer_spec(cfg.model),
        fingerprint=fingerprint,
        features=feature_encoding(cfg, len(target.layer_ids), len(target.layer_ids) * target.info.hidden_size),
        options=options,
        data={
            "file": ", ".join(Path(spec).name for spec in cfg.data),
            **{key: fingerprint[key] for key in ("data_bytes", "data_sha256")},
            "stats": {k: v for k, v in asdict(stats).items() if k != "sources"},
        },
        dflash_version=__version__,
        teacher=teacher,
    )
    return replace(header, sources=tuple(stats.sources))


def restore_harvest_file(out: Path) -> None:
    """Rebuild the harvest.json of a store that lost it: a complete store's manifest.json holds its contents (plus
    the identity, counts and parts the finishing step added), and each part records the digest of the header its
    rows were written under, which the rebuilt one must match. A store with no manifest.json is refused naming
    the fix, not called "not a dflash store"."""
    if (out / store.HARVEST_FILE).exists() or not (out / "parts").is_dir():
        return
    lost = f"{out / store.HARVEST_FILE} is missing"
    fix = "restore harvest.json from a copy of the store, or harvest into a new --out folder"
    recorded = store.read_manifest(out / store.MANIFEST_FILE)
    if recorded is None:
        if any((out / "parts").glob(f"*/{store.PROGRESS_FILE}")):
            raise DflashError(
                f"{lost} and the store is not complete (no {store.MANIFEST_FILE} to rebuild it from); {fix}"
            )
        return  # parts holding only locks: a harvest stopped before its first write, which starts again
    header = replace(recorded.header(), identity="")  # the finishing step sets the identity: harvest.json has none
    written_under = {p.get("header_sha256") for p in store.part_progress(out, recorded.world_size) if p is not None}
    if written_under - {None, store.header_sha256(header)}:
        raise DflashError(
            f"{lost} and {store.MANIFEST_FILE} is not the header the store's parts were written under; {fix}"
        )
    if store.write_json_exclusive(out / store.HARVEST_FILE, header.to_json()):  # (of ranks racing, one writes it)
        logger.warning("%s: rebuilt it from %s", lost, store.MANIFEST_FILE)
