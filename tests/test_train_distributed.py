"""The trainer on two gloo ranks against one process, and the epoch order the ranks split."""

import json
import os
import subprocess
import sys

import numpy as np
import torch
from train_support import ROOT, B, assert_same_validation, config, free_port, metrics_records

from dflash.train import reader
from dflash.train.run import run_training

# ---------------------------------------------------------------------------------------------- distributed


def test_two_gloo_ranks_match_one_process(store, tmp_path):
    """2 ranks x 1 row per step == 1 process x 2 micro-steps of 1 row: same global batches (strided epoch
    order), same anchors (keyed by row), same normalisation (global weight sum), so the same weights and the same
    validation, its sums over the ranks' held-out rows included."""
    args = [
        "-m",
        "cli",
        "train",
        "--shards",
        str(store),
        "--draft-layers",
        "1",
        "--block-size",
        str(B),
        "--max-steps",
        "4",
        "--log-every",
        "1",
        "--val-fraction",
        "0.05",
        "--no-tensorboard",
        "--no-export",
        "--device",
        "cpu",
        "--method",
        "dflash2",  # the default; its codebooks' dense gradients go through the all-reduce too
    ]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, *args, "--out", str(tmp_path / "ranks"), "--rows-per-step", "1"],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs  # a divergence of the ranks' weights would fail here
    assert "training 1-layer drafter" in outputs[0] and "train step 4:" in outputs[0]
    assert "training 1-layer drafter" not in outputs[1] and "step 4" not in outputs[1], outputs[1]  # rank 0's lines
    single = run_training(
        config(store, tmp_path / "single", max_steps=4, rows_per_step=1, grad_accum=2, method="dflash2")
    )
    two = metrics_records(tmp_path / "ranks")
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in single["records"]], rtol=1e-6)
    lines = (tmp_path / "ranks" / "metrics.jsonl").read_text().splitlines()
    two_val = [r for r in map(json.loads, lines) if r["kind"] == "val"][-1]
    assert_same_validation(two_val, single["val"])  # each rank replays its half of the held-out rows
    weights = [torch.load(tmp_path / run / "checkpoints" / "step_4" / "model.pt") for run in ("ranks", "single")]
    for name, value in weights[0].items():
        torch.testing.assert_close(value, weights[1][name], rtol=1e-6, atol=1e-7)


def test_epoch_order_splits_rows_like_one_big_batch():
    rows = np.arange(103)
    one = reader.epoch_order(rows, seed=3, epoch=1, rank=0, world_size=1)
    parts = [reader.epoch_order(rows, seed=3, epoch=1, rank=r, world_size=4) for r in range(4)]
    assert len({len(p) for p in parts}) == 1 and len(parts[0]) == 25
    assert not set(parts[0]) & set(parts[1])
    # step s of every rank with k rows == step s of one process with 4k rows
    k = 5
    for s in range(len(parts[0]) // k):
        assert sorted(np.concatenate([p[s * k : (s + 1) * k] for p in parts])) == sorted(
            one[4 * k * s : 4 * k * (s + 1)]
        )
    assert np.array_equal(one, reader.epoch_order(rows, 3, 1, 0, 1))
    assert not np.array_equal(one, reader.epoch_order(rows, 3, 2, 0, 1))
    train, val = reader.split_rows(1000, 0.01)
    assert len(val) == 10 and not set(train) & set(val) and len(train) + len(val) == 1000
