"""The trainer on the CPU: label alignment, compiled vs eager, resume, two gloo ranks, export, bad input.

Every run trains from a real store: a tiny harvest of the bundled corpus (rows of 64 tokens) by the tiny Qwen3
target; the alignment tests rewrite its arrays with features that make the labels knowable.
"""

import dataclasses
import io
import json
import logging
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from click.testing import CliRunner
from torch.nn.attention.flex_attention import create_block_mask

from cli.main import main
from dflash import blocks, graph, reader
from dflash.attention_kernels import default_mask_tile
from dflash.checkpoint import Checkpointer, fingerprint
from dflash.config import HarvestConfig, TrainConfig
from dflash.errors import DflashError
from dflash.export import load_drafter
from dflash.harvest import run_harvest
from dflash.metrics import visible_pairs
from dflash.store import Store
from dflash.target_files import load_embedding_and_head
from dflash.tiny import CORPUS
from dflash.train import Trainer
from dflash.train_run import run_training
from dflash.train_setup import init_distributed

ROOT = Path(__file__).resolve().parent.parent
B = 4  # block size of these tests: 3 drafted tokens fit the features of the tiny target (5 layers x 64)


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target("qwen3")


@pytest.fixture(scope="module")
def store(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("train-store") / "store"
    run_harvest(HarvestConfig(model=str(target), data=str(CORPUS), out=str(out), token_budget=64, workers=1))
    return out


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
    # block 3 whose anchor slot drafts: the same 3 drafts as DFlash's block of 4
    "dspark-topk": {"method": "dspark", "block_size": 3, "drafter_overrides": {"markov_rank": 8}},
    "dspark-hidden": {"method": "dspark", "block_size": 3, "drafter_overrides": {"markov_rank": 8}},
}
METHOD_TEACHER = {"dspark-topk": "topk:8", "dspark-hidden": "hidden"}  # the store's --teacher each one trains from


@pytest.fixture(scope="module")
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


def train_records(out) -> list[dict]:
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


# ---------------------------------------------------------------------------------------------- label alignment


def write_knowable_store(src: Path, dst: Path, head: torch.Tensor, seed: int = 0, every: int = 1):
    """Rewrite a store so that the features at position j carry the ids of tokens j+1 .. j+B, as a perfect LM's
    would: slot s (one tapped layer wide) holds the LM-head row of token j+1+s. Documents of 8-19 random tokens
    (16 distinct ids), loss mask off on each document's first token (which has no context). With every = k only
    every k-th document's features say anything (the others' are zero)."""
    shutil.copytree(src, dst)
    part = zarr.open_group(dst / "parts" / "rank00000", mode="r+")
    rows, T, width = part["hidden"].shape
    H = head.shape[1]
    rng = np.random.default_rng(seed)
    vocab = rng.choice(np.arange(4, head.shape[0]), 16, replace=False)
    unit = (4 * head / head.norm(dim=1, keepdim=True)).numpy()
    arrays = {
        "input_ids": np.zeros((rows, T), np.int32),
        "position_ids": np.zeros((rows, T), np.int32),
        "doc_ids": np.full((rows, T), -1, np.int32),
        "loss_mask": np.zeros((rows, T), np.uint8),
    }
    hidden = np.zeros((rows, T, width), np.float32)
    for r in range(rows):
        t, d = 0, 0
        while T - t > B:
            n = min(int(rng.integers(8, 20)), T - t)
            tokens = rng.choice(vocab, n)
            arrays["input_ids"][r, t : t + n] = tokens
            arrays["position_ids"][r, t : t + n] = np.arange(n)
            arrays["doc_ids"][r, t : t + n] = 100 * r + d
            arrays["loss_mask"][r, t + 1 : t + n] = 1
            for j in range(n if d % every == 0 else 0):
                for s in range(min(B, n - j - 1)):
                    hidden[r, t + j, s * H : (s + 1) * H] = unit[tokens[j + 1 + s]]
            t, d = t + n, d + 1
    for name, value in arrays.items():
        part[name][:] = value
    part["hidden"][:] = torch.from_numpy(hidden).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def inclusive_mask(anchors, valid, doc_ids, block_size, window=None):
    """The historical bug: context visible up to and including the anchor (kv <= a)."""
    R, A = anchors.shape
    T = doc_ids.shape[1]
    anchor_doc = doc_ids.gather(1, anchors)

    def mask_mod(b, h, q, kv):
        j = q // block_size
        same_doc = doc_ids[b, kv.clamp(max=T - 1)] == anchor_doc[b, j]
        context = (kv < T) & same_doc & (kv <= anchors[b, j]) & valid[b, j]
        return context | ((kv >= T) & ((kv - T) // block_size == j))

    return create_block_mask(mask_mod, R, None, A * block_size, T + A * block_size, device=anchors.device)


def inclusive_dense_mask(dense_block_mask):
    """inclusive_mask as the dense mask of the CPU step: each valid block also sees its anchor's position."""

    def mask(anchors, valid, doc_ids, block_size, window=None):
        visible = dense_block_mask(anchors, valid, doc_ids, block_size, window)
        block_of_query = torch.arange(anchors.shape[1] * block_size) // block_size
        anchor = anchors[:, block_of_query, None]
        return visible.scatter(2, anchor, visible.gather(2, anchor) | valid[:, block_of_query, None])

    return mask


def shifted_labels(block_inputs):
    """The other historical bug: labels shifted once more (output k trained on token a+k+1)."""

    def wrapped(input_ids, position_ids, loss_mask, anchors, valid, mask_token_id, block_size, gamma=None, span=None):
        block_ids, q_positions, labels, weights = block_inputs(
            input_ids, position_ids, loss_mask, anchors, valid, mask_token_id, block_size, gamma, span
        )
        k = torch.arange(block_size)
        index = (anchors[:, :, None] + k + 1).clamp(max=input_ids.shape[1] - 1).flatten(1)
        return block_ids, q_positions, input_ids.gather(1, index).long(), weights

    return wrapped


@torch.no_grad()
def inference_hits(drafter_dir: Path, store_dir: Path, rows, embed, head) -> list[dict[int, np.ndarray]]:
    """What speculative decoding would see, written from the rule alone: for every anchor a, the drafter gets the
    features of its document strictly before a and the block [t_a, MASK...]. Per row {a: hits at k = 1..B-1}."""
    model, cfg = load_drafter(drafter_dir)
    shards = Store.open(store_dir)
    per_row = []
    for r in rows:
        row = shards.read_row(int(r))
        hidden = torch.from_numpy(row["hidden"].view(np.int16)).view(torch.bfloat16).float()
        ids, pos = torch.from_numpy(row["input_ids"]).long(), torch.from_numpy(row["position_ids"]).long()
        doc, mask = row["doc_ids"], row["loss_mask"]
        hits = {}
        for a in range(len(ids) - B + 1):
            if doc[a] < 0 or doc[a + B - 1] != doc[a] or not mask[a]:
                continue
            start = a - int(pos[a])
            block = torch.full((B,), cfg.mask_token_id)
            block[0] = ids[a]
            out = model(embed[block][None], hidden[start:a][None], (pos[a] + torch.arange(B))[None], pos[start:a][None])
            hits[a] = ((out[0, 1:] @ head.T).argmax(-1) == ids[a + 1 : a + B]).numpy()
        per_row.append(hits)
    return per_row


def inference_accuracy(drafter_dir: Path, store_dir: Path, rows, embed, head) -> tuple[np.ndarray, float]:
    """(accuracy per k, acceptance length) over every anchor of `rows`."""
    hits = [hit for row in inference_hits(drafter_dir, store_dir, rows, embed, head) for hit in row.values()]
    return np.mean(hits, axis=0), float(np.mean([1 + np.cumprod(hit).sum() for hit in hits]))


def decode_by_hand(hits: list[dict[int, np.ndarray]]) -> tuple[int, int]:
    """(rounds, tokens) of decoding every answer: in the knowable store every document is one answer whose
    anchors are consecutive; start at its first one, draft, keep the leading hits and the target's token, repeat
    from the token after them until the document's anchors run out."""
    rounds = tokens = 0
    for row in hits:
        for a in sorted(row):
            if a - 1 in row:
                continue  # not a document's first anchor
            while a in row:
                accepted = int(np.cumprod(row[a]).sum())
                rounds, tokens, a = rounds + 1, tokens + accepted + 1, a + accepted + 1
    return rounds, tokens


@pytest.mark.parametrize("bug", [None, "shifted_labels", "inclusive_mask"])
def test_label_alignment(bug, store, target, tmp_path, monkeypatch):
    """Features at j make tokens j+1..j+B knowable, so a correct trainer learns every block position and the
    acceptance it reports agrees with an independent inference-style evaluation. With labels shifted once
    more the last position's label is nowhere in view (training itself fails); with `<=` visibility training
    looks perfect but the drafter leans on the anchor's own features, which inference does not have."""
    embed, head = (w.float() for w in load_embedding_and_head(str(target)))
    write_knowable_store(store, tmp_path / "store", head)
    if bug == "shifted_labels":
        monkeypatch.setattr(blocks, "block_inputs", shifted_labels(blocks.block_inputs))
    if bug == "inclusive_mask":
        monkeypatch.setattr(blocks, "block_attention_mask", inclusive_mask)  # (the GPU's)
        monkeypatch.setattr(blocks, "dense_block_mask", inclusive_dense_mask(blocks.dense_block_mask))  # (the CPU's)
    cfg = config(
        tmp_path / "store",
        tmp_path / "run",
        draft_layers=2,
        rows_per_step=4,
        max_steps=300,
        lr=5e-3,
        log_every=100,
        val_fraction=0.1,
        export=True,
        export_dtype="float32",
    )
    result = run_training(cfg)
    _, val_rows = reader.split_rows(Store.open(tmp_path / "store").num_rows, cfg.val_fraction)
    accuracy, acceptance = inference_accuracy(
        tmp_path / "run" / "drafter", tmp_path / "store", val_rows[:12], embed, head
    )
    val = result["val"]
    learned = min(accuracy) > 0.85 and acceptance > 3.5  # B = 4: at most 1 + 3 accepted
    if bug is None:
        assert min(val["acc"]) > 0.85, val
        assert learned, (accuracy, acceptance)
        assert abs(val["accept_len"] - acceptance) < 0.2  # the trainer's metric is what inference would see
        implied = 1 + np.cumprod(val["acc"]).sum()
        assert abs(val["accept_len"] - implied) < 0.2
    else:
        assert not learned, (bug, accuracy, acceptance)
    if bug == "inclusive_mask":
        assert min(val["acc"]) > 0.85  # the symptom of that bug: high training accuracy, low acceptance


def test_validation_replays_decoding(store, target, tmp_path):
    """Half the documents knowable, half not: the drafter accepts whole blocks in the one and almost nothing in
    the other. Validation's tau must be the tau of decoding those answers (worked out by hand from the exported
    drafter's own drafts), well below its mean over anchors, which counts every token of a knowable document."""
    embed, head = (w.float() for w in load_embedding_and_head(str(target)))
    write_knowable_store(store, tmp_path / "store", head, seed=1, every=2)
    cfg = config(
        tmp_path / "store",
        tmp_path / "run",
        draft_layers=2,
        rows_per_step=4,
        max_steps=300,
        lr=5e-3,
        log_every=100,
        val_fraction=0.2,
        export=True,
        export_dtype="float32",
    )
    val = run_training(cfg)["val"]
    _, val_rows = reader.split_rows(Store.open(tmp_path / "store").num_rows, cfg.val_fraction)
    rounds, tokens = decode_by_hand(
        inference_hits(tmp_path / "run" / "drafter", tmp_path / "store", val_rows, embed, head)
    )
    assert abs(val["rounds"] - rounds) <= 0.02 * rounds, (val, rounds)
    assert abs(val["tau"] - tokens / rounds) < 0.05, (val, tokens / rounds)
    assert val["accept_len"] - val["tau"] > 0.3, val


def test_validation_time_counts_in_no_training_step(store, tmp_path, monkeypatch):
    """Validation every 2 steps made 1 s longer: were its time a step's, the records after it would read >= 500 ms
    per step (2 steps per record); tiny CPU steps take tens of ms."""
    validate = Trainer.validate

    def slow_validate(self, step):
        time.sleep(1.0)
        return validate(self, step)

    monkeypatch.setattr(Trainer, "validate", slow_validate)
    records = run_training(config(store, tmp_path / "run", max_steps=6, log_every=2, val_every=2))["records"]
    assert len(records) == 3 and max(r["step_ms"] for r in records) < 300, [r["step_ms"] for r in records]


# ---------------------------------------------------------------------------------------------- compile, resume


@pytest.mark.parametrize(
    "method, recompute",
    [
        ("dflash", "none"),
        ("dflash2", "none"),
        ("dspark-topk", "none"),
        ("dflash2", "mlp"),
        ("dflash2", "pointwise"),
        ("dspark-topk", "pointwise"),
    ],
)
def test_compiled_step_matches_eager_without_recompiles(method, recompute, store_for, tmp_path):
    """20 steps over different rows: compiled drafter + objective agree with eager, and nothing recompiles after
    warmup (a recompile would raise), validation's windows included; with --recompute compiled against eager
    without it. The BlockMask builder stays eager on the CPU (see Trainer.__init__)."""
    options, store = METHOD_OPTIONS[method], store_for(method)
    eager = run_training(config(store, tmp_path / "eager", max_steps=20, compile=False, **options))
    compiled_cfg = config(store, tmp_path / "compiled", max_steps=20, compile=True, recompute=recompute, **options)
    compiled = run_training(compiled_cfg)
    assert [r["recompiles"] for r in compiled["records"]] == [0] * 20
    for key, rtol in (("loss", 1e-5), ("grad_norm", 1e-4)):
        np.testing.assert_allclose([r[key] for r in compiled["records"]], [r[key] for r in eager["records"]], rtol=rtol)
    assert_same_validation(compiled["val"], eager["val"])


def assert_same_validation(val, reference):
    assert val["blocks"] == reference["blocks"] > 0 and val["rounds"] == reference["rounds"] > 0
    np.testing.assert_allclose([val[k] for k in ("loss", "tau")], [reference[k] for k in ("loss", "tau")], rtol=1e-3)


@pytest.mark.parametrize("window", [None, 1, 3, 9, 40])
def test_visible_pairs_count_the_mask(window):
    """The attention pairs that MFU counts are the pairs the BlockMask rule lets attend (valid blocks)."""
    g = torch.Generator().manual_seed(0)
    doc_ids = torch.tensor([[0] * 20 + [1] * 30 + [-1] * 14, [5] * 64])
    loss_mask = (torch.rand(2, 64, generator=g) > 0.3).to(torch.uint8)
    anchors, valid = blocks.sample_anchors(loss_mask, doc_ids, 12, B, torch.tensor([[7], [8]]))
    dense = blocks.dense_block_mask(anchors, valid, doc_ids, B, window)
    counted = dense * valid.repeat_interleave(B, dim=1)[:, :, None]
    assert visible_pairs(anchors, valid, doc_ids, B, window) == counted.sum()


def test_recompile_is_an_error_naming_the_cause():
    f = graph.compile_fn(lambda x: x * 2, True)
    f(torch.ones(3))
    with pytest.raises(DflashError, match="size mismatch"):
        with graph.no_recompiles():
            f(torch.ones(4))


def test_resume_reproduces_the_uninterrupted_run(store, tmp_path):
    cfg = config(store, tmp_path / "run", max_steps=8, ckpt_every=3)
    full = [r["loss"] for r in run_training(cfg)["records"]]
    # Interrupted after step 6: its last checkpoint is step_6 (a half-written one would not be named step_N).
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_8")
    (tmp_path / "run" / "checkpoints" / ".tmp-step_8").mkdir()
    assert Checkpointer(tmp_path / "run").latest().name == "step_6"
    resumed = run_training(config(store, tmp_path / "run", max_steps=8, ckpt_every=3, resume=True))["records"]
    assert [r["step"] for r in resumed] == [7, 8]
    assert [r["loss"] for r in resumed] == full[6:]  # exact: same rows, anchors, weights and optimizer state


def test_kernel_options_and_mask_tiles_reach_the_step_and_keep_the_curve(store, tmp_path):
    # The GPU's mask function builds BlockMasks of the chosen tiles (test_attention_kernels); the CPU step takes
    # the dense mask, where neither option can change a value.
    options = {"bwd_num_warps": 8, "USE_TMA": True}
    cfg = config(store, tmp_path / "tuned", max_steps=3, attention_kernel_options=options, mask_tile_size=16)
    trainer = Trainer(cfg, init_distributed("cpu"))
    assert all(layer.self_attn.kernel_options == options for layer in trainer.model.layers)
    assert trainer.mask_tile == 16
    # Unset, the tile follows the drafter's head dim (test_attention_kernels checks it against torch's tables).
    unset = Trainer(config(store, tmp_path / "unset", max_steps=3), init_distributed("cpu"))
    assert TrainConfig.mask_tile_size is None
    assert unset.mask_tile == default_mask_tile(unset.dcfg.head_dim)
    default = run_training(config(store, tmp_path / "default", max_steps=3))["records"]
    tuned = run_training(cfg)["records"]
    assert [r["loss"] for r in tuned] == [r["loss"] for r in default]
    # Speed options, like --compile: a resume may change them.
    assert fingerprint(cfg, 1) == fingerprint(config(store, tmp_path / "tuned", max_steps=3), 1)


@pytest.mark.parametrize("mode", ["mlp", "pointwise"])
def test_recomputing_keeps_the_curve_and_may_change_on_resume(store, tmp_path, mode):
    """--recompute trades memory for time only: the same losses and gradient norms, bit for bit on the CPU."""
    kept = run_training(config(store, tmp_path / "kept", max_steps=3))["records"]
    recomputed_cfg = config(store, tmp_path / "recomputed", max_steps=3, recompute=mode)
    assert Trainer(recomputed_cfg, init_distributed("cpu")).model.recompute == mode
    recomputed = run_training(recomputed_cfg)["records"]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in recomputed] == [r[key] for r in kept]
    assert fingerprint(recomputed_cfg, 1) == fingerprint(config(store, tmp_path / "recomputed", max_steps=3), 1)


def test_the_host_embedding_keeps_the_curve_and_may_change_on_resume(store, tmp_path, caplog):
    """--embedding host: the reader threads look each row's tokens up in a host copy of the table and the step
    gathers its anchors' from them; the same losses, gradient norms and validation, bit for bit on the CPU."""
    on_device = run_training(config(store, tmp_path / "device", max_steps=3, embedding="device"))
    host_cfg = config(store, tmp_path / "host", max_steps=3, embedding="host")
    trainer = Trainer(host_cfg, init_distributed("cpu"))
    assert trainer.host_embedding and not hasattr(trainer, "embed")
    assert trainer.static["token_embeds"].shape == (1, 2, trainer.store.token_budget, trainer.dcfg.hidden_size)
    with caplog.at_level(logging.INFO, logger="dflash"):
        on_host = run_training(host_cfg)
    assert "token embeddings: looked up on the host by the reader threads (--embedding host)" in caplog.text
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in on_host["records"]] == [r[key] for r in on_device["records"]]
    assert_same_validation(on_host["val"], on_device["val"])
    assert fingerprint(host_cfg, 1) == fingerprint(config(store, tmp_path / "host", max_steps=3), 1)
    # auto: the device on the CPU, where no GPU memory is to be saved
    assert not Trainer(config(store, tmp_path / "auto", max_steps=3), init_distributed("cpu")).host_embedding


def test_resume_with_other_options_names_them(store, tmp_path):
    run_training(config(store, tmp_path / "run", max_steps=2))
    with pytest.raises(DflashError, match=r"lr: checkpoint 0.0006, now 0.001.*max_steps"):
        run_training(config(store, tmp_path / "run", max_steps=4, lr=1e-3, resume=True))


# ---------------------------------------------------------------------------------------------- distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_two_ranks(args: list[str]) -> list[subprocess.Popen]:
    """`python ARGS` as ranks 0 and 1 of a two-process gloo run on this machine (output captured, text)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
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
        "MASTER_PORT": str(_free_port()),
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
    two = train_records(tmp_path / "ranks")
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


# ---------------------------------------------------------------------------------------------- export, CLI


def test_export_round_trip(store, tmp_path):
    run_training(config(store, tmp_path / "run", max_steps=3))
    runner = CliRunner()
    for dtype in ("float32", "bfloat16"):
        result = runner.invoke(
            main, ["export", str(tmp_path / "run"), "--out", str(tmp_path / dtype), "--dtype", dtype]
        )
        assert result.exit_code == 0, result.output
    trained = torch.load(tmp_path / "run" / "checkpoints" / "step_3" / "model.pt")
    exact, cfg = load_drafter(tmp_path / "float32")
    halved, _ = load_drafter(tmp_path / "bfloat16")
    g = torch.Generator().manual_seed(0)
    T, Q = 24, 2 * B
    inputs = (
        torch.randn(1, Q, cfg.hidden_size, generator=g),
        torch.randn(1, T, cfg.feature_dim, generator=g),
        torch.arange(T, T + Q)[None],
        torch.arange(T)[None],
    )
    reference = type(exact)(cfg)
    reference.load_state_dict(trained)
    with torch.no_grad():
        assert torch.equal(exact(*inputs), reference(*inputs))
        reference.to(torch.bfloat16)
        assert torch.equal(
            halved(*(x.to(torch.bfloat16) if x.is_floating_point() else x for x in inputs)),
            reference(*(x.to(torch.bfloat16) if x.is_floating_point() else x for x in inputs)),
        )


@pytest.mark.parametrize("method", sorted(METHOD_OPTIONS))
def test_every_method_resumes_exactly_exports_and_decodes_greedily(method, store_for, target, tmp_path):
    """Train 8 steps with a checkpoint at 6 and validation; a resume from step 6 gives the same records, the
    export loads as the method's drafter, and speculative decoding with it reproduces plain greedy decoding."""
    from dflash import methods
    from dflash.config import EvalConfig
    from dflash.evaluate import evaluate
    from dflash.tiny import PROMPTS

    options, store = METHOD_OPTIONS[method], store_for(method)
    cfg = config(store, tmp_path / "run", max_steps=8, ckpt_every=6, log_every=2, export=True, **options)
    full = run_training(cfg)
    assert full["val"]["blocks"] > 0 and full["val"]["rounds"] > 0
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_8")
    resumed = run_training(dataclasses.replace(cfg, resume=True))["records"]
    assert [r["loss"] for r in resumed if r["kind"] == "train"] == [r["loss"] for r in full["records"]][3:]
    model, dcfg = load_drafter(tmp_path / "run" / "drafter")
    assert dcfg.method == options["method"] and isinstance(model, methods.get(dcfg.method).model_cls)
    prompts = [json.loads(line) for line in Path(PROMPTS).read_text().splitlines()[:2]]
    report = evaluate(
        EvalConfig(str(target), prompts, drafter=[str(tmp_path / "run" / "drafter")], max_new_tokens=10, device="cpu")
    )
    result = report.methods["dflash"]
    assert result.mismatches == 0 and result.tau >= 1


@pytest.mark.parametrize("teacher", ["topk:8", "hidden"])
def test_dspark_reads_each_labels_teacher_at_the_position_before_it(teacher, store_for, tmp_path):
    """The trainer's blocks for DSpark against index loops over the store's own rows: labels input_ids[a + k],
    and the teacher arrays of the position a + k - 1, whose next-token distribution is that label's."""
    name = {"topk:8": "dspark-topk", "hidden": "dspark-hidden"}[teacher]
    path = store_for(name)
    trainer = Trainer(config(path, tmp_path / "run", **METHOD_OPTIONS[name]), init_distributed("cpu"))
    source = Store.open(path)
    S = trainer.span
    assert S == 4 and trainer.block_size == 3
    for r in range(2):
        row, teacher_row = source.read_row(r), source.read_teacher(r)
        for name_, values in {**row, **teacher_row}.items():
            if name_ in trainer.static:
                slot = trainer.static[name_][0, r]
                (slot.view(torch.int16) if slot.dtype == torch.bfloat16 else slot).copy_(_bits(values))
    x = trainer._inputs(0)
    assert set(x["teacher"]) == set(source.teacher_layout)
    checked = 0
    for r in range(2):
        row, teacher_row = source.read_row(r), source.read_teacher(r)
        for j, a in enumerate(x["anchors"][r].tolist()):
            if not x["valid"][r, j]:
                continue
            for k in range(1, S):
                n = (r * trainer.num_anchors + j) * S + k
                assert x["labels"][r, j * S + k] == int(row["input_ids"][a + k])
                for array, values in teacher_row.items():
                    got = x["teacher"][array][n]
                    want = _bits(values[a + k - 1])
                    assert torch.equal(got.view(torch.int16) if got.dtype == torch.bfloat16 else got, want), array
                checked += 1
    assert checked > 20


def _bits(values) -> torch.Tensor:
    """A store array as a tensor, bf16 bits (uint16) as int16."""
    values = np.asarray(values)
    return torch.from_numpy(values.view(np.int16) if values.dtype == np.uint16 else values)


def _train_cli(store, out, *extra):
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


def _copy_store(store, dst) -> Path:
    shutil.copytree(store, dst)
    return dst


def test_cli_trains_and_exports(store, tmp_path):
    result = _train_cli(store, tmp_path / "run", "--export", "--val-every", "1", "--log-every", "1", "--tensorboard")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "drafter" / "model.safetensors").exists()
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))
    kinds = [r["kind"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())]
    assert kinds == ["val", "train", "train", "val"]


@pytest.fixture(scope="module")
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


def _initial_validation(cfg: TrainConfig) -> tuple[dict, "Trainer"]:
    """Validation with the seed's initial weights (prepare restores them after its warm-up steps)."""
    trainer = Trainer(cfg, init_distributed("cpu"))
    trainer.prepare(None)
    return trainer.validate(0), trainer


def test_val_store_validates_on_the_other_store_and_trains_on_every_row(store, other_store, tmp_path):
    on_other, trainer = _initial_validation(config(store, tmp_path / "a", val_store=str(other_store)))
    # Trained on other rows, validated on the same documents (a copy: a store cannot hold out itself).
    same = _copy_store(other_store, tmp_path / "same")
    reference, _ = _initial_validation(config(other_store, tmp_path / "b", val_store=str(same)))
    split, _ = _initial_validation(config(store, tmp_path / "c"))
    assert on_other == reference and on_other["blocks"] > 0
    assert split["blocks"] != on_other["blocks"] and split["loss"] != on_other["loss"]
    assert trainer.plan.train_rows.tolist() == list(range(Store.open(store).num_rows))
    assert trainer.plan.val_rows.tolist() == list(range(Store.open(other_store).num_rows))


def test_resume_fingerprint_keeps_whether_there_is_a_held_out_store_not_where():
    base = TrainConfig(store="s", out="o")
    moved = fingerprint(TrainConfig(store="s", out="o", val_store="/a/v"), 1)
    assert moved == fingerprint(TrainConfig(store="s", out="o", val_store="v", val_fraction=0.5), 1)
    assert moved != fingerprint(base, 1) and moved["val_store"] is True and fingerprint(base, 1)["val_store"] is None


def _manifest_edit(path, **fields):
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, **fields}))


def _corrupt_first_row(path) -> int:
    """Flip bytes in a hidden chunk of the first row the run reads; returns that row."""
    shards = Store.open(path)
    train, _ = reader.split_rows(shards.num_rows, TrainConfig.val_fraction)
    row = int(reader.epoch_order(train, 0, 0, 0, 1)[0])
    chunk = path / "parts" / "rank00000" / "hidden" / "c" / str(row) / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 16] = bytes(16)
    chunk.write_bytes(bytes(data))
    return row


@pytest.mark.parametrize(
    "case",
    [
        "incomplete",
        "format_version",
        "corrupt_chunk",
        "head_shape",
        "block_too_big",
        "too_many_anchors",
        "val_store",
        "val_store_is_the_store",
        "resume_options",
        "dflash2_group_size",
        "selector_option_for_dflash",
        "dspark_without_teacher",
    ],
)
def test_bad_input_is_a_clear_error(case, store, target, tiny_target, tmp_path):
    extra, shards = [], store
    if case == "incomplete":
        shards = _copy_store(store, tmp_path / "store")
        (shards / "manifest.json").unlink()
        expected = "incomplete store"
    elif case == "format_version":
        shards = _copy_store(store, tmp_path / "store")
        _manifest_edit(shards, format_version=99)
        expected = "format version 99"
    elif case == "corrupt_chunk":
        shards = _copy_store(store, tmp_path / "store")
        expected = f"row {_corrupt_first_row(shards)} "
    elif case == "head_shape":
        extra, expected = ["--target", str(tiny_target("qwen3", hidden_size=32))], "hidden size 64"
    elif case == "block_too_big":
        extra, expected = ["--block-size", "128"], "cannot hold a block of 128"
    elif case == "too_many_anchors":
        extra, expected = ["--anchors", "200"], "lower --anchors"
    elif case == "val_store":
        other = _copy_store(store, tmp_path / "other")
        manifest = json.loads((other / "manifest.json").read_text())
        fingerprint = {**manifest["fingerprint"], "dtype": "float64"}
        # (not token_budget: a store now checks its manifest's row shape against its arrays on open)
        _manifest_edit(other, layer_ids=manifest["layer_ids"][::-1], fingerprint=fingerprint)
        expected = "differs from the training store in layer_ids, the dtype the target ran in"
        extra = ["--val-shards", str(other)]
    elif case == "val_store_is_the_store":
        extra, expected = ["--val-shards", str(store)], "is the training store itself"
    elif case == "dflash2_group_size":
        extra = ["--method", "dflash2", "--drafter-option", "conv_group_size=5"]
        expected = "conv_group_size 5 must be positive, the group size dividing hidden_size 64"
    elif case == "selector_option_for_dflash":
        extra = ["--method", "dflash", "--drafter-option", "selector_rank=8"]
        expected = "unknown drafter config field selector_rank"
    elif case == "dspark_without_teacher":
        extra = ["--method", "dspark", "--block-size", "3"]
        expected = "harvest it with --teacher hidden"
    else:
        assert _train_cli(store, tmp_path / "run").exit_code == 0
        extra, expected = ["--resume", "--seed", "1"], "seed: checkpoint 0, now 1"
    result = _train_cli(shards, tmp_path / "run", *extra)
    assert result.exit_code == 2, result.output
    assert expected in result.output, result.output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("embedding", ["device", "host"])
def test_cuda_graph_is_flat_and_matches_the_ungraphed_step(store, tmp_path, embedding):
    """On a GPU: the captured step allocates nothing (allocated / reserved bytes identical at every record),
    never recompiles, and computes what the same step computes without the graph; with the token embeddings
    looked up in the step or shipped from the host."""
    on = dict(max_steps=12, device="cuda", embedding=embedding)
    graphed = run_training(config(store, tmp_path / "graph", cuda_graph=True, **on))
    plain = run_training(config(store, tmp_path / "plain", cuda_graph=False, **on))
    assert graphed["allocated_spread"] == 0 and graphed["reserved_spread"] == 0
    assert [r["recompiles"] for r in graphed["records"]] == [0] * 12
    np.testing.assert_allclose(
        [r["loss"] for r in graphed["records"]], [r["loss"] for r in plain["records"]], rtol=1e-3
    )
    assert_same_validation(graphed["val"], plain["val"])  # one captured step replayed over every window


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's Triton kernels need a GPU")
@pytest.mark.parametrize("head_dim, recompute", [(64, "none"), (128, "none"), (128, "pointwise")])
def test_the_default_attention_kernels_compile_at_real_head_dims(store, tmp_path, head_dim, recompute):
    """On a GPU: the default BlockMask tiles and kernel options for the head dim compile and train (on 2026-12-03
    the H200 refused a mask of 64-tiles at head_dim 64, where torch's kernel tiles are 128 wide); so does the
    selective checkpoint of --recompute pointwise around flex_attention. Head dim 256 trains in bench/train.py's
    rows; this store's are too short for its kernels (the next test)."""
    overrides = {"head_dim": head_dim}
    cfg = config(store, tmp_path / "run", max_steps=2, device="cuda", drafter_overrides=overrides, recompute=recompute)
    records = run_training(cfg)["records"]
    assert len(records) == 2 and all(np.isfinite(r["loss"]) for r in records)
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("step_*/state.json")).read_text())
    assert state["drafter"]["head_dim"] == head_dim


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's Triton kernels need a GPU")
def test_rows_too_short_for_the_attention_kernels_are_refused_naming_the_fix(store, tmp_path):
    """At head_dim 256 torch's flex_attention has no kernel for this store's rows of a few dozen tokens (the H200,
    2026-12-03): the first compile is refused with the shapes and the fix, not inductor's traceback."""
    cfg = config(store, tmp_path / "run", max_steps=2, device="cuda", drafter_overrides={"head_dim": 256})
    with pytest.raises(DflashError, match="flex_attention has no kernel .* head_dim 256: .* longer --token-budget"):
        run_training(cfg)


def test_out_of_memory_at_capture_names_the_options():
    def step():
        raise torch.OutOfMemoryError("CUDA out of memory")

    runner = graph.GraphedStep(step, device=torch.device("cpu"), cuda_graph=True, hint="--anchors or --loss-chunk")
    with pytest.raises(DflashError, match="out of memory during warmup of the step: lower --anchors or --loss-chunk"):
        runner.warmup()


def test_a_version_1_store_still_trains(store, tmp_path):
    """A store written before format version 2 (no feature encoding, no target text config in its manifest) trains
    like the same store in version 2: bf16 at full width, the drafter shaped from the target's config.json."""
    old = _copy_store(store, tmp_path / "v1")
    manifest = json.loads((old / "manifest.json").read_text())
    for key in ("features", "identity"):
        del manifest[key]
    manifest["format_version"] = manifest["fingerprint"]["format_version"] = 1
    manifest["target"] = {
        k: manifest["target"][k]
        for k in ("name", "model_type", "config_hash", "hidden_size", "num_layers", "vocab_size")
    }
    manifest["storage"] = {"hidden": "uint16 holding bfloat16 bit patterns"}
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert Store.open(old).manifest.format_version == 1
    for name, path in (("v1", old), ("v2", store)):
        run_training(config(path, tmp_path / f"run-{name}", max_steps=2))  # (not into the store: refused)
    states = [
        json.loads(next((tmp_path / f"run-{name}" / "checkpoints").glob("step_*/state.json")).read_text())
        for name in ("v1", "v2")
    ]
    assert states[0]["drafter"] == states[1]["drafter"]
    runs = [tmp_path / f"run-{name}" / "checkpoints" for name in ("v1", "v2")]
    models = [torch.load(next(run.glob("step_*/model.pt"))) for run in runs]
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])


# ---------------------------------------------------------------------------------------------- faults (issue 17)


def _records(out, kind="train") -> list[dict]:
    return [r for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def _curve(records) -> list[tuple]:
    """What a resumed run must reproduce exactly (timings aside)."""
    return [(r["step"], r["loss"], r["accept_len"], r["acc"], r["blocks"], r["grad_norm"]) for r in records]


def _corrupt_row(path, row: int, array: str = "hidden"):
    chunk = path / "parts" / "rank00000" / array / "c" / str(row) / "0"
    chunk = chunk / "0" if chunk.is_dir() else chunk
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 16] = bytes(16)
    chunk.write_bytes(bytes(data))


def _row_of_step(path, step: int, rows_per_step: int = 2) -> int:
    """The first row that (0-based) step `step` of a one-process run with the default split reads."""
    train, _ = reader.split_rows(Store.open(path).num_rows, 0.05)
    return int(reader.epoch_order(train, 0, 0, 0, 1)[step * rows_per_step])


def test_a_second_run_into_a_locked_out_is_refused_naming_the_pid(store, tmp_path):
    from dflash.checkpoint import run_lock

    (tmp_path / "run").mkdir()
    held = run_lock(tmp_path / "run").acquire()  # as another live run would hold it
    try:
        with pytest.raises(DflashError, match=rf"in use by another dflash train \(process {os.getpid()} on "):
            run_training(config(store, tmp_path / "run", max_steps=2))
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
    finally:
        held.release()
    run_training(config(store, tmp_path / "run", max_steps=2))  # released: the folder is free again


def test_resume_skips_a_checkpoint_mixing_two_saves_or_cut_short(store, tmp_path, caplog):
    full = _curve(run_training(config(store, tmp_path / "full", max_steps=6, ckpt_every=2))["records"])
    run_training(config(store, tmp_path / "other", max_steps=6, ckpt_every=2, seed=1))
    run = tmp_path / "run"
    run_training(config(store, run, max_steps=6, ckpt_every=2))
    ckpts = run / "checkpoints"
    shutil.copy(tmp_path / "other" / "checkpoints" / "step_6" / "model.pt", ckpts / "step_6" / "model.pt")
    optimizer = ckpts / "step_4" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])  # a power loss's leftovers
    with caplog.at_level("WARNING", logger="dflash"):
        resumed = run_training(config(store, run, max_steps=6, ckpt_every=2, resume=True))["records"]
    assert "skipping checkpoint" in caplog.text and "step_6" in caplog.text and "step_4" in caplog.text
    assert _curve(resumed) == full[2:]  # from step_2, the newest checkpoint that loads
    # The rng file of another save (another run's) is caught by the save id alone.
    shutil.copy(tmp_path / "other" / "checkpoints" / "step_6" / "rng_rank0.pt", ckpts / "step_6" / "rng_rank0.pt")
    assert "another save" in Checkpointer(run).problem(ckpts / "step_6")
    for name in ("model.pt", "optimizer.pt", "state.json", "rng_rank0.pt"):
        (ckpts / "step_2" / name).write_bytes(b"")
    (ckpts / "step_4" / "state.json").write_bytes(b"")
    with pytest.raises(DflashError, match="has no checkpoint that loads .*remove its checkpoints folder"):
        run_training(config(store, run, max_steps=6, ckpt_every=2, resume=True))


def test_checkpoint_files_and_folder_are_flushed_before_the_rename(store, tmp_path, monkeypatch):
    from dflash import checkpoint

    synced, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def replace(src, dst):
        synced.append(("rename", str(src)))
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    run_training(config(store, tmp_path / "run", max_steps=2, ckpt_every=2))
    rename = next(i for i, s in enumerate(synced) if isinstance(s, tuple))
    tmp = synced[rename][1]
    before = set(synced[:rename])
    assert {f"{tmp}/{n}" for n in ("model.pt", "optimizer.pt", "state.json", "rng_rank0.pt")} | {tmp} <= before
    assert str(tmp_path / "run" / "checkpoints") in synced[rename + 1 :]


@pytest.mark.parametrize("error", ["ENOSPC", "EFBIG"])
def test_a_full_disk_while_saving_is_one_line_and_keeps_the_previous_checkpoint(error, store, tmp_path, monkeypatch):
    import errno

    from dflash import checkpoint

    real = checkpoint._write

    def write(path, obj):
        if path.name == "optimizer.pt" and "step_4" in str(path.parent):
            raise OSError(getattr(errno, error), os.strerror(getattr(errno, error)), str(path))
        return real(path, obj)

    monkeypatch.setattr(checkpoint, "_write", write)
    result = _train_cli(store, tmp_path / "run", "--max-steps", "4", "--ckpt-every", "2")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert "Traceback" not in result.output and len(errors) == 1, result.output
    assert os.strerror(getattr(errno, error)) in errors[0] and "step_2 is intact" in errors[0]
    assert str(tmp_path / "run" / "checkpoints") in errors[0]  # the disk, named by the folder
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_2"]
    assert Checkpointer(tmp_path / "run").problem(tmp_path / "run" / "checkpoints" / "step_2") is None


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_saves_a_checkpoint_and_the_resume_continues_the_curve(signame, store, tmp_path, monkeypatch):
    import signal

    full = _curve(run_training(config(store, tmp_path / "full", max_steps=6, log_every=2))["records"])
    commits, real = [0], reader.DeviceFeed.commit

    def commit(self):
        commits[0] += 1
        if commits[0] == 3:  # during step 3
            os.kill(os.getpid(), getattr(signal, signame))
        return real(self)

    monkeypatch.setattr(reader.DeviceFeed, "commit", commit)
    before = signal.getsignal(signal.SIGINT)
    result = _train_cli(
        store,
        tmp_path / "run",
        "--max-steps",
        "6",
        "--log-every",
        "2",
        "--val-fraction",
        "0.05",
        "--rows-per-step",
        "2",
    )
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are put back
    assert result.exit_code == 2, result.output
    assert f"stopped by {signame} after step 3 of 6" in result.output and "--resume" in result.output
    assert Checkpointer(tmp_path / "run").latest().name == "step_3"
    monkeypatch.setattr(reader.DeviceFeed, "commit", real)
    run_training(config(store, tmp_path / "run", max_steps=6, log_every=2, resume=True))
    assert _curve(_records(tmp_path / "run")) == full


def test_resume_refuses_another_store_naming_both(store, other_store, tmp_path):
    run_training(config(store, tmp_path / "run", max_steps=2))
    with pytest.raises(DflashError, match=rf"store {store} \(identity \w+\), but --shards {other_store} is another"):
        run_training(config(other_store, tmp_path / "run", max_steps=2, resume=True))


def test_a_run_killed_before_its_first_checkpoint_starts_again_on_resume(store, tmp_path, caplog):
    """Without --resume the earlier run's records are kept and the way on named; --resume (what a scheduler's
    requeue passes) starts it again from step 0, saying so, with the records of an uninterrupted run."""
    full = _curve(run_training(config(store, tmp_path / "full", max_steps=2))["records"])
    run_training(config(store, tmp_path / "run", max_steps=2))
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # killed before its first checkpoint
    with pytest.raises(DflashError, match="stopped before its first checkpoint; pass --resume to start it again"):
        run_training(config(store, tmp_path / "run", max_steps=2))
    assert [r["step"] for r in _records(tmp_path / "run")] == [1, 2]
    run_training(config(store, tmp_path / "run", max_steps=2, resume=True))
    assert "has no checkpoint (the run stopped before its first one): starting again from step 0" in caplog.text
    assert _curve(_records(tmp_path / "run")) == full
    assert [r["step"] for r in _records(tmp_path / "run", "val")] == [2]
    run_training(config(store, tmp_path / "fresh", max_steps=2, resume=True))  # --resume into a new --out: a start
    assert _curve(_records(tmp_path / "fresh")) == full


def test_resuming_a_finished_run_writes_no_second_final_validation(store, tmp_path):
    first = run_training(config(store, tmp_path / "run", max_steps=2))
    again = run_training(config(store, tmp_path / "run", max_steps=2, resume=True))
    assert [r["step"] for r in _records(tmp_path / "run", "val")] == [2]
    assert again["val"] == first["val"]


def test_a_torn_last_metrics_line_is_dropped_on_resume(store, tmp_path):
    full = _curve(run_training(config(store, tmp_path / "full", max_steps=4, ckpt_every=2))["records"])
    run_training(config(store, tmp_path / "run", max_steps=4, ckpt_every=2))
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_4")
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()[:3]) + '{"kind": "tra')
    run_training(config(store, tmp_path / "run", max_steps=4, ckpt_every=2, resume=True))
    assert _curve(_records(tmp_path / "run")) == full


def test_resume_gives_the_same_records_when_checkpoints_fall_between_log_steps(store, tmp_path):
    full = _curve(run_training(config(store, tmp_path / "full", max_steps=8, log_every=3, ckpt_every=4))["records"])
    run = tmp_path / "run"
    run_training(config(store, run, max_steps=8, log_every=3, ckpt_every=4))
    shutil.rmtree(run / "checkpoints" / "step_8")  # interrupted after step 4's checkpoint
    run_training(config(store, run, max_steps=8, log_every=3, ckpt_every=4, resume=True))
    assert [r[0] for r in full] == [3, 6, 8]
    assert _curve(_records(run)) == full


def test_a_damaged_row_stops_with_a_checkpoint_and_can_be_skipped(store, tmp_path):
    shards = _copy_store(store, tmp_path / "store")
    row = _row_of_step(shards, 2)  # read by step 3
    _corrupt_row(shards, row)
    with pytest.raises(DflashError, match=rf"row {row} .*stopped after step 2 with checkpoint .*step_2.*--resume"):
        run_training(config(shards, tmp_path / "run", max_steps=6))
    assert Checkpointer(tmp_path / "run").latest().name == "step_2"
    result = run_training(config(shards, tmp_path / "run", max_steps=6, resume=True, max_damaged_rows=1))
    assert result["damaged_rows"] == [row]
    records = _records(tmp_path / "run")
    assert [r["damaged_rows"] for r in records] == [0, 0, 1, 0, 0, 0]
    assert all(math.isfinite(r["loss"]) for r in records)


def test_a_skipped_row_gets_zero_loss_weight(store, tmp_path):
    """Skipping a row is training on its step's other row alone: same blocks, same loss as that row's."""
    shards = _copy_store(store, tmp_path / "store")
    row = _row_of_step(shards, 0)
    _corrupt_row(shards, row)
    cfg = config(shards, tmp_path / "run", max_damaged_rows=1, embedding="host")
    trainer = Trainer(cfg, init_distributed("cpu"))
    rows = trainer._reader(trainer.store, trainer.plan.steps(0, 1), trainer.shape)
    try:
        batch = rows.next()
        assert not batch.tensors["loss_mask"][0, 0].any() and (batch.tensors["doc_ids"][0, 0] == -1).all()
        assert not batch.tensors["token_embeds"][0, 0].any()
        assert batch.tensors["loss_mask"][0, 1].any()
        # the other row's token embeddings: its tokens' rows of the table
        embed, _ = load_embedding_and_head(trainer.target_path)
        torch.testing.assert_close(
            batch.tensors["token_embeds"][0, 1], embed.float()[batch.tensors["input_ids"][0, 1].long()], rtol=0, atol=0
        )
        batch.release()
    finally:
        rows.close()
    assert trainer.damaged.rows == [row]
    with pytest.raises(DflashError, match="the 1 damaged rows allowed are used up"):
        trainer.damaged.met(row + 1, DflashError("corrupt data"))


def test_a_damaged_held_out_row_does_not_cost_the_export(store, tmp_path):
    shards = _copy_store(store, tmp_path / "store")
    _, val_rows = reader.split_rows(Store.open(shards).num_rows, 0.05)
    _corrupt_row(shards, int(val_rows[0]))
    with pytest.raises(DflashError, match=f"row {int(val_rows[0])} "):
        run_training(config(shards, tmp_path / "run", max_steps=2, export=True))
    assert (tmp_path / "run" / "drafter" / "model.safetensors").exists()
    assert Checkpointer(tmp_path / "run").latest().name == "step_2"
    result = run_training(config(shards, tmp_path / "skip", max_steps=2, max_damaged_rows=1))
    assert result["damaged_rows"] == [int(val_rows[0])] and result["val"]["damaged_rows"] == 1


@pytest.mark.parametrize("case", ["file", "inside_store", "unwritable"])
def test_a_bad_out_is_one_line_before_any_work(case, store, tmp_path):
    if case == "file":
        out = tmp_path / "run"
        out.write_text("not a folder")
        expected = f"--out {out} is a file"
    elif case == "inside_store":
        shards = _copy_store(store, tmp_path / "store")
        out, expected = shards / "run", "is inside the store"
        before = sorted(p.name for p in shards.iterdir())
    else:
        (tmp_path / "file").write_text("")
        out, expected = tmp_path / "file" / "run", "cannot write to --out"
    result = _train_cli(shards if case == "inside_store" else store, out)
    assert result.exit_code == 2, result.output
    assert expected in result.output and len(result.output.strip().splitlines()) == 1, result.output
    if case == "inside_store":
        assert sorted(p.name for p in shards.iterdir()) == before


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(store, tmp_path):
    """The ranks agree on a stop at log steps: a SIGTERM to rank 1 alone ends both with one checkpoint."""
    import signal

    args = ["-m", "cli", "train", "--shards", str(store), "--out", str(tmp_path / "ranks"), "--draft-layers", "1"]
    args += ["--block-size", str(B), "--max-steps", "400", "--log-every", "5", "--rows-per-step", "1"]
    args += ["--no-tensorboard", "--no-export", "--device", "cpu", "--reader-workers", "1"]
    procs = _start_two_ranks(args)
    metrics, deadline = tmp_path / "ranks" / "metrics.jsonl", time.time() + 180
    while not (metrics.exists() and metrics.read_text().strip()) and time.time() < deadline:
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outputs
    assert "stopped by a signal to another rank after step" in outputs[0], outputs[0]
    assert "stopped by SIGTERM after step" in outputs[1] and "--resume" in outputs[1], outputs[1]
    checkpoint = Checkpointer(tmp_path / "ranks", 0, 2).latest()
    assert int(checkpoint.name.removeprefix("step_")) % 5 == 0 and not checkpoint.name.endswith("_400")
    assert Checkpointer(tmp_path / "ranks", 0, 2).problem(checkpoint) is None


def test_a_damaged_held_out_row_in_a_mid_run_validation_stops_with_a_checkpoint(store, tmp_path):
    shards = _copy_store(store, tmp_path / "store")
    _, val_rows = reader.split_rows(Store.open(shards).num_rows, 0.05)
    _corrupt_row(shards, int(val_rows[0]))
    with pytest.raises(DflashError, match=r"stopped after step 2 with checkpoint .*step_2.*--resume"):
        run_training(config(shards, tmp_path / "run", max_steps=4, val_every=2))
    assert Checkpointer(tmp_path / "run").latest().name == "step_2"


def test_a_damaged_row_on_one_of_two_ranks_stops_both_with_a_checkpoint(store, tmp_path):
    shards = _copy_store(store, tmp_path / "store")
    train, _ = reader.split_rows(Store.open(shards).num_rows, 0.05)
    row = int(reader.epoch_order(train, 0, 0, 1, 2)[2])  # rank 1's third step
    _corrupt_row(shards, row)
    args = ["-m", "cli", "train", "--shards", str(shards), "--out", str(tmp_path / "ranks"), "--draft-layers", "1"]
    args += ["--block-size", str(B), "--max-steps", "8", "--log-every", "2", "--rows-per-step", "1"]
    args += ["--no-tensorboard", "--no-export", "--device", "cpu", "--reader-workers", "1", "--val-fraction", "0.05"]
    procs = _start_two_ranks(args)
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outputs
    assert "another rank met a damaged row" in outputs[0], outputs[0]
    assert f"row {row} " in outputs[1] and "--max-damaged-rows" in outputs[1], outputs[1]
    checkpoint = Checkpointer(tmp_path / "ranks", 0, 2).latest()
    assert (
        checkpoint.name in ("step_2", "step_4") and Checkpointer(tmp_path / "ranks", 0, 2).problem(checkpoint) is None
    )


def test_an_interrupt_before_the_first_step_is_one_line(store, tmp_path, monkeypatch):
    import dflash.train_run

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(dflash.train_run, "run_training", interrupted)
    result = _train_cli(store, tmp_path / "run")
    assert result.exit_code == 130 and "Traceback" not in result.output, result.output
    assert "interrupted without a new checkpoint" in result.output and "--resume" in result.output


def test_a_store_that_failed_its_self_check_is_refused_unless_allowed(store, tmp_path):
    failed = _copy_store(store, tmp_path / "failed")
    manifest = json.loads((failed / "manifest.json").read_text())
    assert manifest["self_check"]["passed"], "the harvest's own check passed on this store"
    manifest["self_check"]["passed"] = False
    (failed / "manifest.json").write_text(json.dumps(manifest))
    result = _train_cli(failed, tmp_path / "run")
    assert result.exit_code == 2 and "failed its check against the target" in result.output, result.output
    assert "--allow-failed-self-check" in result.output
    run_training(config(failed, tmp_path / "allowed", max_steps=1, allow_failed_self_check=True))


def test_a_val_fraction_that_leaves_no_step_is_named(store, tmp_path):
    rows = Store.open(store).num_rows
    assert rows >= 4  # a step of half the store fits without held-out rows
    with pytest.raises(DflashError, match=rf"--val-fraction 0.9 holds out \d+ of its {rows} rows"):
        run_training(config(store, tmp_path / "run", val_fraction=0.9, rows_per_step=rows // 2))


def test_drafter_options_cannot_override_what_the_store_fixes(store, tmp_path):
    for key, value in (("target_layer_ids", [2, 3, 4, 5, 6]), ("block_size", 8), ("hidden_size", 128)):
        with pytest.raises(DflashError, match=rf"--drafter-option cannot set {key}: the store fixes them"):
            run_training(config(store, tmp_path / key, drafter_overrides={key: value}))


def test_a_run_whose_export_folder_holds_other_files_is_refused_before_training(store, tmp_path):
    (tmp_path / "run" / "drafter").mkdir(parents=True)
    (tmp_path / "run" / "drafter" / "notes.txt").write_text("mine")
    with pytest.raises(DflashError, match="notes.txt"):
        run_training(config(store, tmp_path / "run", export=True))
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------- per data source


def test_source_sums_equal_a_loop_over_the_blocks():
    from dflash.metrics import source_sums

    accepted = torch.tensor([1, 4, 0, 3, 1, 6])
    losses = torch.tensor([0.5, 1.5, 0.0, 2.0, 0.25, 1.0], dtype=torch.float64)
    sources = torch.tensor([1, 0, 1, 1, 2, 0])
    expected = [[0.0] * 3 for _ in range(2)]
    for a, loss_sum, s in zip(accepted.tolist(), losses.tolist(), sources.tolist()):
        expected[0][s] += a
        expected[1][s] += loss_sum
    assert source_sums([accepted, losses], sources, 3).tolist() == expected[0] + expected[1]


@pytest.fixture(scope="module")
def two_source_store(target, tmp_path_factory):
    """The corpus's text records as two sources: its first half and its second half (as Parquet)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("two-sources")
    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines() if '"text"' in line]
    half = len(texts) // 2
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:half]))
    pq.write_table(pa.table({"text": texts[half:]}), folder / "b.parquet")
    out = folder / "store"
    data = [str(folder / "a.jsonl"), str(folder / "b.parquet")]
    run_harvest(HarvestConfig(model=str(target), data=data, out=str(out), token_budget=64, workers=1))
    return out, texts[:half], texts[half:]


def test_a_store_of_two_sources_records_each_documents_source(two_source_store, target):
    """document_sources[doc id] is the source whose text the document's tokens hold (checked by decoding)."""
    from dflash.data import load_tokenizer

    out, first, second = two_source_store
    shards = Store.open(out)
    assert [s["source"] for s in shards.manifest.sources] == [
        str(Path(out).parent / n) for n in ("a.jsonl", "b.parquet")
    ]
    tokenizer = load_tokenizer(str(target))
    checked = set()
    for row in range(shards.num_rows):
        arrays = shards.read_row(row)
        for doc in np.unique(arrays["doc_ids"][arrays["doc_ids"] >= 0]).tolist():
            text = tokenizer.decode(arrays["input_ids"][arrays["doc_ids"] == doc].tolist())
            source = int(shards.document_sources[doc])
            assert any(text[:40] in t for t in (first, second)[source]), (doc, source, text[:40])
            checked.add(source)
    assert checked == {0, 1}


def test_training_reports_the_accept_length_of_each_source(two_source_store, tmp_path):
    """Per source, train and validation records hold the loss, accept length, blocks and loss weight of that
    source's documents; together they are the record's: blocks and weights add up, and the block-weighted accept
    length and weight-weighted loss are the record's."""
    out, _, _ = two_source_store
    run_training(config(out, tmp_path / "run", max_steps=4, log_every=2, val_fraction=0.2))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    names = [s["source"] for s in Store.open(out).manifest.sources]
    kinds = set()
    for record in (r for r in records if r["kind"] in ("train", "val")):
        per_source = record["sources"]
        assert set(per_source) <= set(names) and per_source
        assert sum(s["blocks"] for s in per_source.values()) == record["blocks"]
        mean = sum(s["accept_len"] * s["blocks"] for s in per_source.values()) / record["blocks"]
        assert mean == pytest.approx(record["accept_len"], rel=1e-9)
        weight = sum(s["weight"] for s in per_source.values())
        assert sum(s["loss"] * s["weight"] for s in per_source.values()) / weight == pytest.approx(
            record["loss"], rel=1e-5
        )
        assert all(s["loss"] > 0 for s in per_source.values())
        kinds.add(record["kind"])
    assert kinds == {"train", "val"}
    assert any(len(r["sources"]) == 2 for r in records if "sources" in r)


def test_a_held_out_store_reports_its_own_sources(store, two_source_store, tmp_path):
    """Validation on a --val-shards store reports that store's sources, whatever the training store holds: two
    sources under a one-source training store, none under a two-source one."""
    two, _, _ = two_source_store
    for train_store, val_store, train_sources, val_sources in ((store, two, 0, 2), (two, store, 2, 0)):
        out = tmp_path / f"run-{val_sources}"
        run_training(config(train_store, out, max_steps=2, log_every=1, val_every=2, val_store=str(val_store)))
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        by_kind = {kind: [r for r in records if r["kind"] == kind] for kind in ("train", "val")}
        assert by_kind["train"] and by_kind["val"]
        assert all(len(r.get("sources", {})) <= train_sources for r in by_kind["train"])
        assert any(len(r.get("sources", {})) == train_sources for r in by_kind["train"])
        for record in by_kind["val"]:
            assert len(record.get("sources", {})) == val_sources
            if val_sources:
                assert sum(s["blocks"] for s in record["sources"].values()) == record["blocks"]


def test_a_one_source_store_has_no_per_source_metrics(store, tmp_path):
    assert Store.open(store).document_sources is None
    run_training(config(store, tmp_path / "run", max_steps=2, log_every=1))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records and not any("sources" in r for r in records)


# ---------------------------------------------------------------------------------------------- faults (issue 26)


class _DiskFullAfter(io.RawIOBase):
    """A file that takes `lines` lines, then fails every write with ENOSPC as a full disk does (what is still
    buffered fails again at close)."""

    def __init__(self, real, lines: int):
        self.real, self.lines = real, lines

    name = property(lambda self: self.real.name)

    def writable(self):
        return True

    def write(self, data):
        import errno

        if self.lines <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.lines -= bytes(data).count(b"\n")
        return self.real.write(data)


def test_a_full_disk_while_writing_metrics_is_one_line_and_resumes_exactly(store, tmp_path, monkeypatch):
    full = _curve(run_training(config(store, tmp_path / "full", max_steps=6, ckpt_every=2))["records"])
    real_open = Path.open

    def open_metrics(self, mode="r", *args, **kwargs):
        if self.name != "metrics.jsonl" or mode != "a":
            return real_open(self, mode, *args, **kwargs)
        return io.TextIOWrapper(io.BufferedWriter(_DiskFullAfter(real_open(self, "ab", buffering=0), lines=3)))

    monkeypatch.setattr(Path, "open", open_metrics)
    args = (
        "--max-steps",
        "6",
        "--ckpt-every",
        "2",
        "--log-every",
        "1",
        "--rows-per-step",
        "2",
        "--val-fraction",
        "0.05",
    )
    result = _train_cli(store, tmp_path / "run", *args)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and "Traceback" not in result.output and len(errors) == 1, result.output
    assert "writing metrics.jsonl failed: No space left on device" in errors[0] and "--resume" in errors[0]
    monkeypatch.setattr(Path, "open", real_open)
    run_training(config(store, tmp_path / "run", max_steps=6, ckpt_every=2, resume=True))
    assert _curve(_records(tmp_path / "run")) == full


def test_a_full_disk_inside_torch_save_is_one_line_and_keeps_the_previous_checkpoint(store, tmp_path, monkeypatch):
    """torch.save turns its file's OSError into a RuntimeError of its own: the disk's error is still the one named."""
    import errno

    from dflash import checkpoint

    class SecondWriteFails(io.FileIO):  # torch.save reports a failure of its second write as "unexpected pos"
        writes = 0

        def write(self, data):
            self.writes += 1
            if self.writes == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(data)

    def open_(path, mode="r", *args, **kwargs):
        if path.name == "model.pt" and "step_4" in path.parent.name:
            return SecondWriteFails(path, "wb")
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "open", open_, raising=False)
    result = _train_cli(store, tmp_path / "run", "--max-steps", "4", "--ckpt-every", "2")
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and "Traceback" not in result.output and len(errors) == 1, result.output
    assert "writing checkpoint step_4 failed: No space left on device" in errors[0] and "step_2 is intact" in errors[0]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_2"]


def test_a_damaged_held_out_row_mid_run_keeps_every_record_exact_across_the_resume(store, tmp_path):
    """The step's train record is written before the stop, its checkpoint holds no sums of steps already recorded,
    and the resume runs the validation that failed: the records are those of a run on the repaired store."""
    options = dict(max_steps=6, val_every=2, log_every=2)
    full = run_training(config(store, tmp_path / "full", **options))["records"]
    val_full = [(r["step"], r["loss"], r["tau"]) for r in _records(tmp_path / "full", "val")]
    shards = _copy_store(store, tmp_path / "store")
    _, val_rows = reader.split_rows(Store.open(shards).num_rows, 0.05)
    backup = _copy_store(shards, tmp_path / "backup")
    _corrupt_row(shards, int(val_rows[0]))
    with pytest.raises(DflashError, match=r"stopped after step 2 with checkpoint"):
        run_training(config(shards, tmp_path / "run", **options))
    assert [r["step"] for r in _records(tmp_path / "run")] == [2]
    shutil.rmtree(shards)
    shutil.copytree(backup, shards)  # repaired
    run_training(config(shards, tmp_path / "run", **options, resume=True))
    assert _curve(_records(tmp_path / "run")) == _curve(full)
    assert [(r["step"], r["loss"], r["tau"]) for r in _records(tmp_path / "run", "val")] == val_full


def test_a_cpu_run_past_the_available_memory_is_refused_before_any_model_is_built(store, tmp_path, monkeypatch):
    """With a tiny MemAvailable the defaults are refused before the embedding is read or the drafter made, naming the
    --anchors that fit; those anchors then train under the same memory."""
    from dflash import memory, train

    env = init_distributed("cpu")
    estimates = {a: Trainer(config(store, tmp_path / f"e{a}", anchors=a, rows_per_step=1), env) for a in (4, 11)}
    estimates = {a: trainer.memory_estimate for a, trainer in estimates.items()}
    available = (estimates[4] + estimates[11]) // 2
    (tmp_path / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available // 1024} kB\n")
    monkeypatch.setattr(memory, "MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(memory, "CGROUP", tmp_path / "no-cgroup")
    real_load = train.load_frozen
    monkeypatch.setattr(train, "load_frozen", lambda *a: pytest.fail("the target's tensors were read"))
    result = _train_cli(store, tmp_path / "run", "--anchors", "11")
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and "Traceback" not in result.output and len(errors) == 1, result.output
    assert "available to this process (MemAvailable; 90% of it counts)" in errors[0] and "(11 now)" in errors[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "checkpoints").exists()
    anchors = int(errors[0].split("--anchors ")[1].split()[0])
    assert 4 <= anchors < 11
    monkeypatch.setattr(train, "load_frozen", real_load)
    assert _train_cli(store, tmp_path / "fits", "--anchors", str(anchors)).exit_code == 0
    assert _train_cli(store, tmp_path / "ignored", "--anchors", "11", "--ignore-memory-estimate").exit_code == 0


def test_a_held_out_store_of_the_same_target_read_from_another_path_is_accepted(store, other_store, tmp_path):
    val = _copy_store(other_store, tmp_path / "val")
    manifest = json.loads((val / "manifest.json").read_text())
    tokenizer = {**manifest["tokenizer"], "name": "/elsewhere/a-copy-of-the-target"}
    _manifest_edit(val, tokenizer=tokenizer)
    run_training(config(store, tmp_path / "run", max_steps=1, val_store=str(val)))
    _manifest_edit(val, tokenizer={**tokenizer, "special_ids": {**tokenizer["special_ids"], "eos": 5}})
    with pytest.raises(DflashError, match=r"differs from the training store in tokenizer \(vocabulary size or special"):
        run_training(config(store, tmp_path / "other", max_steps=1, val_store=str(val)))


def test_a_finished_run_resumed_says_so_before_any_work_and_cannot_be_extended(store, tmp_path, monkeypatch, caplog):
    caplog.set_level("INFO", logger="dflash")
    first = run_training(config(store, tmp_path / "run", max_steps=2, export=True))
    weights = (tmp_path / "run" / "drafter" / "model.safetensors").read_bytes()
    monkeypatch.setattr(Trainer, "prepare", lambda *a: pytest.fail("a finished run warmed up"))
    again = run_training(config(store, tmp_path / "run", max_steps=2, export=True, resume=True))
    assert "finished all its 2 steps (checkpoint step_2): nothing left to train" in caplog.text
    assert again["val"] == first["val"] and again["export"] == first["export"] and again["finished"]
    assert (tmp_path / "run" / "drafter" / "model.safetensors").read_bytes() == weights  # exported again, the same
    with pytest.raises(DflashError, match=r"max_steps: checkpoint 2, now 4.*cannot be extended or shortened exactly"):
        run_training(config(store, tmp_path / "run", max_steps=4, resume=True))
