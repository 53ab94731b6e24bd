import dataclasses
import json

import pytest
import torch
from harvest_support import OPTIONS as HARVEST_OPTIONS
from harvest_support import write_harvest_data
from train_support import METHOD_TEACHER

from dflash.config import HarvestConfig
from dflash.harvest import run_harvest
from dflash.tiny import CORPUS, build_tokenizer, make_tiny_target

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """Factory: a saved random-weight target of a real architecture, built once per session and arch."""
    cache = {}

    def make(arch: str = "qwen3_5", **kwargs):
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"target-{arch}")
            cache[key] = make_tiny_target(folder, arch, **kwargs)
        return cache[key]

    return make


def _save_tokenizer(folder, template=None) -> str:
    """dflash.tiny's tokenizer saved to `folder`, with another chat template when given; the folder's path."""
    tokenizer = build_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def save_tokenizer():
    """Factory: (folder, template=None) -> the path of dflash.tiny's tokenizer saved there, with that template."""
    return _save_tokenizer


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory):
    return _save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


# The trainer's tests (test_train*.py): a tiny harvest of the bundled corpus (rows of 64 tokens) by the tiny Qwen3
# target, built once per session; a test that changes a store works on a copy (train_support.copy_store).


@pytest.fixture(scope="session")
def target(tiny_target):
    return tiny_target("qwen3")


@pytest.fixture(scope="session")
def store(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("train-store") / "store"
    run_harvest(HarvestConfig(model=str(target), data=str(CORPUS), out=str(out), token_budget=64, workers=1))
    return out


@pytest.fixture(scope="session")
def store_for(store, target, tmp_path_factory):
    """The store a METHOD_OPTIONS entry trains from: the module's, or one harvested with the teacher it needs."""
    made = {}

    def pick(name):
        teacher = METHOD_TEACHER.get(name)
        if teacher is None:
            return store
        if teacher not in made:
            out = tmp_path_factory.mktemp(f"teacher-store-{teacher.replace(':', '')}") / "store"
            cfg = HarvestConfig(model=str(target), data=str(CORPUS), out=str(out), token_budget=64, workers=1)
            run_harvest(dataclasses.replace(cfg, teacher=teacher))
            made[teacher] = out
        return made[teacher]

    return pick


@pytest.fixture(scope="session")
def other_store(target, tmp_path_factory):
    """A store of other documents than `store`'s (every third line of the corpus, rewritten), same target and rows."""
    folder = tmp_path_factory.mktemp("val-store")
    lines = CORPUS.read_text().splitlines()[::3]
    data = folder / "other.jsonl"
    data.write_text(  # each line its own text: identical ones would be deduplicated
        "".join(
            json.dumps({"text": json.loads(line).get("text", f"held out {i}") + " (held out)"}) + "\n"
            for i, line in enumerate(lines)
        )
    )
    run_harvest(HarvestConfig(model=str(target), data=str(data), out=str(folder / "store"), token_budget=64, workers=1))
    return folder / "store"


@pytest.fixture(scope="session")
def harvest_data(tmp_path_factory):
    return write_harvest_data(tmp_path_factory.mktemp("data"), lines=100, long_from=60)


@pytest.fixture(scope="session")
def harvested(tiny_target, harvest_data, tmp_path_factory):
    """Factory: a complete one-rank store of the data for a tiny target of `arch`, harvested in-process."""
    stores = {}

    def make(arch: str):
        if arch not in stores:
            out = tmp_path_factory.mktemp(f"store-{arch}") / "store"
            run_harvest(
                HarvestConfig(model=str(tiny_target(arch)), data=str(harvest_data), out=str(out), **HARVEST_OPTIONS)
            )
            stores[arch] = out
        return stores[arch]

    return make
