"""The drafter methods, registered in one place: `--method NAME` on train, `architectures` in config.json.

| name | what | module |
| --- | --- | --- |
| dflash | DFlash (paper, February 2026) | dflash1.py |
| dflash2 | DFlash 2: dynamic block convs and a candidate selector | dflash2.py |
| dspark | DSpark: the anchor slot drafts, a Markov head and a confidence head | dspark.py |
"""

from dflash.errors import DflashError
from dflash.methods import dflash1, dflash2, dspark
from dflash.methods.base import Method, Objective, ObjectiveOptions

METHODS: dict[str, Method] = {m.name: m for m in (dflash1.METHOD, dflash2.METHOD, dspark.METHOD)}
# The method of a drafter that does not say: a config.json without `architectures`, a checkpoint from before methods.
UNLABELLED = "dflash"

__all__ = ["METHODS", "UNLABELLED", "Method", "Objective", "ObjectiveOptions", "get", "of_architectures"]


def get(name: str) -> Method:
    if name not in METHODS:
        raise DflashError(f"unknown drafter method {name!r}; the methods are {', '.join(METHODS)}")
    return METHODS[name]


def of_architectures(architectures) -> Method | None:
    """The method whose config class writes these `architectures` (config.json), or None."""
    names = list(architectures or [])
    return next((m for m in METHODS.values() if names == [m.config_cls.architecture]), None)


def config_class(hf_config: dict) -> type:
    """The config class that reads this config.json: by `architectures`; a folder without them is DFlash's."""
    architectures = hf_config.get("architectures")
    method = of_architectures(architectures) if architectures else METHODS[UNLABELLED]
    if method is None:
        known = ", ".join(m.config_cls.architecture for m in METHODS.values())
        raise DflashError(f"the drafter's architectures {architectures} are none that dflash trains ({known})")
    return method.config_cls


def of_config(config) -> Method:
    return METHODS[config.method]


def model_for(config):
    """A new (randomly initialised) drafter of `config`'s method."""
    return of_config(config).model_cls(config)
