"""The store on its own, with synthetic rows: round trip across parts and chunks, resume bookkeeping, refusals,
corruption detection. (End-to-end harvests are in test_harvest.py.)"""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import zarr
from harvest_support import swap_files

from dflash import store
from dflash.errors import DflashError
from dflash.manifest import FeatureSpec, TargetSpec, TokenizerSpec
from dflash.packing import first_fit_decreasing
from dflash.store import reader as store_reader
from dflash.store import verify
from dflash.store import writer as store_writer
from dflash.train import reader

T, F = 32, 24
BF16 = FeatureSpec("bf16", F, 0, None)


def synthetic_part(rank: int, rows: int, seed: int, zero_padding: bool = True):
    """A PartSpec and row contents; each row holds one document filling `rank + 20` tokens."""
    rng = np.random.default_rng(seed)
    length = rank + 20
    hidden = rng.integers(0, 2**16, size=(rows, T, F), dtype=np.uint16)
    if zero_padding:
        hidden[:, length:] = 0
    tokens = {name: np.zeros((rows, T), dtype) for name, dtype in store.TOKEN_ARRAYS.items()}
    tokens["input_ids"][:, :length] = rng.integers(0, 1000, size=(rows, length))
    tokens["position_ids"][:, :length] = np.arange(length)
    tokens["doc_ids"][:] = -1
    tokens["doc_ids"][:, :length] = (np.arange(rows) * 2 + rank)[:, None]
    tokens["loss_mask"][:, :length] = 1
    documents = np.array([(r * 2 + rank, 0, r, 0, length) for r in range(rows)], np.int64).reshape(-1, 5)
    counts = {
        "documents": rows,
        "tokens": rows * length,
        "loss_tokens": rows * length,
        "padding_tokens": rows * (T - length),
    }
    return store.PartSpec(rank, rows, T, BF16, documents, counts), hidden, tokens


def header(world_size: int = 2, **fingerprint):
    """A store header of 3 tapped layers x 8 features of a made-up target."""
    return store.new_manifest(
        target=TargetSpec("m", "qwen3", "hash", num_layers=4, hidden_size=F // 3, vocab_size=1000),
        layer_ids=[0, 1, 2],
        token_budget=T,
        tokenizer=TokenizerSpec("m", 1000, {"mask": 999}),
        fingerprint={"model": "m", "token_budget": T, "world_size": world_size, **fingerprint},
    )


def write_store(out, rows=(3, 2), chunk_bytes=None, monkeypatch=None, zero_padding=True, **fingerprint):
    """A complete two-part store (of `header(**fingerprint)`); returns each part's (hidden, tokens)."""
    if chunk_bytes is not None:
        monkeypatch.setattr(store_reader, "CHUNK_BYTES", chunk_bytes)
    head = header(len(rows), **fingerprint)
    store.create_store(out, head)
    contents = []
    for rank, n in enumerate(rows):
        spec, hidden, tokens = synthetic_part(rank, n, seed=rank, zero_padding=zero_padding)
        part = store.PartWriter(out, spec, head)
        part.write_rows(0, hidden, tokens)
        part.commit(n)
        contents.append((hidden, tokens))
    assert store.finalize(out, head)
    return contents


def test_round_trip_across_parts_and_chunks(tmp_path, monkeypatch):
    out = tmp_path / "s"
    contents = write_store(out, chunk_bytes=T * F * 2 // 4, monkeypatch=monkeypatch)  # 4 token slices per row
    shards = store.Store.open(out)
    assert shards.parts[0]["hidden"].chunks == (1, T // 4, F)
    assert (shards.num_rows, shards.token_budget, shards.feature_dim) == (5, T, F)
    global_rows = [(0, r) for r in range(3)] + [(1, r) for r in range(2)]
    for i, (rank, r) in enumerate(global_rows):
        row = shards.read_row(i)
        hidden, tokens = contents[rank]
        np.testing.assert_array_equal(row["hidden"], hidden[r])
        assert row["hidden"].dtype == np.uint16
        for name, dtype in store.TOKEN_ARRAYS.items():
            assert row[name].dtype == np.dtype(dtype)
            np.testing.assert_array_equal(row[name], tokens[name][r])
    documents = shards.documents()
    np.testing.assert_array_equal(documents[:, 2], [0, 1, 2, 3, 4])  # global row numbers
    np.testing.assert_array_equal(documents[:, 0], [0, 2, 4, 1, 3])
    manifest = shards.manifest
    assert dataclasses.asdict(manifest.counts) == {
        "documents": 5,
        "tokens": 3 * 20 + 2 * 21,
        "loss_tokens": 102,
        "padding_tokens": 3 * 12 + 2 * 11,
        "rows": 5,
    }
    assert [p.rows for p in manifest.parts] == [3, 2]
    with pytest.raises(IndexError):
        shards.read_row(5)
    assert verify.check_chunks(shards) == []


def test_direct_reader_equals_plain_zarr_with_an_edge_chunk(tmp_path, monkeypatch):
    """The trainer's read path (ChunkReader: file, CRC32C, blosc or zstd into place) against zarr's own reads, with
    rows of 11 + 11 + 10 tokens of chunks (the last one padded), into an int16 view of a bfloat16 tensor."""
    import torch

    out = tmp_path / "s"
    write_store(out, chunk_bytes=T * F * 2 // 3, monkeypatch=monkeypatch, zero_padding=False)
    shards = store.Store.open(out)
    assert shards.parts[1]["hidden"].chunks == (1, 11, F)
    plain = zarr.open_group(out, mode="r")
    batch = torch.zeros(T, F, dtype=torch.bfloat16)
    for i, (part, r) in enumerate([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]):
        arrays = plain[f"parts/{store.part_name(part)}"]
        tokens = {name: np.zeros(T, dtype) for name, dtype in store.TOKEN_ARRAYS.items()}
        shards.read_row_into(i, {"hidden": batch.view(torch.int16).numpy(), **tokens})
        np.testing.assert_array_equal(batch.view(torch.int16).numpy().view(np.uint16), arrays["hidden"][r])
        for name in store.TOKEN_ARRAYS:
            np.testing.assert_array_equal(tokens[name], arrays[name][r])
    converted = {name: np.zeros(T, np.float32 if name == "position_ids" else np.int64) for name in store.TOKEN_ARRAYS}
    shards.read_row_into(4, {"hidden": batch.view(torch.int16).numpy(), **converted})  # values, not bits
    for name in store.TOKEN_ARRAYS:
        np.testing.assert_array_equal(converted[name], plain[f"parts/{store.part_name(1)}"][name][1])
    with pytest.raises(DflashError, match="bf16 bits: read them into 2-byte integers.*not float16"):
        shards.read_row_into(0, {"hidden": np.zeros((T, F), np.float16), **tokens})
    with pytest.raises(DflashError, match=r"reader expects \(32, 23\)"):
        shards.read_row_into(0, {"hidden": np.zeros((T, F - 1), np.int16), **tokens})


def test_a_hidden_array_with_another_codec_is_refused(tmp_path, monkeypatch):
    out = tmp_path / "s"
    monkeypatch.setattr(
        store_writer, "hidden_compressors", lambda features: store.token_compressors()
    )  # zstd instead of blosc
    write_store(out)
    monkeypatch.undo()  # read by this version
    with pytest.raises(DflashError, match=r"encoded as \['BytesCodec', 'ZstdCodec', 'Crc32cCodec'\].*harvest again"):
        store.Store.open(out)


def test_truncated_chunk_is_named(tmp_path):
    out = tmp_path / "s"
    write_store(out)
    chunk = out / "parts" / "rank00000" / "hidden" / "c" / "2" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:3])
    with pytest.raises(DflashError, match=r"row 2 \(part rank00000, array hidden, row 2\): checksum mismatch"):
        store.Store.open(out).read_row(2)


def test_plain_zarr_reads_what_the_format_doc_says(tmp_path):
    """The reading recipe of docs/shard-format.md, with zarr alone."""
    import torch

    out = tmp_path / "s"
    contents = write_store(out)
    manifest = json.loads((out / "manifest.json").read_text())
    group = zarr.open_group(out, mode="r")
    part = manifest["parts"][1]["name"]
    hidden = group[f"parts/{part}/hidden"]
    assert hidden.attrs["precision"] == "bf16"
    row = torch.from_numpy(hidden[1].view(np.int16)).view(torch.bfloat16)
    expected = torch.from_numpy(contents[1][0][1].view(np.int16)).view(torch.bfloat16)
    assert torch.equal(row.view(torch.int16), expected.view(torch.int16))
    assert group[f"parts/{part}/documents"].attrs["columns"] == store.DOCUMENT_COLUMNS
    codecs = json.loads((out / "parts" / part / "hidden" / "zarr.json").read_text())["codecs"]
    assert [c["name"] for c in codecs] == ["bytes", "blosc", "crc32c"]


def test_a_rank_without_documents_gives_an_empty_part(tmp_path):
    out = tmp_path / "s"
    write_store(out, rows=(2, 0))
    shards = store.Store.open(out)
    assert shards.num_rows == 2 and len(shards.documents()) == 2 and verify.check_chunks(shards) == []


def test_incomplete_store_is_refused_until_the_last_part_finishes(tmp_path):
    out = tmp_path / "s"
    store.create_store(out, header(2))
    spec, hidden, tokens = synthetic_part(0, 2, seed=0)
    part = store.PartWriter(out, spec)
    part.write_rows(0, hidden[:1], {k: v[:1] for k, v in tokens.items()})
    part.commit(1)
    assert not store.finalize(out, header(2))
    with pytest.raises(DflashError, match="incomplete store .*0 of 2 parts done.*rerun the same harvest command"):
        store.Store.open(out)

    resumed = store.PartWriter(out, spec)  # a rerun resumes after the committed row
    assert resumed.rows_committed == 1
    resumed.write_rows(1, hidden[1:], {k: v[1:] for k, v in tokens.items()})
    resumed.commit(2)
    assert not store.finalize(out, header(2))  # rank 1 still missing
    spec1, hidden1, tokens1 = synthetic_part(1, 1, seed=1)
    other = store.PartWriter(out, spec1)
    other.write_rows(0, hidden1, tokens1)
    other.commit(1)
    assert store.finalize(out, header(2))
    assert store.Store.open(out).num_rows == 3


def test_a_part_under_other_settings_is_never_committed_nor_finished(tmp_path):
    """Two ranks with other settings: harvest.json is written by one of them only, the other's commit is refused,
    and a part whose progress.json records another header stops the finishing step, naming the setting."""
    out = tmp_path / "s"
    ours, theirs = header(2), header(2, data_sha256="other")
    store.create_store(out, ours)
    store.create_store(out, theirs)  # the rank that lost the race to harvest.json
    assert json.loads((out / store.HARVEST_FILE).read_text())["fingerprint"].get("data_sha256") is None
    assert not store.write_json_exclusive(out / store.HARVEST_FILE, theirs.to_json())
    for rank, head in ((0, ours), (1, theirs)):
        spec, hidden, tokens = synthetic_part(rank, 2, seed=rank)
        part = store.PartWriter(out, spec, head)
        part.write_rows(0, hidden, tokens)
        if rank == 0:
            part.commit(2)
    with pytest.raises(
        DflashError, match=r"rank 1 runs with other settings .*data_sha256: the store has None, rank 1 has 'other'"
    ):
        part.commit(2)
    progress_file = out / "parts" / "rank00001" / store.PROGRESS_FILE
    progress = json.loads(progress_file.read_text())
    assert progress["rows_committed"] == 0 and progress["header_sha256"] == store.header_sha256(theirs)
    progress_file.write_text(json.dumps({**progress, "rows_committed": 2}))  # say its rows got committed anyway
    with pytest.raises(
        DflashError,
        match=r"mixed store.*rank00001 records .*\(data_sha256: store has None, part has 'other'\).*rerun rank\(s\) 1",
    ):
        store.finalize(out, ours)
    assert not (out / store.MANIFEST_FILE).exists()


def test_changed_plan_under_a_started_part_is_refused(tmp_path):
    out = tmp_path / "s"
    store.create_store(out, header(1))
    spec, _, _ = synthetic_part(0, 2, seed=0)
    store.PartWriter(out, spec)
    changed, _, _ = synthetic_part(0, 3, seed=0)
    with pytest.raises(DflashError, match="planned differently"):
        store.PartWriter(out, changed)


def test_corrupt_and_missing_chunks_are_named(tmp_path):
    out = tmp_path / "s"
    write_store(out)
    chunk = out / "parts" / "rank00001" / "hidden" / "c" / "1" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    (out / "parts" / "rank00000" / "loss_mask" / "c" / "2" / "0").unlink()
    shards = store.Store.open(out)
    with pytest.raises(DflashError, match=r"corrupt data .*row 4 \(part rank00001, array hidden, row 1\)"):
        shards.read_row(4)
    with pytest.raises(DflashError, match=r"row 2 \(part rank00000, array loss_mask, row 2\): chunk file missing"):
        shards.read_row(2)
    problems = verify.check_chunks(shards)
    assert len(problems) == 2, problems
    token_chunk = out / "parts" / "rank00000" / "input_ids" / "c" / "0" / "0"
    data = bytearray(token_chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    token_chunk.write_bytes(bytes(data))
    with pytest.raises(DflashError, match=r"row 0 \(part rank00000, array input_ids, row 0\): checksum mismatch"):
        shards.read_row(0)
    assert any("part rank00001 array hidden chunk (1, 0, 0) (row 4)" in p and "checksum" in p for p in problems)
    assert any("part rank00000 array loss_mask chunk (2, 0) (row 2): chunk file missing" in p for p in problems)


def test_whole_arrays_with_a_missing_or_swapped_chunk_are_refused_on_open(tmp_path):
    """zarr reads a missing chunk as its fill value (zeros): the document sources and the documents tables must
    be refused on open, naming the chunk and --repair; a CRC-valid chunk of other content fails the sha256."""
    out, other = tmp_path / "s", tmp_path / "other"
    write_store(out)
    store.write_document_sources(out, np.array([0, 1, 0, 1, 1], np.int16))
    assert store.Store.open(out).document_sources.tolist() == [0, 1, 0, 1, 1]
    chunk = out / store.DOCUMENT_SOURCES / "c" / "0"
    saved = chunk.read_bytes()
    chunk.unlink()
    with pytest.raises(
        DflashError,
        match=r"document sources .* damaged \(chunk file c/0 missing: it would read as zeros\); rerun the harvest command with --repair",
    ):
        store.Store.open(out)
    other.mkdir()
    store.write_document_sources(other, np.array([1, 1, 0, 1, 1], np.int16))
    chunk.write_bytes((other / store.DOCUMENT_SOURCES / "c" / "0").read_bytes())  # its CRC32C is right
    with pytest.raises(DflashError, match=r"does not match the sha256 its attributes record"):
        store.Store.open(out)
    chunk.write_bytes(saved)
    (out / "parts" / "rank00001" / "documents" / "c" / "0" / "0").unlink()
    with pytest.raises(DflashError, match=r"documents table of part rank00001 .*c/0/0 missing.*--repair for rank 1"):
        store.Store.open(out)


def test_document_sources_all_of_the_first_source_verify_clean(tmp_path):
    """A mixture whose documents all come from source 0: the array equals its fill value, and its chunk is still
    written (zarr skips such chunks by default, which read_whole would call damage that --repair cannot mend)."""
    out = tmp_path / "s"
    write_store(out)
    store.write_document_sources(out, np.zeros(5, np.int16))
    assert (out / store.DOCUMENT_SOURCES / "c" / "0").is_file()
    assert store.Store.open(out).document_sources.tolist() == [0] * 5
    assert store.damaged_whole_arrays(out, header(2)) == {}


def test_chunks_swapped_between_rows_and_parts_are_named_by_the_reader_and_verify(tmp_path):
    """Chunk files exchanged between places keep their valid CRC32C (hidden between two rows of a part, input_ids
    between the parts): the trainer's reads, `inspect --verify` and `--repair`'s scan all name array and row."""
    out = tmp_path / "s"
    write_store(out)
    part0, part1 = out / "parts" / "rank00000", out / "parts" / "rank00001"
    swap_files(part0 / "hidden" / "c" / "0" / "0" / "0", part0 / "hidden" / "c" / "2" / "0" / "0")
    swap_files(part0 / "input_ids" / "c" / "1" / "0", part1 / "input_ids" / "c" / "1" / "0")
    shards = store.Store.open(out)
    moved = r"not the chunk written there.*rerun the harvest command with --repair for rank"
    with pytest.raises(DflashError, match=rf"row 0 \(part rank00000, array hidden, row 0\): .*{moved} 0"):
        shards.read_row(0)
    with pytest.raises(DflashError, match=rf"row 4 \(part rank00001, array input_ids, row 1\): .*{moved} 1"):
        shards.read_row(4)
    shape = reader.BatchShape(1, 1, reader.row_fields(shards.row_layout))
    rows = reader.RowReader(shards, [(np.array([2]), np.zeros(1, np.int64))], shape, workers=2)
    try:  # the trainer's reader threads
        with pytest.raises(reader.DamagedRow, match=r"array hidden, row 2\): .*not the chunk written there"):
            rows.next()
    finally:
        rows.close()
    problems = verify.check_chunks(shards)
    assert len(problems) == 4, problems
    for where in ("rank00000 array hidden chunk (0, 0, 0) (row 0)", "rank00000 array hidden chunk (2, 0, 0) (row 2)"):
        assert any(where in p and "not the chunk written there" in p for p in problems), problems
    for where in ("rank00000 array input_ids chunk (1, 0) (row 1)", "rank00001 array input_ids chunk (1, 0) (row 4)"):
        assert any(where in p for p in problems), problems
    assert verify.part_damage(out, 0, BF16).rows == [0, 1, 2]
    assert verify.part_damage(out, 1, BF16).rows == [1]


def test_documents_chunks_swapped_between_parts_are_named_by_the_reader_and_verify(tmp_path):
    """The documents tables are no row arrays, but their chunks are bound to their place too (the table's attribute
    `digests`): a documents chunk of another part keeps its valid CRC32C and is still named, and --repair's scan
    marks the table for rewriting."""
    out = tmp_path / "s"
    write_store(out)
    swap_files(*(out / "parts" / part / "documents" / "c" / "0" / "0" for part in ("rank00000", "rank00001")))
    shards = store.Store.open(out)
    with pytest.raises(DflashError, match=r"documents table of part rank00000 .*not the chunk written there.*rank 0"):
        shards.documents()
    problems = verify.check_chunks(shards)
    assert len(problems) == 2 and all("not the chunk written there" in p for p in problems), problems
    assert any("part rank00001 array documents chunk (0, 0): chunk file" in p for p in problems), problems
    assert verify.part_damage(out, 0, BF16).documents and verify.part_damage(out, 1, BF16).documents


def test_a_whole_row_moved_with_its_digests_is_named(tmp_path):
    """Every chunk file of rows 0 and 2 exchanged, the digests' own chunks too: a digest binds its path as well."""
    out = tmp_path / "s"
    write_store(out)
    for array in (out / "parts" / "rank00000").iterdir():
        if (array / "c" / "0").exists() and array.name != "documents":
            (array / "c" / "0").rename(array / "c" / "tmp")
            (array / "c" / "2").rename(array / "c" / "0")
            (array / "c" / "tmp").rename(array / "c" / "2")
    shards = store.Store.open(out)
    for row in (0, 2):
        with pytest.raises(DflashError, match=rf"row {row} \(part rank00000, array hidden, row {row}\)"):
            shards.read_row(row)
    assert verify.part_damage(out, 0, BF16).rows == [0, 2]


def test_a_row_rewritten_through_zarr_reads_once_its_digests_are_recorded_again(tmp_path):
    """An edit through zarr is not the chunk the harvest wrote there; record_digests accepts the chunks as they are."""
    out = tmp_path / "s"
    write_store(out)
    zarr.open_group(out / "parts" / "rank00000", mode="r+")["input_ids"][1] = 7
    with pytest.raises(DflashError, match=r"array input_ids, row 1\): .*not the chunk written there"):
        store.Store.open(out).read_row(1)
    store.record_digests(out)
    assert (store.Store.open(out).read_row(1)["input_ids"] == 7).all()


def test_a_part_of_another_harvest_in_a_complete_store_is_refused_on_open(tmp_path):
    """A part folder put in a complete store from a harvest of other settings: its progress.json records another
    header than the store's. Opening (train, inspect) refuses it, naming the part, both hashes and the fix."""
    out, other = tmp_path / "s", tmp_path / "other"
    write_store(out)
    write_store(other, data_sha256="other")
    shutil.rmtree(out / "parts" / "rank00001")
    shutil.copytree(other / "parts" / "rank00001", out / "parts" / "rank00001")
    ours, theirs = store.header_sha256(header(2)), store.header_sha256(header(2, data_sha256="other"))
    with pytest.raises(DflashError) as refused:
        store.Store.open(out)
    message = str(refused.value)
    assert f"rank00001 records header_sha256 {theirs}, the store's is {ours}" in message, message
    assert "data_sha256: store has None, part has 'other'" in message
    assert "delete those part folders (parts/rank00001) and manifest.json, then rerun rank(s) 1" in message


def test_a_store_of_format_version_2_reads_without_digests_and_says_so(tmp_path, caplog):
    """Stores written before the chunk digests (format version 2) are still read, with a warning that a chunk in
    the wrong place goes unnoticed there."""
    out = tmp_path / "s"
    contents = write_store(out)
    for part in (out / "parts").glob("rank*"):
        shutil.rmtree(part / store.DIGESTS)
    raw = json.loads((out / store.MANIFEST_FILE).read_text())
    (out / store.MANIFEST_FILE).write_text(json.dumps({**raw, "format_version": 2}))
    with caplog.at_level("WARNING", logger="dflash"):
        shards = store.Store.open(out)
    assert "format version 2" in caplog.text and "records no chunk digests" in caplog.text
    np.testing.assert_array_equal(shards.read_row(1)["hidden"], contents[0][0][1])
    assert verify.check_chunks(shards) == []


def test_all_padding_chunks_are_still_written(tmp_path):
    """A chunk equal to the fill value is written too, so a missing chunk file always means damage."""
    out = tmp_path / "s"
    write_store(out)
    assert (out / "parts" / "rank00000" / "position_ids" / "c" / "0" / "0").is_file()
    assert verify.check_chunks(store.Store.open(out)) == []


def test_other_format_version_is_refused(tmp_path):
    out = tmp_path / "s"
    write_store(out)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(DflashError, match="format version 99"):
        store.Store.open(out)


def test_a_store_of_a_newer_format_gets_the_same_advice_from_inspect_and_harvest(tmp_path):
    """Not "harvest again" from one and "use a new folder" from the other: both say a newer dflash wrote it."""
    out = tmp_path / "s"
    write_store(out)
    for name in (store.HARVEST_FILE, store.MANIFEST_FILE):
        raw = json.loads((out / name).read_text())
        (out / name).write_text(json.dumps({**raw, "format_version": 99}))
    advice = (
        r"was written by a newer dflash \(format version 99 > 3, the newest this dflash reads\): upgrade dflash to "
        r"read it, or harvest again into a new folder with this version$"
    )
    with pytest.raises(DflashError, match=advice):
        store.Store.open(out)
    with pytest.raises(DflashError, match=advice):
        store.check_folder(out, header(2).fingerprint)


def test_check_folder(tmp_path):
    assert store.check_folder(tmp_path / "new", header().fingerprint) == "new"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / f"{store.TMP_PREFIX}harvest.json.123").write_text("{")  # another rank's harvest.json on its way
    assert store.check_folder(empty, header().fingerprint) == "new"
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(DflashError, match=r"holds other content \(notes.txt\) and is not a dflash store"):
        store.check_folder(other, header().fingerprint)
    out = tmp_path / "s"
    store.create_store(out, header(1))
    assert store.check_folder(out, header(1).fingerprint) == "resume"
    with pytest.raises(
        DflashError, match="token_budget: store has 32, this run 64; world_size: store has 1, this run 2"
    ):
        store.check_folder(out, header(2, token_budget=64).fingerprint)
    write_store(tmp_path / "done")
    assert store.check_folder(tmp_path / "done", header(2).fingerprint) == "complete"
    # A store made before deduplication (no "dedup" in its fingerprint) kept every record: only --no-dedup resumes it.
    with pytest.raises(
        DflashError, match=r"\(dedup: store has False, this run True\); rerun with the store's settings"
    ):
        store.check_folder(out, {**header(1).fingerprint, "dedup": True})
    assert store.check_folder(out, {**header(1).fingerprint, "dedup": False}) == "resume"


def test_not_a_store(tmp_path):
    with pytest.raises(DflashError, match="not a dflash store"):
        store.Store.open(tmp_path)


def test_first_fit_decreasing_matches_a_naive_reference():
    rng = np.random.default_rng(0)
    for capacity in (16, 100, 1000):
        lengths = rng.integers(1, capacity + 1, size=300).tolist()
        expected: list[list[int]] = []  # naive first fit over items sorted longest first
        free: list[int] = []
        for item in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            row = next((r for r, room in enumerate(free) if room >= lengths[item]), len(free))
            if row == len(free):
                free.append(capacity)
                expected.append([])
            free[row] -= lengths[item]
            expected[row].append(item)
        rows = first_fit_decreasing(lengths, capacity)
        assert rows == expected
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in row) <= capacity for row in rows)
    assert first_fit_decreasing([], 10) == []


def test_ranks_racing_to_create_the_store_all_succeed(tmp_path):
    """Every rank creates the shared root groups on start; the ones that lose the race must open them instead."""
    import threading

    for attempt in range(10):
        out = tmp_path / f"store{attempt}"
        barrier, errors = threading.Barrier(4), []

        def start(out=out, barrier=barrier, errors=errors):
            barrier.wait()
            try:
                store.create_store(out, header(1))
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=start) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert (out / "zarr.json").exists() and (out / "parts" / "zarr.json").exists()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_chunk_writer_writes_the_bytes_zarr_would(tmp_path, monkeypatch, precision):
    """The store writes hidden chunks itself (outside zarr's GIL-heavy path): the files must be exactly zarr's,
    ragged edge chunk included, so that plain zarr reads them and checks their checksums."""
    rows, T, F = 2, 50, 24
    features = FeatureSpec(precision, F, 3 if precision == "fp8" else 0, None)
    # 50 tokens x 24 features: chunks of 17, 17 and a ragged 16
    monkeypatch.setattr(store_reader, "CHUNK_BYTES", 1000 // (2 // features.bytes_per_value))
    counts = {"documents": 0, "tokens": 0, "loss_tokens": 0, "padding_tokens": 0}
    dtype = store.HIDDEN_DTYPES[precision]
    hidden = np.random.default_rng(0).integers(0, np.iinfo(dtype).max, (rows, T, F), dtype=dtype)
    others = {name: np.ones((rows, T), dtype) for name, dtype in store.TOKEN_ARRAYS.items()}
    others["scales"] = np.ones((rows, T, 3), np.int8)
    store.create_store(tmp_path / "ours", header(1))
    part = store.PartWriter(tmp_path / "ours", store.PartSpec(0, rows, T, features, np.zeros((0, 5), np.int64), counts))
    part.write_rows(0, hidden, others)
    ours = zarr.open_array(part.chunk_writers["hidden"].folder, mode="r")
    assert ours.chunks == (1, 17, F)
    reference = zarr.create_array(
        tmp_path / "reference",
        shape=(rows, T, F),
        chunks=ours.chunks,
        dtype=dtype,
        compressors=store.hidden_compressors(features),
        fill_value=0,
        config={"write_empty_chunks": True},
    )
    reference[:] = hidden
    files = sorted(path.relative_to(tmp_path / "reference") for path in (tmp_path / "reference").rglob("c/*/*/*"))
    assert len(files) == rows * 3
    for relative in files:
        assert (part.chunk_writers["hidden"].folder / relative).read_bytes() == (
            tmp_path / "reference" / relative
        ).read_bytes()
    np.testing.assert_array_equal(ours[:], hidden)


# ------------------------------------------------------------------------------------ damaged or edited files


def test_damaged_or_edited_progress_json_is_named(tmp_path):
    write_store(tmp_path / "s")
    progress = tmp_path / "s" / "parts" / "rank00001" / store.PROGRESS_FILE
    good = json.loads(progress.read_text())
    for damaged in ("", "{", "[]", json.dumps({**good, "rows_committed": good["rows"] + 1}), json.dumps({"rows": 2})):
        progress.write_text(damaged)
        with pytest.raises(DflashError, match=r"progress.json is damaged"):
            store.part_progress(tmp_path / "s", 2)


def test_a_manifest_claiming_more_rows_than_the_arrays_is_refused(tmp_path):
    write_store(tmp_path / "s")
    path = tmp_path / "s" / store.MANIFEST_FILE
    raw = json.loads(path.read_text())
    raw["parts"][0]["rows"] += 1
    raw["parts"][0]["padding_tokens"] += raw["token_budget"]
    raw["counts"]["rows"] += 1
    raw["counts"]["padding_tokens"] += raw["token_budget"]
    path.write_text(json.dumps(raw))
    with pytest.raises(DflashError, match=r"does not match part rank00000's arrays \(hidden has 3 rows"):
        store.Store.open(tmp_path / "s")


def test_a_missing_part_folder_is_a_one_line_error(tmp_path):
    import shutil

    write_store(tmp_path / "s")
    shutil.rmtree(tmp_path / "s" / "parts" / "rank00001")
    with pytest.raises(DflashError, match="cannot be opened"):
        store.Store.open(tmp_path / "s")


def test_harvest_json_that_is_not_an_object_is_named(tmp_path):
    write_store(tmp_path / "s")
    (tmp_path / "s" / store.HARVEST_FILE).write_text("[1, 2]")
    with pytest.raises(DflashError, match="harvest.json is damaged"):
        store.check_folder(tmp_path / "s", {})


def test_self_check_round_trips_and_is_validated(tmp_path):
    from dflash.manifest import CheckFailure, SelfCheck

    write_store(tmp_path / "s")
    assert store.Store.open(tmp_path / "s").self_check is None
    check = SelfCheck(False, 3, 0, 2.0**-7, 0.4, 0.5, (CheckFailure(7, 0, 1, 4, 0.4, 3),))
    store.record_self_check(tmp_path / "s", check)
    opened = store.Store.open(tmp_path / "s")
    assert opened.self_check == check and not opened.self_check.passed
    path = tmp_path / "s" / store.MANIFEST_FILE
    raw = json.loads(path.read_text())
    raw["self_check"]["passed"] = "yes"
    path.write_text(json.dumps(raw))
    with pytest.raises(DflashError, match=r"field self_check.passed is 'yes', expected bool"):
        store.Store.open(tmp_path / "s")


def test_a_relative_target_path_resolves_against_the_store_parent(tmp_path):
    write_store(tmp_path / "s")
    manifest = store.Store.open(tmp_path / "s").manifest
    (tmp_path / "models" / "t").mkdir(parents=True)
    (tmp_path / "models" / "t" / "config.json").write_text("{}")
    relative = dataclasses.replace(manifest, fingerprint={**manifest.fingerprint, "model": "models/t"})
    assert store.target_path(tmp_path / "s", relative) == str((tmp_path / "models" / "t").resolve())
    missing = dataclasses.replace(manifest, fingerprint={**manifest.fingerprint, "model": "./gone/t"})
    with pytest.raises(DflashError, match="relative path './gone/t'"):
        store.target_path(tmp_path / "s", missing)
    hub = dataclasses.replace(manifest, fingerprint={**manifest.fingerprint, "model": "Qwen/Qwen3-8B"})
    assert store.target_path(tmp_path / "s", hub) == "Qwen/Qwen3-8B"


# ------------------------------------------------------------------------------------ the trainer's row reader


def _corrupt_chunk(out, row: int, j: int):
    chunk = out / "parts" / store.part_name(0) / "hidden" / "c" / str(row) / str(j) / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 16] = bytes(16)
    chunk.write_bytes(bytes(data))


@pytest.mark.parametrize("workers, rows_per_step", [(4, 1), (3, 1), (4, 2), (1, 1)])
def test_rows_read_in_pieces_by_several_threads_equal_the_stored_rows(tmp_path, monkeypatch, workers, rows_per_step):
    """A step of fewer rows than reader threads has each row read as `workers // rows` interleaved sets of its
    chunks in parallel (4 token slices per row here): every batch equals the rows read whole."""
    import torch

    out = tmp_path / "s"
    write_store(out, rows=(4,), chunk_bytes=T * F * 2 // 4, monkeypatch=monkeypatch, zero_padding=False)
    shards = store.Store.open(out)
    shape = reader.BatchShape(1, rows_per_step, reader.row_fields(shards.row_layout))
    steps = [(np.arange(k, k + rows_per_step), np.zeros(rows_per_step, np.int64)) for k in (0, 2)]
    rows = reader.RowReader(shards, steps, shape, workers=workers)
    try:
        assert rows.pieces == max(1, workers // rows_per_step)
        for first, _ in steps:
            batch = rows.next()
            for r, i in enumerate(first):
                want = shards.read_row(int(i))
                got = batch.tensors["hidden"][0, r].view(torch.int16).numpy().view(np.uint16)
                np.testing.assert_array_equal(got, want["hidden"])
                for name in store.TOKEN_ARRAYS:
                    np.testing.assert_array_equal(batch.tensors[name][0, r].numpy(), want[name])
            batch.release()
        assert rows.next() is None
    finally:
        rows.close()


def test_a_row_damaged_in_two_pieces_is_skipped_once_and_zeroed_whole(tmp_path, monkeypatch):
    out = tmp_path / "s"
    write_store(out, rows=(2,), chunk_bytes=T * F * 2 // 4, monkeypatch=monkeypatch)
    _corrupt_chunk(out, 1, 0)
    _corrupt_chunk(out, 1, 3)  # read by another thread than chunk 0
    shards = store.Store.open(out)
    shape = reader.BatchShape(1, 1, reader.row_fields(shards.row_layout))
    damaged = reader.DamagedRows(limit=1)
    rows = reader.RowReader(shards, [(np.array([1]), np.zeros(1, np.int64))], shape, workers=4, damaged=damaged)
    try:
        batch = rows.next()
        assert damaged.rows == [1]  # one row, not one per damaged piece
        assert not batch.tensors["loss_mask"].any() and (batch.tensors["doc_ids"] == -1).all()
        assert not batch.tensors["hidden"].any()  # its sound pieces too
    finally:
        rows.close()
