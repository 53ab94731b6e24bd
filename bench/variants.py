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
    # DFlash 2 with full attention over the context (its default slides over 2048 positions); any window is
    # `dflash-windowN` or `dflash2-windowN` (WINDOW_VARIANT).
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
}


# The sliding window over the context (issue 24), of any width: the quality run's documents are ~250-400 tokens, so
# only windows below that cut them there; long rows time the 2048 of DFlash 2's released configs.
WINDOW_VARIANT = re.compile(r"(dflash2?)-window([1-9][0-9]*)")
# The drafter's attention at another head dim, the target's attention widths kept (heads scaled): flex_attention's
# kernels at 128 against 256, the long rows' bound (issue 24).
HEAD_DIM_VARIANT = re.compile(r"(dflash2?)-hd([1-9][0-9]*)")
VARIANT_CHOICES = (
    f"{', '.join(METHOD_VARIANTS)}, dflash-windowN, dflash2-windowN (a sliding window of N tokens), dflash-hdN, "
    "dflash2-hdN (head_dim N, the target's attention widths kept)"
)
DRAFTER_OPTION_VARIANTS = {WINDOW_VARIANT: "sliding_window", HEAD_DIM_VARIANT: "head_dim"}


def is_variant(name: str) -> bool:
    return name in METHOD_VARIANTS or any(pattern.fullmatch(name) for pattern in DRAFTER_OPTION_VARIANTS)


def split_variant(name: str) -> tuple[dict, str | None]:
    """(the TrainConfig options of variant `name`, the --teacher its store needs, or None)."""
    for pattern, option in DRAFTER_OPTION_VARIANTS.items():
        match = pattern.fullmatch(name)
        if match:
            return {"method": match[1], "drafter_overrides": {option: int(match[2])}}, None
    options = dict(METHOD_VARIANTS[name])
    return options, options.pop("teacher", None)


def parse_variants(text: str) -> list[str]:
    """`dflash,dflash2,...` -> the names, each known and given once (ValueError naming the choices otherwise)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if not is_variant(n)]
    if unknown or len(set(names)) != len(names) or not names:
        raise ValueError(f"{text!r}: give distinct names out of {VARIANT_CHOICES}")
    return names
