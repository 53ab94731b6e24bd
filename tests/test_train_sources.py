"""The trainer's metrics per data source of a store of several."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from train_support import config

from dflash.config import HarvestConfig
from dflash.harvest import run_harvest
from dflash.store import Store
from dflash.tiny import CORPUS
from dflash.train.run import run_training

# ---------------------------------------------------------------------------------------------- per data source


def test_source_sums_equal_a_loop_over_the_blocks():
    from dflash.train.metrics import source_sums

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
