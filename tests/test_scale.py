"""The bookkeeping at scale: what startup and a harvest resume cost must not grow with the store's rows or the
data's documents (bench/startup.py measures it at a million); here, that the fast paths give the old results."""

import json

import numpy as np
import pytest

from dflash import store
from dflash.data import Document
from dflash.errors import DflashError
from dflash.manifest import TargetSpec, TokenizerSpec
from dflash.packing import PartPlan, first_fit_decreasing
from dflash.train import reader

T, W = 16, 8


def header():
    return store.new_manifest(
        target=TargetSpec("m", "qwen3", "hash", num_layers=2, hidden_size=W, vocab_size=100),
        layer_ids=[1],
        token_budget=T,
        tokenizer=TokenizerSpec("m", 100, {"mask": 99}),
        fingerprint={"model": "m", "token_budget": T, "world_size": 1},
    )


def part_spec(rows: int, docs: int) -> store.PartSpec:
    """A part of `rows` rows holding `docs` documents of one token each (the table is all that differs)."""
    documents = np.zeros((docs, 5), np.int64)
    documents[:, 0], documents[:, 2], documents[:, 4] = np.arange(docs), np.arange(docs) % rows, 1
    counts = {"documents": docs, "tokens": docs, "loss_tokens": docs, "padding_tokens": rows * T - docs}
    return store.PartSpec(0, rows, T, header().features, documents, counts)


def write_row(part: store.PartWriter, row: int) -> None:
    tokens = {name: np.zeros((1, T), dtype) for name, dtype in store.TOKEN_ARRAYS.items()}
    part.write_rows(row, np.ones((1, T, W), np.uint16), tokens)


def sparse_store(out, rows: int, docs: int, written=()) -> None:
    """A complete store of `rows` rows whose row chunks exist only for `written`: reading any other row fails."""
    store.create_store(out, header())
    part = store.PartWriter(out, part_spec(rows, docs))
    for row in written:
        write_row(part, row)
    part.commit(rows)
    assert store.finalize(out, header(), check_chunks=False)  # the rows' chunks are missing on purpose


def test_open_and_plan_read_no_chunk_of_a_large_store(tmp_path):
    """Opening a million-row store and planning its first step read only the manifest and the arrays' metadata:
    no row chunk exists and the documents table's chunks are garbage; then the first step's rows are written."""
    out = tmp_path / "s"
    sparse_store(out, rows=1_000_000, docs=1_000_000)
    for array in (out / "parts" / "rank00000").iterdir():
        assert not (array / "c").exists() or array.name == "documents"
    for chunk in (out / "parts" / "rank00000" / "documents" / "c").rglob("*"):
        if chunk.is_file():  # not even the documents table is read (open only checks that its chunks exist)
            chunk.write_bytes(b"never read")
    opened = store.Store.open(out)
    train, val = reader.split_rows(opened.num_rows, 0.01)
    rows, _ = next(reader.DataPlan(train, val, 2, 0, 0, 1).steps(0, 1))
    with pytest.raises(DflashError, match="chunk file missing"):
        opened.read_row(int(rows[0]))
    part = store.PartWriter(out, part_spec(1_000_000, 1_000_000))
    for row in rows:
        write_row(part, int(row))
    assert all(store.Store.open(out).read_row(int(row))["hidden"].all() for row in rows)


def test_manifest_and_progress_do_not_grow_with_documents(tmp_path):
    sizes = {}
    for docs in (10, 200_000):
        out = tmp_path / f"s{docs}"
        sparse_store(out, rows=docs, docs=docs)
        progress = out / "parts" / "rank00000" / store.PROGRESS_FILE
        sizes[docs] = ((out / store.MANIFEST_FILE).stat().st_size, progress.stat().st_size)
    # only the digits of the counts differ (5 numbers in the manifest, its 2 copies of the counts, progress)
    assert sizes[200_000][0] - sizes[10][0] < 64 and sizes[200_000][1] - sizes[10][1] < 32
    assert json.loads((tmp_path / "s200000" / store.MANIFEST_FILE).read_text())["parts"][0]["documents"] == 200_000


@pytest.mark.parametrize("committed", [0, 3, 5])
def test_a_resume_drops_unfinished_writes_of_uncommitted_rows_without_walking_committed_ones(tmp_path, committed):
    """A part resumed after `committed` rows: leftovers of rows from there on go (all rows of a finished part,
    which is opened only to repair it); committed rows' folders are not walked, so one there would stay."""
    out = tmp_path / "s"
    sparse_store(out, rows=5, docs=5, written=range(5))
    progress = out / "parts" / "rank00000" / store.PROGRESS_FILE
    progress.write_text(json.dumps({**json.loads(progress.read_text()), "rows_committed": committed}))
    folder = out / "parts" / "rank00000"
    planted = {
        row: [
            folder / "hidden" / "c" / str(row) / "0" / "0.abc.partial",
            folder / "loss_mask" / "c" / str(row) / "0.abc.partial",
        ]
        for row in range(5)
    }
    for paths in planted.values():
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"half a chunk")
    store.PartWriter(out, part_spec(5, 5))
    first = committed if committed < 5 else 0
    for row, paths in planted.items():
        assert [p.exists() for p in paths] == [row < first] * 2, row
    assert (folder / "hidden" / "c" / "4" / "0" / "0").exists()  # chunks themselves stay


def test_split_and_epoch_order_equal_the_sorting_reference():
    """The mask-based split and the rank-only gather give the arrays of the former sort and full gather."""
    for n, fraction in ((1, 0.0), (2, 0.5), (97, 0.05), (10_000, 0.01), (5000, 0.0)):
        train, val = reader.split_rows(n, fraction)
        n_val = len(val)
        perm = np.random.default_rng(0x5D1F).permutation(n)
        assert np.array_equal(train, np.sort(perm[n_val:])) and np.array_equal(val, np.sort(perm[:n_val]))
        assert train.dtype == val.dtype == np.sort(perm).dtype
        for world_size in (1, 3):
            for rank in range(world_size):
                full = train[np.random.default_rng([7, 2]).permutation(len(train))]
                per_rank = len(train) // world_size
                expected = full[rank : per_rank * world_size : world_size]
                assert np.array_equal(reader.epoch_order(train, 7, 2, rank, world_size), expected)


def naive_first_fit_decreasing(lengths, capacity):
    rows, free = [], []
    for item in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        row = next((r for r, room in enumerate(free) if room >= lengths[item]), len(rows))
        if row == len(rows):
            rows.append([])
            free.append(capacity)
        rows[row].append(item)
        free[row] -= lengths[item]
    return rows


def test_first_fit_decreasing_equals_the_naive_one_with_runs_of_equal_lengths():
    rng = np.random.default_rng(3)
    for _ in range(400):
        capacity = int(rng.integers(1, 30))
        choices = rng.integers(0, capacity + 1, int(rng.integers(1, 4)))  # few distinct lengths: long runs
        lengths = rng.choice(choices, int(rng.integers(0, 80))).tolist()
        assert first_fit_decreasing(lengths, capacity) == naive_first_fit_decreasing(lengths, capacity), lengths
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([3, 11], 10)


def test_part_plan_arrays_equal_the_per_document_reference():
    rng = np.random.default_rng(5)
    docs = []
    for i in range(300):
        n = int(rng.integers(1, 40))
        docs.append(Document(i // 2, i % 2, rng.integers(0, 100, n).astype(np.int32), rng.integers(0, 2, n, np.uint8)))
    plan = PartPlan.build(docs, 1, 2, 64)
    starts = [np.cumsum([0] + [len(plan.docs[d].input_ids) for d in row[:-1]]).tolist() for row in plan.rows]
    table = [
        (plan.docs[d].doc_id, plan.docs[d].piece, r, start, len(plan.docs[d].input_ids))
        for r, (row, row_starts) in enumerate(zip(plan.rows, starts))
        for d, start in zip(row, row_starts)
    ]
    tokens = sum(len(d.input_ids) for d in plan.docs)
    assert plan.starts == starts
    assert plan.documents_table().dtype == np.int64 and plan.documents_table().tolist() == [list(t) for t in table]
    assert plan.counts() == {
        "documents": len(plan.docs),
        "tokens": tokens,
        "loss_tokens": sum(int(d.loss_mask.sum()) for d in plan.docs),
        "padding_tokens": len(plan.rows) * 64 - tokens,
    }
    assert PartPlan.build([], 0, 1, 64).documents_table().shape == (0, 5)
