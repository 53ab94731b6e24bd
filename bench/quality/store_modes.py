"""The variants of the drafter run that `--modes` names, a store encoding (issue 16) or a drafter method on the bf16
store (issue 23), and where each keeps its stores and drafter in the work folder."""

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from bench.variants import VARIANT_CHOICES, is_variant, split_variant

logger = logging.getLogger("quality")


MODES = "modes"  # WORK/modes/FOLDER: a store mode's stores and drafter run


@dataclass(frozen=True)
class StoreMode:
    """A variant of the drafter run, as `--modes` names it: a feature encoding of the store (issue 16) with its
    harvest options, or a drafter method on the bf16 store (issue 23) with its training options."""

    name: str
    precision: str = "bf16"
    subspace: str = "none"  # HarvestConfig.subspace: K or a fraction of the feature width ("1/4")
    train: tuple = ()  # TrainConfig overrides, (field, value) pairs
    teacher: str | None = None  # HarvestConfig.teacher of the method's stores (DSpark)

    def __post_init__(self):  # read back from JSON: lists of lists
        object.__setattr__(self, "train", tuple(tuple(pair) for pair in self.train))

    def __hash__(self):  # not of `train`, whose values may be dicts (drafter_overrides)
        return hash((self.name, self.precision, self.subspace, self.teacher))

    @property
    def store_key(self) -> tuple:
        """What its stores are made of: modes with the same key can share them."""
        return (self.precision, self.subspace, self.teacher)

    @property
    def on_bf16_store(self) -> bool:
        """A method variant trains on the bf16 run's own stores: nothing to harvest."""
        return (self.precision, self.subspace, self.teacher) == ("bf16", "none", None)

    @property
    def folder(self) -> str:
        return self.name.replace("/", "_")

    @property
    def method(self) -> str:
        """Its drafter's name in the eval report (bf16's keeps the name the bar reads)."""
        return "dflash" if self == BF16 else f"dflash[{self.name}]"


BF16 = StoreMode("bf16")


def parse_modes(text: str) -> list[StoreMode]:
    """`--modes`: store modes besides bf16, comma-separated: `fp8` (e4m3 values), `subK` or `subA/B` (the top K
    directions, or A/B of the feature width), each subspace optionally `+fp8`."""
    modes = []
    for name in (part.strip() for part in text.split(",")):
        if not name:
            continue
        if is_variant(name) and name != "dflash":  # the bf16 run itself is DFlash's (train_drafter)
            options, teacher = split_variant(name)
            mode = StoreMode(name, train=tuple(options.items()), teacher=teacher)
            if mode in modes:
                raise ValueError(f"--modes: {name} is given twice")
            modes.append(mode)
            continue
        match = re.fullmatch(r"fp8|sub(\d+)(?:/(\d+))?(\+fp8)?", name)
        numerator, denominator = (int(match[1]), int(match[2] or 0)) if match and match[1] else (1, 1)
        if not match or numerator < 1 or (match[2] is not None and not numerator <= denominator):
            raise ValueError(
                f"--modes: {name!r} is not a store mode; give fp8, subK or subA/B (the top K directions, or A/B <= 1 "
                "of the feature width), a subspace optionally +fp8, e.g. fp8,sub1/4,sub1/4+fp8 (bf16 is always run), "
                f"or a drafter method: {VARIANT_CHOICES}"
            )
        if name == "fp8":
            mode = StoreMode(name, "fp8")
        else:
            width = f"{numerator}/{denominator}" if match[2] else str(numerator)
            mode = StoreMode(name, "fp8" if match[3] else "bf16", width)
        if mode in modes:
            raise ValueError(f"--modes: {name} is given twice")
        modes.append(mode)
    return modes


def mode_done(stages: Path, folder: str) -> Path:
    """The saved result of a store mode: written last, so its presence means the mode is finished."""
    return stages / f"mode_{folder}.json"


def mode_harvested(stages: Path, folder: str) -> Path:
    """The saved stores of a store mode, written once both are harvested: its drafter may still be untrained."""
    return stages / f"mode_{folder}.stores.json"
