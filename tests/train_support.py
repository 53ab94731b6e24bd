"""What the trainer's test modules share: the tiny runs' options, the CLI call, the metrics records and the
store copies they compare; the stores themselves are conftest.py's fixtures."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from cli.main import main
from dflash.config import TrainConfig
from dflash.store import Store
from dflash.train import reader

ROOT = Path(__file__).resolve().parent.parent
B = 4  # block size of these tests: 3 drafted tokens fit the features of the tiny target (5 layers x 64)


def config(store, out, **overrides) -> TrainConfig:
    base = dict(
        store=str(store),
        out=str(out),
        draft_layers=1,
        block_size=B,
        method="dflash",  # the paper's drafter: these tests check its rule by hand; METHOD_OPTIONS covers the others
        rows_per_step=2,
        max_steps=6,
        log_every=1,
        val_fraction=0.05,
        tensorboard=False,
        export=False,
        reader_workers=2,
        device="cpu",
    )
    return TrainConfig(**{**base, **overrides})


# Every drafter method (and loss option) through the trainer's contract; DFlash 2 small enough for the tiny target.
METHOD_OPTIONS = {
    "dflash": {"method": "dflash"},
    "dflash+dpace": {"method": "dflash", "position_weights": "dpace"},
    "dflash2": {
        "method": "dflash2",
        "drafter_overrides": {"selector_rank": 8, "selector_top_k": 4, "sliding_window": 24},
    },
    "dflash2-drop": {"method": "dflash2", "selector_outside": "drop", "drafter_overrides": {"selector_top_k": 4}},
    # against the target's distribution, from a top-k teacher store (TrainConfig.teacher_loss auto)
    "dflash2-distill": {"method": "dflash2", "drafter_overrides": {"selector_rank": 8, "selector_top_k": 4}},
    # block 3 whose anchor slot drafts: the same 3 drafts as DFlash's block of 4
    "dspark-topk": {"method": "dspark", "block_size": 3, "drafter_overrides": {"markov_rank": 8}},
    "dspark-hidden": {"method": "dspark", "block_size": 3, "drafter_overrides": {"markov_rank": 8}},
}
METHOD_TEACHER = {
    "dspark-topk": "topk:8",
    "dspark-hidden": "hidden",
    "dflash2-distill": "topk:8",
}  # the store's --teacher each one trains from


def metrics_records(out, kind: str = "train") -> list[dict]:
    return [r for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def assert_same_validation(val, reference):
    assert val["blocks"] == reference["blocks"] > 0 and val["rounds"] == reference["rounds"] > 0
    np.testing.assert_allclose([val[k] for k in ("loss", "tau")], [reference[k] for k in ("loss", "tau")], rtol=1e-3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_two_ranks(args: list[str]) -> list[subprocess.Popen]:
    """`python ARGS` as ranks 0 and 1 of a two-process gloo run on this machine (output captured, text)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    return [
        subprocess.Popen(
            [sys.executable, *args],
            env={**env, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]


def train_cli(store, out, *extra):
    args = [
        "train",
        "--shards",
        str(store),
        "--out",
        str(out),
        "--draft-layers",
        "1",
        "--block-size",
        str(B),
        "--max-steps",
        "2",
        "--no-tensorboard",
        "--no-export",
        "--reader-workers",
        "1",
        "--device",
        "cpu",
        "--method",
        "dflash",  # as config(): a later --method in `extra` wins
        *extra,
    ]
    return CliRunner().invoke(main, args)


def copy_store(store, dst) -> Path:
    shutil.copytree(store, dst)
    return dst


def manifest_edit(path, **fields):
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, **fields}))


def curve(records) -> list[tuple]:
    """What a resumed run must reproduce exactly (timings aside)."""
    return [(r["step"], r["loss"], r["accept_len"], r["acc"], r["blocks"], r["grad_norm"]) for r in records]


def corrupt_row(path, row: int, array: str = "hidden"):
    chunk = path / "parts" / "rank00000" / array / "c" / str(row) / "0"
    chunk = chunk / "0" if chunk.is_dir() else chunk
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 16] = bytes(16)
    chunk.write_bytes(bytes(data))


def row_of_step(path, step: int, rows_per_step: int = 2) -> int:
    """The first row that (0-based) step `step` of a one-process run with the default split reads."""
    train, _ = reader.split_rows(Store.open(path).num_rows, 0.05)
    return int(reader.epoch_order(train, 0, 0, 0, 1)[step * rows_per_step])
