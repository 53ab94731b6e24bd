"""The architecture's boundaries, checked: the training side runs without transformers' modeling code (it reads
the target's embedding and LM head, nothing else), and only the store module touches zarr."""

import ast
import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from dflash.config import HarvestConfig
from dflash.harvest import run_harvest
from dflash.tiny import CORPUS

ROOT = Path(__file__).resolve().parent.parent


# The store package, whose names callers find in dflash.store: its bookkeeping files, its layout and read side, its
# write side, its chunk verification.
STORE_MODULES = ["store/bookkeeping.py", "store/reader.py", "store/verify.py", "store/writer.py"]


def test_only_the_store_modules_import_zarr():
    importers = []
    for path in sorted((ROOT / "dflash").rglob("*.py")):  # the packages' modules too (dflash/harvest/)
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(name == "zarr" or name.startswith("zarr.") for name in names):
                importers.append(str(path.relative_to(ROOT / "dflash")))
    assert sorted(set(importers)) == STORE_MODULES


def test_training_loads_no_transformers_modeling_code(tiny_target, tmp_path):
    """A whole run (store, drafter, frozen tensors, steps, validation, export) in a fresh interpreter."""
    store = tmp_path / "store"
    run_harvest(
        HarvestConfig(
            model=str(tiny_target("qwen3")), data=str(CORPUS), out=str(store), token_budget=64, workers=1, device="cpu"
        )
    )
    script = (
        "import json, sys\n"
        "from dflash.config import TrainConfig\n"
        "from dflash.train.run import run_training\n"
        f"run_training(TrainConfig(store={str(store)!r}, out={str(tmp_path / 'run')!r}, draft_layers=1, block_size=4,"
        " max_steps=2, tensorboard=False, device='cpu', reader_workers=1))\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('transformers'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    modules = json.loads(done.stdout.strip().splitlines()[-1])
    assert not [m for m in modules if "modeling" in m or m.startswith("transformers.models.")], modules
    assert (tmp_path / "run" / "drafter" / "model.safetensors").exists()


def dflash_imports(path: Path) -> set[str]:
    """The dflash modules a file imports anywhere (inside functions too): `from dflash import x` names dflash.x."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return {name for name in found if name.startswith("dflash.")}


def test_no_import_circle_among_the_modules():
    """A module that imports another (even inside a function, to stay fast) is never imported back by it, directly
    or through others: shared logic has one home that both use (e.g. dflash.regenerate.answers for regenerate and remote)."""
    modules = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for path in (ROOT / "dflash").rglob("*.py")
    }
    edges = {name: dflash_imports(path) & modules.keys() - {name} for name, path in modules.items()}
    assert (
        "dflash.regenerate.answers" in edges["dflash.regenerate.remote"]
        and "dflash.regenerate.remote" in edges["dflash.regenerate"]
    )

    def reaches(start: str, goal: str, seen: set) -> list[str] | None:
        for nxt in sorted(edges[start] - seen):
            if nxt == goal:
                return [nxt]
            seen.add(nxt)
            if (path := reaches(nxt, goal, seen)) is not None:
                return [nxt, *path]
        return None

    circles = [[name, *path] for name in edges if (path := reaches(name, name, set())) is not None]
    assert not circles, f"import circles: {circles[:3]}"


def test_every_import_of_the_library_resolves_in_bench_and_cli():
    """The scripts under bench/ and the commands under cli/ import the library, some inside functions that no CPU
    test runs: each name they take from dflash exists (a restructuring once left bench/reader.py importing a moved
    module)."""
    missing = []
    for path in sorted([*(ROOT / "bench").glob("*.py"), *(ROOT / "cli").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dflash":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if (
                        not hasattr(module, alias.name)
                        and importlib.util.find_spec(f"{node.module}.{alias.name}") is None
                    ):
                        missing.append(f"{path.relative_to(ROOT)}: {node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "dflash" and importlib.util.find_spec(alias.name) is None:
                        missing.append(f"{path.relative_to(ROOT)}: {alias.name}")
    assert not missing, missing


def test_the_drafter_package_imports_none_of_its_users():
    """dflash/drafter/ (a drafter's model, its attention kernels, its step's cost) sits below what uses it: none of
    its modules imports the stages (train, evaluate, harvest, plan) or the methods that extend it."""
    users = ("dflash.train", "dflash.evaluate", "dflash.harvest", "dflash.plan", "dflash.methods")
    upward = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for path in (ROOT / "dflash" / "drafter").glob("*.py")
        for name in dflash_imports(path)
        if any(name == user or name.startswith(f"{user}.") for user in users)
    )
    assert not upward, upward
