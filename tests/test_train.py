"""The trainer on the CPU: label alignment, validation's replay of decoding, compiled against eager, resume.

Every run trains from a real store: a tiny harvest of the bundled corpus (rows of 64 tokens) by the tiny Qwen3
target (conftest.py); the alignment tests rewrite its arrays with features that make the labels knowable.
"""

import dataclasses
import logging
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
import zarr
from devices import CPU_AND_CUDA
from torch.nn.attention.flex_attention import create_block_mask
from train_support import METHOD_OPTIONS, B, assert_same_validation, config

from dflash.config import TrainConfig
from dflash.drafter import DFlashDrafter, blocks, graph
from dflash.drafter.attention import default_mask_tile
from dflash.drafter.flops import visible_pairs
from dflash.errors import DflashError
from dflash.export import load_drafter
from dflash.store import Store, record_digests
from dflash.target_files import load_embedding_and_head
from dflash.train import Trainer, reader
from dflash.train.checkpoint import Checkpointer, fingerprint
from dflash.train.run import run_training
from dflash.train.setup import init_distributed

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
    record_digests(dst)  # rewritten through zarr: not the chunks the harvest wrote


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


def test_a_second_compiled_run_in_one_process_is_not_held_to_the_first_ones_compiles(store, tmp_path):
    """Each drafter's forward recompiles the same code object. With dynamo's recompile limit at what one run
    needs, a second compiled run in the process (another drafter, as tests and benchmarks make) still compiles:
    the trainer drops the earlier run's code first, instead of failing its whole-graph compile at the limit."""
    forward = DFlashDrafter.forward.__code__
    entries = lambda: len(torch._dynamo.eval_frame._debug_get_cache_entry_list(forward))  # noqa: E731
    first = run_training(config(store, tmp_path / "first", max_steps=2, compile=True))
    one_run = entries()
    assert one_run >= 1 and [r["recompiles"] for r in first["records"]] == [0, 0]
    with torch._dynamo.config.patch(recompile_limit=one_run):
        second = run_training(config(store, tmp_path / "second", max_steps=2, compile=True, draft_layers=2))
    assert entries() == one_run and [r["recompiles"] for r in second["records"]] == [0, 0]


def test_recompile_is_an_error_naming_the_cause():
    f = graph.compile_fn(lambda x: x * 2, True)
    f(torch.ones(3))
    with pytest.raises(DflashError, match="size mismatch"):
        with graph.no_recompiles():
            f(torch.ones(4))


def test_a_recompile_names_the_pytree_types_registered_since_the_compiles_began():
    """On the H100 a pointwise FLASH step recompiled after its registry guard went stale; the error now says
    which types a package added, and says nothing of them where none was added."""

    @dataclasses.dataclass
    class LateNode:
        value: torch.Tensor

    graph.forget_compiled_code()
    f = graph.compile_fn(lambda x: x * 2, True)
    f(torch.ones(3))
    with pytest.raises(DflashError) as before:
        with graph.no_recompiles():
            f(torch.ones(4))
    assert "pytree" not in str(before.value)
    pytree.register_dataclass(LateNode)
    try:
        with pytest.raises(DflashError, match=r"pytree registry gained .*LateNode.*import the module"):
            with graph.no_recompiles():
                f(torch.ones(5))
    finally:
        pytree._deregister_pytree_node(LateNode)
    assert graph.pytree_types_registered_since_reset() == []


GUARDED = 1  # read by the compiled step below: dynamo guards on its value


@pytest.mark.parametrize("settled", [False, True])
def test_settle_takes_a_recompile_that_a_later_compile_causes_into_warmup(monkeypatch, caplog, settled):
    """The validation step's first call voids the train step's guard (as a package registering a pytree type
    while it compiles would): settled, the train step recompiles in warmup and not in the first later call."""
    compiled = graph.compile_fn(lambda x: x * GUARDED, True)

    def validation_step():
        monkeypatch.setattr(sys.modules[__name__], "GUARDED", 2)

    graph.forget_compiled_code()
    start = graph.compiled_graphs()
    train, val = (
        graph.GraphedStep(fn, device=torch.device("cpu"), cuda_graph=False, hint="")
        for fn in (lambda: compiled(torch.ones(3)), validation_step)
    )
    train.warmup()
    val.warmup(1)
    if settled:
        with caplog.at_level(logging.INFO, logger="dflash"):
            assert graph.settle(train, val) == 1
        assert "warmup: 1 graph(s) compiled again once every step had compiled" in caplog.text
    compiles = graph.compiled_graphs()
    if not settled:
        with pytest.raises(DflashError, match="GUARDED"):
            with graph.no_recompiles():
                train()
        return
    with graph.no_recompiles():
        train()
    assert compiles - start == 2 and graph.compiled_graphs() == compiles  # the first trace and warmup's recompile


def test_settle_runs_another_round_while_any_rank_compiled():
    """Every rank runs the same rounds: one whose steps compiled nothing goes on while another rank's did (their
    steps' collectives would wait for it otherwise), and stops at the limit."""
    calls = []
    step = graph.GraphedStep(lambda: calls.append(1), device=torch.device("cpu"), cuda_graph=False, hint="")
    assert graph.settle(step, rounds=3, on_any_rank=lambda compiled: True) == 0 and len(calls) == 3
    calls.clear()
    assert graph.settle(step, rounds=3) == 0 and len(calls) == 1


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


def test_kernel_options_and_mask_tiles_reach_the_step_and_keep_the_curve(store, tmp_path, caplog):
    # The GPU's mask function builds BlockMasks of the chosen tiles (test_attention_kernels); the CPU step takes
    # the dense mask, where neither option can change a value.
    options = {"bwd_num_warps": 8, "USE_TMA": True}
    cfg = config(store, tmp_path / "tuned", max_steps=3, attention_kernel_options=options, mask_tile_size=16)
    with caplog.at_level(logging.WARNING, logger="dflash"):
        trainer = Trainer(cfg, init_distributed("cpu"))
    assert all(layer.self_attn.kernel_options == options for layer in trainer.model.layers)
    assert trainer.mask_tile == 16
    # Neither passes in silence on the CPU, where they cannot act.
    assert "--mask-tile-size 16 tiles the BlockMask" in caplog.text and "--attention-kernel-option" in caplog.text
    assert "--cuda-graph" not in caplog.text  # not given: nothing to name
    with caplog.at_level(logging.WARNING, logger="dflash"):
        Trainer(config(store, tmp_path / "graphed", max_steps=3, cuda_graph=True), init_distributed("cpu"))
    assert "--cuda-graph captures the step on a GPU" in caplog.text
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


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_captured_call_replays_each_signature_and_returns_copies(device):
    """CapturedCall (the eval's fixed-shape drafting): every call returns fn of that call's inputs, as copies that
    the next call does not overwrite; a non-tensor argument is part of the signature; a caller whose shapes keep
    changing gets a DflashError instead of a capture per call."""

    def fn(x, scale, bias):
        out = x.cumsum(0) * scale
        return (out, None) if bias is None else (out, out + bias)

    graph.forget_compiled_code()
    call = graph.CapturedCall(fn, torch.device(device), max_signatures=3)
    xs = [torch.randn(5, 3, generator=torch.Generator().manual_seed(s)).to(device) for s in range(3)]
    bias = torch.arange(3.0, device=device)
    first, no_bias = call(xs[0], 2.0, bias), call(xs[1], 2.0, None)
    second = call(xs[2], 2.0, bias)
    for got, x, b in [(first, xs[0], bias), (no_bias, xs[1], None), (second, xs[2], bias)]:
        torch.testing.assert_close(got[0], x.cumsum(0) * 2)
        assert (got[1] is None) == (b is None) and (b is None or torch.allclose(got[1], got[0] + b))
    assert first[0].data_ptr() != second[0].data_ptr()
    torch.testing.assert_close(call(xs[0], 3.0, bias)[0], xs[0].cumsum(0) * 3)  # a third signature
    with pytest.raises(DflashError, match="must keep their shapes"):
        call(torch.ones(4, 3, device=device), 2.0, bias)
