"""The drafter methods and loss options the benchmarks compare (issue 23), by name: TrainConfig overrides.

"dflash" is the paper's drafter with its decayed loss, every other variant's reference (named in full: the trainer's
default method is DFlash 2)."""

import re

METHOD_VARIANTS = {
    "dflash": {"method": "dflash"},
    "dpace": {"method": "dflash", "position_weights": "dpace"},
    "dflash2": {"method": "dflash2"},
    "dflash2-dpace": {"method": "dflash2", "position_weights": "dpace"},
    "dflash2-drop": {"method": "dflash2", "selector_outside": "drop"},
    "dflash2-b8": {"method": "dflash2", "block_size": 8},
    # DFlash 2 with full attention over the context (its default slides over 2048 positions); any window is a
    # `-windowN` suffix (DRAFTER_OPTION_SUFFIX).
    "dflash2-full": {"method": "dflash2", "drafter_overrides": {"sliding_window": None}},
    # Memory for time (issue 24, TrainConfig.recompute): each layer's MLP run again in the backward, or only its
    # element-wise work.
    "dflash-recompute": {"method": "dflash", "recompute": "mlp"},
    "dflash-pointwise": {"method": "dflash", "recompute": "pointwise"},
    "dflash2-pointwise": {"method": "dflash2", "recompute": "pointwise"},
    # Where the token embeddings are looked up (TrainConfig.embedding; auto ships them from the host at the
    # benchmarks' rows): the table kept on the device, for the comparison; pointwise with a loss chunk of 1024 rows.
    "dflash-pointwise-device-embedding": {"method": "dflash", "recompute": "pointwise", "embedding": "device"},
    "dflash-pointwise-chunk1024": {"method": "dflash", "recompute": "pointwise", "loss_chunk": 1024},
    # DSpark trains from a store harvested with a teacher (the `teacher` key: the harvest's --teacher)
    "dspark-topk": {"method": "dspark", "teacher": "topk:32"},
    "dspark-hidden": {"method": "dspark", "teacher": "hidden"},
    "dspark-b16": {"method": "dspark", "teacher": "topk:32", "block_size": 16},
    # DFlash 2 against the target's distribution (issue 52): the same top-K teacher store, TrainConfig.teacher_loss
    # auto; with 64 candidates the K-way draft can reach more of a flat distribution's mass
    "dflash2-distill": {"method": "dflash2", "teacher": "topk:32"},
    "dflash2-distill-k64": {"method": "dflash2", "teacher": "topk:32", "drafter_overrides": {"selector_top_k": 64}},
}


# A drafter option on top of any variant above, as a suffix (`dflash-window2048`, `dflash-pointwise-hd128`): the
# sliding window over the context (issue 24; the quality run's documents are ~250-400 tokens, so only windows below
# that cut them there; long rows time the 2048 of DFlash 2's released configs), or the drafter's attention at another
# head dim with the target's attention widths kept (heads scaled: flex_attention's kernels at 128 against 256).
DRAFTER_OPTION_SUFFIX = re.compile(r"(.+)-(window|hd)([1-9][0-9]*)")
DRAFTER_OPTIONS = {"window": "sliding_window", "hd": "head_dim"}
VARIANT_CHOICES = (
    f"{', '.join(METHOD_VARIANTS)}, each optionally followed by -windowN (a sliding window of N tokens) or -hdN "
    "(head_dim N, the target's attention widths kept)"
)


def _base_and_option(name: str) -> tuple[str, dict]:
    """`dflash-pointwise-hd128` -> ("dflash-pointwise", {"head_dim": 128}); a plain variant -> (name, {})."""
    match = DRAFTER_OPTION_SUFFIX.fullmatch(name)
    if match and match[1] in METHOD_VARIANTS:
        return match[1], {DRAFTER_OPTIONS[match[2]]: int(match[3])}
    return name, {}


def is_variant(name: str) -> bool:
    return _base_and_option(name)[0] in METHOD_VARIANTS


def split_variant(name: str) -> tuple[dict, str | None]:
    """(the TrainConfig options of variant `name`, the --teacher its store needs, or None)."""
    base, drafter_option = _base_and_option(name)
    options = dict(METHOD_VARIANTS[base])
    if drafter_option:
        options["drafter_overrides"] = {**options.get("drafter_overrides", {}), **drafter_option}
    return options, options.pop("teacher", None)


def parse_variants(text: str) -> list[str]:
    """`dflash,dflash2,...` -> the names, each known and given once (ValueError naming the choices otherwise)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if not is_variant(n)]
    if unknown or len(set(names)) != len(names) or not names:
        raise ValueError(f"{text!r}: give distinct names out of {VARIANT_CHOICES}")
    return names
