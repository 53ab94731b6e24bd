"""docs/shard-format.md is the store: stores of every mode are read with plain zarr, json and numpy following only
the rules the document writes down (codecs, chunks, fill values, the fp8 bit layout and scales, the projection,
the hashes), and compared with what dflash's own reader returns.

Independent references: e4m3 is decoded and encoded here from its bit layout (1 sign, 4 exponent bits of bias 7,
3 mantissa bits, subnormals, round to nearest even), not through torch's float8 type; the fp8 and subspace
stores are checked against the bf16 store of the same data, whose forward batches are the same (same packing,
same rows), so its features are the very values the other modes encoded.
"""

import hashlib
import json
import math
import re
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch
import zarr

from dflash import features as dflash_features
from dflash.config import HarvestConfig
from dflash.harvest import run_harvest
from dflash.store import Store
from dflash.tiny import CORPUS

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "shard-format.md").read_text()
BUDGET = 256
OPTIONS = dict(
    token_budget=BUDGET, forward_tokens=2 * BUDGET, overflow="split", dtype="float32", workers=1, device="cpu"
)
CALIBRATION_TOKENS = 2000
MODES = {  # every encoding the harvest writes, each teacher kind once, a 1/N that does not divide n*H
    "bf16": dict(teacher="topk:4"),
    "fp8": dict(precision="fp8", teacher="hidden"),
    "sub1_3": dict(subspace="1/3"),
    "sub1_4+fp8": dict(subspace="1/4", precision="fp8"),
}


@pytest.fixture(scope="module")
def stores(tiny_target, tmp_path_factory):
    """mode -> a complete store of the same data (one rank), plus "ranks": bf16 of two data sources by two ranks."""
    root = tmp_path_factory.mktemp("format")
    lines = CORPUS.read_text().splitlines()
    data, other = root / "data.jsonl", root / "other.jsonl"
    data.write_text("\n".join(lines[:30]) + "\n")
    other.write_text("\n".join(lines[30:40]) + "\n")
    model = str(tiny_target("qwen3"))
    out = {}
    for mode, extra in MODES.items():
        out[mode] = root / mode
        config = dict(model=model, data=str(data), out=str(out[mode]), calibration_tokens=CALIBRATION_TOKENS)
        run_harvest(HarvestConfig(**config, **OPTIONS, self_check=0 if mode != "bf16" else 4, **extra))
    out["ranks"] = root / "ranks"
    for rank in (0, 1):
        run_harvest(
            HarvestConfig(
                model=model,
                data=[str(data), str(other)],
                out=str(out["ranks"]),
                rank=rank,
                world_size=2,
                self_check=0,
                **OPTIONS,
            )
        )
    return out


# ------------------------------------------------------------------------------------ the documented rules


def canonical_sha256(obj) -> str:
    """The docs' "canonical JSON": sorted keys, separators (",", ":")."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def e4m3_values() -> np.ndarray:
    """float64 [256]: the value of each e4m3fn bit pattern, decoded from the documented layout (NaN: 0x7F, 0xFF)."""
    bits = np.arange(256)
    sign = np.where(bits >> 7, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 15, bits & 7
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    values = sign * magnitude
    values[(exponent == 15) & (mantissa == 7)] = np.nan
    return values


def e4m3_encode(y: np.ndarray) -> np.ndarray:
    """Round float64 values of magnitude <= 448 to the nearest e4m3 value, ties to an even mantissa: uint8 bits."""
    table = e4m3_values()[:127]  # the non-negative finite values, ascending with their bit patterns
    magnitude = np.abs(y)
    upper = np.clip(np.searchsorted(table, magnitude), 1, 126)
    lower = upper - 1
    below, above = magnitude - table[lower], table[upper] - magnitude
    code = np.where(below < above, lower, upper)
    code = np.where(below == above, np.where(lower % 2 == 0, lower, upper), code)
    return (code | np.where(np.signbit(y), 0x80, 0)).astype(np.uint8)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float64: the high half of a float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def fp8_decode(bits: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The documented decoding: e4m3(bits) * 2**scales[..., g] over G equal slices of the last axis."""
    groups = scales.shape[-1]
    values = e4m3_values()[bits].reshape(*bits.shape[:-1], groups, -1)
    return (values * np.exp2(scales.astype(np.float64))[..., None]).reshape(bits.shape)


def documented_codecs(array: str, precision: str) -> list[dict]:
    """The codec chain the docs' table gives each array."""
    blosc = {"cname": "lz4", "clevel": 5, "shuffle": "bitshuffle", "typesize": 2, "blocksize": 0}
    if array == "teacher_hidden" or (array == "hidden" and precision == "bf16"):
        middle = {"name": "blosc", "configuration": blosc}
    else:
        middle = {"name": "zstd", "configuration": {"level": 1, "checksum": False}}
    return [{"name": "bytes", "configuration": {"endian": "little"}}, middle, {"name": "crc32c"}]


def chunk_tokens(token_budget: int, bytes_per_token: int) -> int:
    """t = ceil(T / s), s the fewest slices that keep a chunk at most 32 MiB uncompressed."""
    slices = max(1, math.ceil(token_budget * bytes_per_token / (32 << 20)))
    return math.ceil(token_budget / slices)


def plain_part(path: Path, part: str) -> dict[str, np.ndarray]:
    """Every array of a part, read whole with zarr."""
    group = zarr.open_group(path / "parts" / part, mode="r")
    return {name: np.asarray(array[:]) for name, array in group.arrays()}


def plain_features(path: Path, manifest: dict, arrays: dict) -> np.ndarray:
    """float64 [rows, T, W]: the stored values of `hidden`, decoded as the docs say (before any projection)."""
    if manifest["features"]["precision"] == "bf16":
        return bf16_values(arrays["hidden"])
    return fp8_decode(arrays["hidden"], arrays["scales"])


def documented_digest_columns(manifest: dict) -> list[str]:
    """The columns of `digests`: every chunk of one row, hidden, scales, the token arrays, the teacher arrays in the
    manifest's order, each array's chunks in grid order ({row} standing for the row)."""
    T, features, teacher = manifest["token_budget"], manifest["features"], manifest.get("teacher") or {}
    bytes_per_value = 1 if features["precision"] == "fp8" else 2
    hidden = math.ceil(T / chunk_tokens(T, features["width"] * bytes_per_value))
    columns = [f"hidden/c/{{row}}/{j}/0" for j in range(hidden)]
    columns += ["scales/c/{row}/0/0"] if features["precision"] == "fp8" else []
    columns += [f"{name}/c/{{row}}/0" for name in ("input_ids", "position_ids", "doc_ids", "loss_mask")]
    for name in teacher.get("arrays", {}):
        if name == "teacher_hidden":
            H = manifest["target"]["hidden_size"]
            columns += [f"teacher_hidden/c/{{row}}/{j}/0" for j in range(math.ceil(T / chunk_tokens(T, 2 * H)))]
        else:
            columns += [f"{name}/c/{{row}}/0" + ("" if name == "teacher_tail" else "/0")]
    return columns


def manifest_of(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def features_by_document(path: Path) -> dict[tuple[int, int], np.ndarray]:
    """(doc_id, piece) -> float64 [length, W] of the store's decoded values, found through the documents table."""
    manifest, out = manifest_of(path), {}
    for entry in manifest["parts"]:
        arrays = plain_part(path, entry["name"])
        values = plain_features(path, manifest, arrays)
        for doc_id, piece, row, start, length in arrays["documents"].tolist():
            out[doc_id, piece] = values[row, start : start + length]
    return out


# ----------------------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("mode", [*MODES, "ranks"])
def test_arrays_have_the_documented_dtypes_chunks_fills_codecs_and_every_chunk(stores, mode):
    path = stores[mode]
    manifest = manifest_of(path)
    assert manifest["format"] == "dflash-harvest" and manifest["format_version"] == 3
    T, features, teacher = manifest["token_budget"], manifest["features"], manifest.get("teacher")
    W, G = features["width"], features["scale_groups"]
    fp8 = features["precision"] == "fp8"
    assert W == (features["subspace"] or {}).get("width", manifest["feature_dim"])
    expected = {  # name -> (dtype, shape per row, chunk per row, fill)
        "hidden": ("uint8" if fp8 else "uint16", (T, W), (chunk_tokens(T, W * (1 if fp8 else 2)), W), 0),
        "input_ids": ("int32", (T,), (T,), 0),
        "position_ids": ("int32", (T,), (T,), 0),
        "doc_ids": ("int32", (T,), (T,), -1),
        "loss_mask": ("uint8", (T,), (T,), 0),
    }
    if fp8:
        expected["scales"] = ("int8", (T, G), (T, G), 0)
    if teacher and teacher["kind"] == "topk":
        K = teacher["k"]
        expected.update(
            teacher_ids=("int32", (T, K), (T, K), 0),
            teacher_probs=("float16", (T, K), (T, K), 0),
            teacher_tail=("float16", (T,), (T,), 0),
        )
    if teacher and teacher["kind"] == "hidden":
        H = manifest["target"]["hidden_size"]
        expected["teacher_hidden"] = ("uint16", (T, H), (chunk_tokens(T, 2 * H), H), 0)
    C = len(documented_digest_columns(manifest))
    for entry in manifest["parts"]:
        folder = path / "parts" / entry["name"]
        names = {p.name for p in folder.iterdir() if (p / "zarr.json").is_file()}
        assert names == {*expected, "digests", "documents"}
        for name, (dtype, shape, chunk, fill) in {
            **expected,
            "digests": ("uint32", (C,), (C,), 0),
            "documents": ("int64", (entry["documents"], 5), (65536, 5), 0),
        }.items():
            meta = json.loads((folder / name / "zarr.json").read_text())
            rows = () if name == "documents" else (entry["rows"],)
            one = () if name == "documents" else (1,)
            assert (meta["data_type"], tuple(meta["shape"])) == (dtype, (*rows, *shape)), name
            assert tuple(meta["chunk_grid"]["configuration"]["chunk_shape"]) == (*one, *chunk), name
            assert meta["fill_value"] == fill and meta["chunk_key_encoding"]["name"] == "default", name
            codecs = documented_codecs(name, features["precision"])
            if np.dtype(dtype).itemsize == 1:  # zarr records no endianness for single bytes
                codecs[0] = {"name": "bytes"}
            assert meta["codecs"] == codecs, name
            grid = [math.ceil(s / c) for s, c in zip(meta["shape"], meta["chunk_grid"]["configuration"]["chunk_shape"])]
            missing = [c for c in np.ndindex(*grid) if not (folder / name / "c" / "/".join(map(str, c))).is_file()]
            assert not missing, f"{name}: chunk files missing {missing[:3]}"
        hidden = json.loads((folder / "hidden" / "zarr.json").read_text())["attributes"]
        assert hidden["precision"] == features["precision"] and "encoding" in hidden
        documents = json.loads((folder / "documents" / "zarr.json").read_text())["attributes"]
        assert documents["columns"] == ["doc_id", "piece", "row", "start", "length"]
        for name in (n for n in expected if n.startswith("teacher_")):
            assert "meaning" in json.loads((folder / name / "zarr.json").read_text())["attributes"]
    hidden_codec = documented_codecs("hidden", features["precision"])[1:]
    assert manifest["codecs"]["hidden"] == hidden_codec
    assert manifest["codecs"]["tokens"] == documented_codecs("input_ids", "bf16")[1:]
    if teacher:
        name = "teacher_hidden" if teacher["kind"] == "hidden" else "teacher_probs"
        assert manifest["codecs"]["teacher"] == documented_codecs(name, "bf16")[1:]
    else:
        assert set(manifest["codecs"]) == {"hidden", "tokens"}


@pytest.mark.parametrize("mode", [*MODES, "ranks"])
def test_rows_documents_padding_and_counts_follow_the_docs_and_match_the_reader(stores, mode):
    path = stores[mode]
    manifest, reader = manifest_of(path), Store.open(path)
    start = 0
    totals = dict(documents=0, tokens=0, loss_tokens=0, padding_tokens=0, rows=0)
    for entry in manifest["parts"]:
        arrays = plain_part(path, entry["name"])
        doc_ids, positions = arrays["doc_ids"], arrays["position_ids"]
        padding = doc_ids == -1
        for name in ("input_ids", "position_ids", "loss_mask", "hidden"):
            assert not arrays[name][padding].any(), f"{name} is not 0 on padding"
        if "scales" in arrays:  # a slice of zeros gets the smallest exponent
            assert (arrays["scales"][padding] == -127).all()
        for name in (n for n in arrays if n.startswith("teacher_")):
            assert not arrays[name][padding].any(), f"{name} is not 0 on padding"
        covered = np.zeros_like(padding)
        for doc_id, _, row, first, length in arrays["documents"].tolist():
            assert (doc_ids[row, first : first + length] == doc_id).all()
            np.testing.assert_array_equal(positions[row, first : first + length], np.arange(length))
            assert not covered[row, first : first + length].any(), "documents overlap"
            covered[row, first : first + length] = True
        assert (covered == ~padding).all(), "tokens outside every document are not padding"
        counts = dict(
            documents=len(arrays["documents"]),
            tokens=int((~padding).sum()),
            loss_tokens=int(arrays["loss_mask"].sum()),
            padding_tokens=int(padding.sum()),
        )
        assert {k: entry[k] for k in counts} == counts and entry["rows"] == len(doc_ids)
        progress = json.loads((path / "parts" / entry["name"] / "progress.json").read_text())
        assert progress["rows"] == progress["rows_committed"] == entry["rows"] and progress["counts"] == counts
        for key, value in {**counts, "rows": entry["rows"]}.items():
            totals[key] += value
        for row in range(entry["rows"]):  # the global row index concatenates the parts in rank order
            got = reader.read_row(start + row)
            for name, value in got.items():
                np.testing.assert_array_equal(value, arrays[name][row], err_msg=f"{name} of row {start + row}")
            if reader.teacher is not None:
                for name, value in reader.read_teacher(start + row).items():
                    np.testing.assert_array_equal(value, arrays[name][row], err_msg=name)
        start += entry["rows"]
    assert manifest["counts"] == totals


@pytest.mark.parametrize("mode", [*MODES, "ranks"])
def test_every_chunk_has_the_documented_digest_of_its_place(stores, mode):
    """digests[r, c]: CRC32C of `parts/<part>/` + the column's path for row r, then the chunk file's last 4 bytes."""
    path = stores[mode]
    manifest = manifest_of(path)
    columns = documented_digest_columns(manifest)
    for entry in manifest["parts"]:
        digests = zarr.open_array(path / "parts" / entry["name"] / "digests", mode="r")
        assert digests.attrs["columns"] == columns
        values = np.asarray(digests[:])
        for row in range(entry["rows"]):
            for c, column in enumerate(columns):
                place = f"parts/{entry['name']}/{column.format(row=row)}"
                checksum = (path / place).read_bytes()[-4:]
                assert values[row, c] == google_crc32c.value(place.encode() + checksum), place
        documents = zarr.open_array(path / "parts" / entry["name"] / "documents", mode="r")
        assert len(documents.attrs["digests"]) == math.ceil(entry["documents"] / 65536)
        for i, recorded in enumerate(documents.attrs["digests"]):  # the table's chunks, in its attribute `digests`
            place = f"parts/{entry['name']}/documents/c/{i}/0"
            assert recorded == google_crc32c.value(place.encode() + (path / place).read_bytes()[-4:]), place


def test_documents_go_to_rank_i_mod_world_size_and_sources_are_recorded(stores):
    path = stores["ranks"]
    manifest = manifest_of(path)
    keys = {}  # (doc_id, piece) -> rank
    for rank, entry in enumerate(manifest["parts"]):
        assert entry["name"] == f"rank{rank:05d}"
        for doc_id, piece, *_ in plain_part(path, entry["name"])["documents"].tolist():
            keys[doc_id, piece] = rank
    order = sorted(keys)  # the order of the data's documents: doc id, then piece
    assert [keys[key] for key in order] == [i % 2 for i in range(len(order))]
    sources = zarr.open_array(path / "document_sources", mode="r")
    values = np.asarray(sources[:])
    assert values.dtype == np.int16 and sources.attrs["sha256"] == hashlib.sha256(values.tobytes()).hexdigest()
    assert json.loads((path / "document_sources" / "zarr.json").read_text())["codecs"] == documented_codecs(
        "doc_ids", ""
    )
    assert len(manifest["sources"]) == 2
    for s, recorded in enumerate(manifest["sources"]):  # a source's documents count its pieces
        assert set(recorded) >= {"source", "weight", "records", "deduplicated", "used", "documents", "tokens"}
        assert recorded["documents"] == sum(values[d] == s for d, _ in order)


@pytest.mark.parametrize("mode", [*MODES, "ranks"])
def test_the_hashes_are_reproduced_from_the_documented_rules(stores, mode, tiny_target):
    path = stores[mode]
    manifest, header = manifest_of(path), json.loads((path / "harvest.json").read_text())
    assert header["identity"] == "" and "counts" not in header and "parts" not in header
    assert {k: v for k, v in manifest.items() if k not in ("identity", "counts", "parts", "self_check")} == {
        k: v for k, v in header.items() if k != "identity"
    }
    content = ["fingerprint", "target", "tokenizer", "features", "codecs", "layer_ids", "token_budget"]
    teacher = ["teacher"] if "teacher" in manifest else []
    assert manifest["identity"] == canonical_sha256({k: manifest[k] for k in content + teacher})
    part_header = canonical_sha256({**{k: manifest[k] for k in content}, "teacher": manifest.get("teacher")})
    for entry in manifest["parts"]:
        progress = json.loads((path / "parts" / entry["name"] / "progress.json").read_text())
        assert progress["header_sha256"] == part_header and progress["fingerprint"] == manifest["fingerprint"]
    model = Path(tiny_target("qwen3"))
    config = json.loads((model / "config.json").read_text())
    assert manifest["target"]["config_hash"] == canonical_sha256(config)
    entries = []
    for file in sorted(model.glob("*.safetensors")):
        size = file.stat().st_size
        sampled = hashlib.sha256(size.to_bytes(8, "little"))
        with open(file, "rb") as f:
            for offset in sorted({max(0, size - (256 << 10)) * i // 31 for i in range(32)}):
                f.seek(offset)
                sampled.update(f.read(256 << 10))
        entries.append([file.name, size, sampled.hexdigest()])
    assert manifest["fingerprint"]["weights_sha256"] == canonical_sha256(entries)
    fingerprint = manifest["fingerprint"]
    assert isinstance(fingerprint["subspace"], bool) and isinstance(fingerprint["dedup"], bool)
    assert fingerprint["projection_sha256"] is None  # calibrated here, not --projection-from


def test_fp8_values_are_the_documented_encoding_of_the_bf16_features(stores):
    reference = features_by_document(stores["bf16"])
    manifest = manifest_of(stores["fp8"])
    G = manifest["features"]["scale_groups"]
    assert G == len(manifest["layer_ids"])  # default: one scale group per tapped layer
    reader = Store.open(stores["fp8"])
    top_binade = below_top = 0
    for entry in manifest["parts"]:
        arrays = plain_part(stores["fp8"], entry["name"])
        for doc_id, piece, row, start, length in arrays["documents"].tolist():
            x = reference[doc_id, piece].reshape(length, G, -1)
            bits = arrays["hidden"][row, start : start + length].reshape(length, G, -1)
            scales = arrays["scales"][row, start : start + length]
            amax = np.abs(x).max(-1)
            with np.errstate(divide="ignore"):
                exponent = np.clip(np.ceil(np.log2(amax / 448)), -127, 127)
            np.testing.assert_array_equal(scales, exponent)
            scaled = x / np.exp2(exponent)[..., None]
            np.testing.assert_array_equal(bits, e4m3_encode(scaled), err_msg=f"document {doc_id} piece {piece}")
            largest = np.abs(scaled).max(-1)
            assert ((largest > 224) & (largest <= 448)).all()
            top_binade += int((largest >= 256).sum())
            below_top += int((largest < 256).sum())
            decoded = fp8_decode(bits.reshape(length, -1), scales).reshape(x.shape)
            error = np.abs(decoded - x)
            normal = np.abs(scaled) >= 2.0**-6
            assert (error[normal] <= np.abs(x[normal]) * 2.0**-4).all()
            assert (error[~normal] <= np.broadcast_to(np.exp2(exponent - 10)[..., None], x.shape)[~normal]).all()
            # the precision threshold the docs give: full relative precision down to 2^-13.8 of the slice's largest
            kept = np.abs(x) >= amax[..., None] * 2.0**-13.8
            assert (error[kept] <= np.abs(x[kept]) * 2.0**-4).all()
    assert top_binade and below_top  # both cases occur, as the docs say
    for i in range(reader.num_rows):  # dflash's own decoding agrees with the documented one, exactly
        row = reader.read_row(i)
        ours = dflash_features.dequantize_fp8(
            torch.from_numpy(row["hidden"]), torch.from_numpy(row["scales"]), torch.float64
        )
        np.testing.assert_array_equal(ours.numpy(), fp8_decode(row["hidden"], row["scales"]))


@pytest.mark.parametrize("mode", ["sub1_3", "sub1_4+fp8"])
def test_subspace_values_are_the_documented_projection_of_the_bf16_features(stores, mode):
    path, reference = stores[mode], features_by_document(stores["bf16"])
    manifest = manifest_of(path)
    numerator, denominator = map(int, re.fullmatch(r"sub(\d)_(\d)(\+fp8)?", mode).groups()[:2])
    F = manifest["feature_dim"]
    k = round(F * numerator / denominator)  # the documented rounding of 1/N
    assert manifest["features"]["width"] == k == manifest["features"]["subspace"]["width"]
    array = zarr.open_array(path / "projection", mode="r")
    meta = json.loads((path / "projection" / "zarr.json").read_text())
    assert meta["data_type"] == "float32" and tuple(meta["shape"]) == (k, F)
    assert tuple(meta["chunk_grid"]["configuration"]["chunk_shape"]) == (k, F)
    assert meta["codecs"] == documented_codecs("input_ids", "bf16")
    P = np.asarray(array[:])
    attributes = dict(array.attrs)
    assert set(attributes) == {
        "meaning",
        "captured",
        "calibration_tokens",
        "calibration_documents",
        "fingerprint_sha256",
        "sha256",
    }
    assert attributes["sha256"] == hashlib.sha256(P.astype("<f4").tobytes()).hexdigest()
    assert (
        attributes["fingerprint_sha256"]
        == hashlib.sha256(json.dumps(manifest["fingerprint"], sort_keys=True).encode()).hexdigest()
    )
    subspace = manifest["features"]["subspace"]
    for key in ("captured", "calibration_tokens", "calibration_documents"):
        assert attributes[key] == subspace[key]
    np.testing.assert_allclose(P @ P.T, np.eye(k), atol=1e-5)
    largest = np.take_along_axis(P, np.abs(P).argmax(1)[:, None], 1)
    assert (largest > 0).all()
    np.testing.assert_array_equal(np.asarray(Store.open(path).projection), P)

    # The calibration sample: the pieces of the data in default_rng(0).permutation order, the last one cut.
    pieces = sorted(reference)
    order = np.random.default_rng(0).permutation(len(pieces))
    sample, total = [], 0
    for i in order:
        h = reference[pieces[i]][: CALIBRATION_TOKENS - total]
        sample.append(h)
        total += len(h)
        if total >= CALIBRATION_TOKENS:
            break
    assert (len(sample), total) == (subspace["calibration_documents"], subspace["calibration_tokens"])
    h = np.concatenate(sample)
    moment = h.T @ h
    values = np.linalg.eigvalsh(moment)
    captured = values[-k:].sum() / values.sum()
    # the sample's features here are the stored bf16 ones, the calibration's the forward's own: close, not equal
    assert abs(subspace["captured"] - captured) < 2e-3
    assert abs(np.trace(P @ moment @ P.T) / np.trace(moment) - captured) < 2e-3  # P spans the top-k eigenvectors

    # The stored values: P h in bfloat16 (P rounded to bf16, float32 accumulation), then fp8 if asked.
    P_bf16 = torch.from_numpy(P).to(torch.bfloat16).double().numpy()
    stored = features_by_document(path)
    fp8 = manifest["features"]["precision"] == "fp8"
    for key, x in reference.items():
        projected = x @ P_bf16.T
        bound = np.abs(projected) * (2.0**-8 + (2.0**-4 if fp8 else 0)) + np.abs(x) @ np.abs(P_bf16.T) * 2.0**-14
        if fp8:  # and the subnormal floor of each token's scale
            bound += np.exp2(np.ceil(np.log2(np.abs(projected).max(-1, keepdims=True) * (1 + 2**-7) / 448)) - 10)
        assert (np.abs(stored[key] - projected) <= bound).all(), f"document {key}"


def test_the_topk_teacher_arrays_follow_the_docs(stores):
    path = stores["bf16"]
    manifest = manifest_of(path)
    teacher, K = manifest["teacher"], manifest["teacher"]["k"]
    assert teacher == {
        "kind": "topk",
        "k": K,
        "width": K,
        "arrays": {"teacher_ids": "int32", "teacher_probs": "float16", "teacher_tail": "float16"},
    }
    assert manifest["fingerprint"]["teacher"] == f"topk:{K}"
    arrays = plain_part(path, "rank00000")
    real = arrays["doc_ids"] >= 0
    probs, tail = arrays["teacher_probs"][real].astype(np.float64), arrays["teacher_tail"][real].astype(np.float64)
    assert (np.diff(probs, axis=-1) <= 0).all(), "probabilities are not most probable first"
    assert (np.abs(probs.sum(-1) + tail - 1) <= (K + 1) * 2.0**-11).all()
    ids = arrays["teacher_ids"][real]
    assert ((ids >= 0) & (ids < manifest["target"]["vocab_size"])).all()
    assert (np.sort(ids, -1)[:, 1:] != np.sort(ids, -1)[:, :-1]).all()


def test_the_reading_example_of_the_docs_runs_and_gives_the_readers_features(stores):
    example = re.search(r"## Reading a store with plain zarr\n\n```python\n(.*?)```", DOC, re.S).group(1)
    for mode in ("bf16", "fp8"):
        path = stores[mode]
        scope: dict = {}
        exec(example.replace('"/nvme/shards"', repr(str(path))), scope)
        reader = Store.open(path)
        doc_id, piece, row, start, length = reader.documents()[0].tolist()
        stored = reader.read_row(row)
        if mode == "bf16":
            expected = torch.from_numpy(stored["hidden"].view(np.int16)).view(torch.bfloat16).float()
        else:
            expected = dflash_features.dequantize_fp8(
                torch.from_numpy(stored["hidden"]), torch.from_numpy(stored["scales"]), torch.float32
            )
        torch.testing.assert_close(scope["features"].float(), expected[start : start + length], rtol=0, atol=0)
