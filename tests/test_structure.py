"""The architecture's boundaries, checked: the training side runs without transformers' modeling code (it reads
the target's embedding and LM head, nothing else), and only the store module touches zarr."""

import ast
import json
import subprocess
import sys
from pathlib import Path

from dflash.config import HarvestConfig
from dflash.harvest import run_harvest
from dflash.tiny import CORPUS

ROOT = Path(__file__).resolve().parent.parent


# The store layer: store.py and the two modules split out of it (its bookkeeping files, its chunk verification).
STORE_MODULES = ["bookkeeping.py", "store.py", "verify.py"]


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
        "from dflash.train import run_training\n"
        f"run_training(TrainConfig(store={str(store)!r}, out={str(tmp_path / 'run')!r}, draft_layers=1, block_size=4,"
        " max_steps=2, tensorboard=False, device='cpu', reader_workers=1))\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('transformers'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    modules = json.loads(done.stdout.strip().splitlines()[-1])
    assert not [m for m in modules if "modeling" in m or m.startswith("transformers.models.")], modules
    assert (tmp_path / "run" / "drafter" / "model.safetensors").exists()
