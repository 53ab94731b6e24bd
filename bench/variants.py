"""The drafter methods and loss options the benchmarks compare (issue 23), by name: TrainConfig overrides.

"dflash" is the paper's drafter with its decayed loss, every other variant's reference (named in full: the trainer's
default method is DFlash 2)."""

METHOD_VARIANTS = {
    "dflash": {"method": "dflash"},
    "dpace": {"method": "dflash", "position_weights": "dpace"},
    "dflash2": {"method": "dflash2"},
    "dflash2-dpace": {"method": "dflash2", "position_weights": "dpace"},
    "dflash2-drop": {"method": "dflash2", "selector_outside": "drop"},
    "dflash2-b8": {"method": "dflash2", "block_size": 8},
}


def parse_variants(text: str) -> list[str]:
    """`dflash,dflash2,...` -> the names, each known and given once (ValueError naming the choices otherwise)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in METHOD_VARIANTS]
    if unknown or len(set(names)) != len(names) or not names:
        raise ValueError(f"{text!r}: give distinct names out of {', '.join(METHOD_VARIANTS)}")
    return names
