"""The compact store's encodings against independent references: FP8 against float64 and a bit-level e4m3
decoder written from the format's definition; the subspace against a float64 eigendecomposition; harvests of
each mode read back with plain zarr + numpy by following docs/shard-format.md alone."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
import zarr

from dflash import features, store
from dflash.config import HarvestConfig
from dflash.harvest import run_harvest
from dflash.tiny import CORPUS

BUDGET = 256


def e4m3_reference(bits: np.ndarray) -> np.ndarray:
    """float8 e4m3fn bits -> float64, from the OCP definition: 1 sign, 4 exponent (bias 7), 3 mantissa bits;
    exponent 0 is subnormal; S.1111.111 is NaN; no infinities."""
    bits = bits.astype(np.int64)
    sign = np.where(bits >> 7, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    normal = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    subnormal = (mantissa / 8) * 2.0**-6
    value = sign * np.where(exponent == 0, subnormal, normal)
    return np.where((exponent == 15) & (mantissa == 7), np.nan, value)


def residual_like(tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    """Features with a residual stream's shape: most values O(1), a few channels 1000x larger, a zero token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=g, dtype=torch.float64)
    x[:, [3, width // 2]] *= 1000.0  # outlier channels
    x[:, 7] *= 1e-5  # a channel far below the others
    x[5] = 0.0  # padding
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("groups", [1, 4])
def test_fp8_round_trip_is_within_the_e4m3_bound(groups):
    x = residual_like(64, 256)
    bits, exponents = features.quantize_fp8(x, groups)
    assert bits.dtype == torch.uint8 and exponents.dtype == torch.int8 and exponents.shape == (64, groups)
    decoded = features.dequantize_fp8(bits, exponents, torch.float64)
    reference = x.double()
    error = (decoded - reference).abs()
    assert (error <= features.fp8_error_bound(x, groups)).all()
    assert (decoded[5] == 0).all()
    # Independent decode of the stored bytes: e4m3 by its definition, times 2**exponent.
    by_hand = e4m3_reference(bits.numpy()).reshape(64, groups, -1) * 2.0 ** exponents.numpy()[..., None].astype(
        np.float64
    )
    np.testing.assert_array_equal(by_hand.reshape(64, -1), decoded.numpy())
    # Every group uses e4m3's top binade: its largest scaled value rounds into [224, 448].
    scaled_max = np.abs(e4m3_reference(bits.numpy())).reshape(64, groups, -1).max(-1)
    nonzero = reference.reshape(64, groups, -1).abs().amax(-1).numpy() > 0
    assert ((scaled_max[nonzero] >= 224) & (scaled_max[nonzero] <= 448)).all()


def test_fp8_relative_error_is_at_most_one_sixteenth_for_normal_values():
    x = (torch.rand(4096, dtype=torch.float64) * 2 - 1).mul(300).to(torch.bfloat16)[None]
    decoded = features.dequantize_fp8(*features.quantize_fp8(x, 1), torch.float64)
    big = x.double().abs() > 448 * 2.0**-6 * 2  # scaled value in the normal range
    rel = ((decoded - x.double()).abs() / x.double().abs())[big]
    assert rel.max() <= 2.0**-4 and rel.mean() < 0.03


def test_top_subspace_matches_a_float64_eigendecomposition():
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(48, 48, generator=g, dtype=torch.float64))[0]
    scales = torch.logspace(0, -3, 48, dtype=torch.float64)
    h = torch.randn(2000, 48, generator=g, dtype=torch.float64) * scales @ basis.T
    moment = features.SecondMoment(48, torch.device("cpu"))
    moment.add(h[:1000].float())
    moment.add(h[1000:].float())
    assert moment.tokens == 2000
    torch.testing.assert_close(moment.sum, h.float().double().T @ h.float().double())
    projection, captured = features.top_subspace(moment.sum, 12)
    assert projection.shape == (12, 48) and projection.dtype == torch.float32
    torch.testing.assert_close(
        projection.double() @ projection.double().T, torch.eye(12, dtype=torch.float64), atol=1e-6, rtol=0
    )
    values = torch.linalg.eigvalsh(moment.sum)
    assert captured == pytest.approx((values[-12:].sum() / values.sum()).item(), rel=1e-9)
    # The subspace is the top-12 one: the projector equals the brute-force one from the eigenvectors.
    vectors = torch.linalg.eigh(moment.sum)[1][:, -12:]
    torch.testing.assert_close(projection.double().T @ projection.double(), vectors @ vectors.T, atol=1e-6, rtol=0)
    # Signs are fixed by the moment alone: each row's largest entry is positive.
    assert (projection.gather(1, projection.abs().argmax(1, keepdim=True)) > 0).all()
    again, _ = features.top_subspace(moment.sum.clone(), 12)
    assert torch.equal(again, projection)


# ---------------------------------------------------------------------------------------------- harvests


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("\n".join(CORPUS.read_text().splitlines()[:40]) + "\n")
    return path


@pytest.fixture(scope="module")
def harvest(tiny_target, data_file, tmp_path_factory):
    """Factory: a one-rank store of the data for the tiny qwen3 target in the given encoding."""
    made = {}

    def make(**encoding):
        key = tuple(sorted(encoding.items()))
        if key not in made:
            out = tmp_path_factory.mktemp("store") / "s"
            run_harvest(
                HarvestConfig(
                    model=str(tiny_target("qwen3")),
                    data=str(data_file),
                    out=str(out),
                    token_budget=BUDGET,
                    forward_tokens=2 * BUDGET,
                    dtype="float32",
                    workers=1,
                    device="cpu",
                    **encoding,
                )
            )
            made[key] = out
        return made[key]

    return make


def plain_read(path, part: str, row: int) -> np.ndarray:
    """A row's features as float64, by docs/shard-format.md alone: zarr, json and numpy, no dflash code."""
    manifest = json.loads((path / "manifest.json").read_text())
    group = zarr.open_group(path, mode="r")
    hidden = group[f"parts/{part}/hidden"][row]
    if manifest["features"]["precision"] == "bf16":
        values = (hidden.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    else:
        exponents = group[f"parts/{part}/scales"][row].astype(np.float64)
        groups = manifest["features"]["scale_groups"]
        values = (e4m3_reference(hidden).reshape(len(hidden), groups, -1) * 2.0 ** exponents[..., None]).reshape(
            len(hidden), -1
        )
    return values


@pytest.mark.parametrize(
    "encoding", [dict(precision="fp8"), dict(subspace="1/4"), dict(subspace="1/4", precision="fp8")]
)
def test_each_mode_stores_the_encoded_bf16_features(harvest, encoding):
    """Every stored value equals the encoding applied to the bf16 store's value at the same place, within the
    encoding's own error: P h (bf16 matmul) for the subspace, the e4m3 bound for fp8."""
    full_path, path = harvest(), harvest(**encoding)
    full, compact = store.Store.open(full_path), store.Store.open(path)
    m = compact.manifest
    assert m.format_version == store.FORMAT_VERSION and m.features.precision == encoding.get("precision", "bf16")
    assert (m.features.subspace is not None) == ("subspace" in encoding)
    assert compact.num_rows == full.num_rows and np.array_equal(compact.documents(), full.documents())
    width = m.feature_dim // 4 if "subspace" in encoding else m.feature_dim
    assert m.features.width == width
    projection = None
    if "subspace" in encoding:
        projection = zarr.open_array(path / "projection", mode="r")[:].astype(np.float64)
        assert projection.shape == (width, m.feature_dim)
        np.testing.assert_allclose(projection @ projection.T, np.eye(width), atol=1e-5)
        assert 0.5 < m.features.subspace.captured <= 1 and m.features.subspace.calibration_tokens > 0
    for row in range(compact.num_rows):
        reference = plain_read(full_path, "rank00000", row)
        stored = plain_read(path, "rank00000", row)
        tokens_full, tokens_compact = full.read_row(row), compact.read_row(row)
        for name in store.TOKEN_ARRAYS:
            np.testing.assert_array_equal(tokens_full[name], tokens_compact[name])
        expected, slack = reference, 0.0
        if projection is not None:  # computed in bf16 (tensor cores on a GPU): P and the result are rounded
            expected = reference @ projection.T
            slack = (np.abs(reference) @ np.abs(projection.T)) * 2.0**-8 + np.abs(expected) * 2.0**-8
        if m.features.precision == "fp8":
            bound = features.fp8_error_bound(torch.from_numpy(expected), m.features.scale_groups).numpy() * 1.01
        else:
            bound = 0.0
        assert (np.abs(stored - expected) <= bound + 2 * slack).all()
        assert (stored[tokens_full["doc_ids"] < 0] == 0).all()  # padding stays zero


def test_compact_modes_take_the_bytes_they_promise(harvest):
    """fp8 halves the hidden bytes and a quarter subspace quarters them, before the codec; inspect says so."""
    raw = {}
    for encoding in [{}, dict(precision="fp8"), dict(subspace="1/4"), dict(subspace="1/4", precision="fp8")]:
        opened = store.Store.open(harvest(**encoding))
        hidden = opened.parts[0]["hidden"]
        raw[tuple(encoding.items())] = hidden.nbytes
    full = raw[()]
    assert raw[(("precision", "fp8"),)] * 2 == full
    assert raw[(("subspace", "1/4"),)] * 4 == full
    assert raw[(("subspace", "1/4"), ("precision", "fp8"))] * 8 == full


def test_bad_subspace_and_groups_are_refused(harvest, tiny_target, data_file, tmp_path):
    from dflash.errors import DflashError

    base = dict(model=str(tiny_target("qwen3")), data=str(data_file), token_budget=BUDGET, workers=1, device="cpu")
    with pytest.raises(DflashError, match=r"--subspace 99999 is not a width between 1 and the feature width"):
        run_harvest(HarvestConfig(out=str(tmp_path / "a"), subspace="99999", **base))
    with pytest.raises(DflashError, match="--scale-groups .* only with --precision fp8"):
        run_harvest(HarvestConfig(out=str(tmp_path / "b"), scale_groups=2, **base))
    with pytest.raises(DflashError, match="does not divide the stored width"):
        run_harvest(HarvestConfig(out=str(tmp_path / "c"), precision="fp8", scale_groups=7, **base))
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


# ---------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("encoding", [dict(precision="fp8"), dict(subspace="1/4", precision="fp8")])
def test_a_drafter_trained_on_a_compact_store_exports_a_standard_one(harvest, tiny_target, tmp_path, encoding):
    """Training reads the compact rows (fp8 decoded inside the step) and the export is the standard layout: fed
    full features h, the exported drafter gives the logits the trained drafter gives on P h (float32)."""
    from dflash import methods
    from dflash.config import TrainConfig
    from dflash.export import load_drafter
    from dflash.target_files import load_embedding_and_head
    from dflash.train.checkpoint import Checkpointer, drafter_config_of, read_state
    from dflash.train.run import run_training

    path = harvest(**encoding)
    run = tmp_path / "run"
    result = run_training(
        TrainConfig(
            store=str(path),
            out=str(run),
            draft_layers=1,
            block_size=4,
            rows_per_step=2,
            max_steps=4,
            log_every=2,
            val_fraction=0.1,
            tensorboard=False,
            export=True,
            export_dtype="float32",
            reader_workers=1,
            device="cpu",
        )
    )
    assert result["export"] == str(run / "drafter")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in records if r["kind"] == "train")
    exported, config = load_drafter(run / "drafter", dtype=torch.float32)
    raw_config = json.loads((run / "drafter" / "config.json").read_text())
    assert raw_config["hidden_size"] == config.hidden_size
    full_store, compact = store.Store.open(harvest()), store.Store.open(path)
    assert exported.fc.weight.shape == (config.hidden_size, full_store.feature_dim)
    assert sorted(exported.state_dict()) == config.checkpoint_keys()

    checkpoint = Checkpointer(run).latest()
    trained_config = drafter_config_of(read_state(checkpoint))  # the default method's: DFlash 2
    assert type(exported) is methods.of_config(trained_config).model_cls
    trained = methods.model_for(trained_config)
    trained.load_state_dict(torch.load(checkpoint / "model.pt"))
    row = full_store.read_row(0)
    h = torch.from_numpy(row["hidden"].view(np.int16)).view(torch.bfloat16).double()[None]  # [1, T, n*H]
    if compact.projection is not None:  # the trainer's input: P h as stored, lifted back to P^T P h
        projection = torch.from_numpy(compact.projection).double()
        seen = (h @ projection.T) @ projection
        assert (seen - h).abs().max() > 1e-3  # not the full features: the export's fold is what the test checks
    else:
        seen = h
    T = h.shape[1]
    embed, head = (w.float() for w in load_embedding_and_head(str(tiny_target("qwen3"))))
    block = torch.tensor([[int(row["input_ids"][5]), *[trained_config.mask_token_id] * 3]])
    positions = torch.arange(6, 10)[None]
    context = torch.arange(T)[None]
    mask = (torch.arange(T + 4)[None, :] < 6) | (torch.arange(T + 4)[None, :] >= T)  # context before the anchor
    mask = mask[:, None, None, :].expand(1, 1, 4, T + 4)
    with torch.no_grad():
        ours = trained(embed[block], seen.float(), positions, context, mask) @ head.T
        theirs = exported(embed[block], h.float(), positions, context, mask) @ head.T
    assert ours.abs().max() > 0.1  # logits of a real size, so that the tolerance below means something
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_a_harvest_that_cannot_fit_is_refused_before_the_target_loads(tiny_target, data_file, tmp_path, monkeypatch):
    import shutil as shutil_module
    from collections import namedtuple

    from dflash.errors import DflashError
    from dflash.harvest import driver

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    monkeypatch.setattr(driver, "TappedTarget", lambda *a, **k: pytest.fail("the target must not load"))
    # Sizes in a unit that shows them (not "need 0.0 GB"): this one's rows take megabytes, the disk has 1000 bytes.
    sizes = r"need \d+\.\d MB before compression, \S+ has 1\.0 KB free"
    with pytest.raises(DflashError, match=rf"cannot fit: the rows left {sizes} .*--precision fp8"):
        run_harvest(
            HarvestConfig(
                model=str(tiny_target("qwen3")),
                data=str(data_file),
                out=str(tmp_path / "s"),
                token_budget=BUDGET,
                workers=1,
                device="cpu",
            )
        )
    assert not (tmp_path / "s").exists()


def test_a_leftover_projection_of_other_settings_is_refused(harvest, tiny_target, data_file, tmp_path):
    """A subspace harvest stopped after its calibration, rerun into the same folder with other settings, must not
    project with the old matrix."""
    from dflash.errors import DflashError

    out = tmp_path / "s"
    out.mkdir()
    shutil.copytree(harvest(subspace="1/4") / store.PROJECTION, out / store.PROJECTION)
    with pytest.raises(DflashError, match="holds the projection of a harvest with other settings"):
        run_harvest(
            HarvestConfig(
                model=str(tiny_target("qwen3")),
                data=str(data_file),
                out=str(out),
                token_budget=BUDGET,
                workers=1,
                device="cpu",
                subspace="1/4",
                calibration_tokens=999,
            )
        )


def test_a_missing_projection_chunk_is_refused_and_repair_recomputes_it(harvest, tiny_target, data_file, tmp_path):
    """P read back as zarr's fill value would be P = 0 for training and export: open and verify refuse it naming
    --repair, which recomputes the calibration, checks it is the rows' matrix and restores the store bit for bit;
    a recomputation that differs (another device) is refused with the damaged array put back."""
    from click.testing import CliRunner

    from cli.main import main
    from dflash.errors import DflashError

    reference, out = harvest(subspace="1/4"), tmp_path / "s"
    shutil.copytree(reference, out)
    chunk = out / store.PROJECTION / "c" / "0" / "0"
    chunk.unlink()
    result = CliRunner().invoke(main, ["inspect", str(out), "--verify"])
    assert result.exit_code == 2, result.output
    assert "projection of" in result.output and "chunk file c/0/0 missing" in result.output
    assert "rerun the harvest command (with --repair once the store is complete), which recomputes it" in result.output
    config = HarvestConfig(
        model=str(tiny_target("qwen3")),
        data=str(data_file),
        out=str(out),
        token_budget=BUDGET,
        forward_tokens=2 * BUDGET,
        dtype="float32",
        workers=1,
        device="cpu",
        subspace="1/4",
        repair=True,
    )
    top_subspace = features.top_subspace

    def on_another_device(*args):
        projection, captured = top_subspace(*args)
        return projection * (1 + 2**-20), captured

    features.top_subspace = on_another_device
    try:
        with pytest.raises(DflashError, match="recomputed projection .* is not the one its rows were encoded with"):
            run_harvest(config)
    finally:
        features.top_subspace = top_subspace
    assert not chunk.exists() and (out / store.PROJECTION / "zarr.json").exists()  # the damaged one, put back
    assert not [p for p in out.iterdir() if p.name.startswith(store.TMP_PREFIX)]
    run_harvest(config)
    files = {str(f.relative_to(out)): f.read_bytes() for f in out.rglob("*") if f.is_file() and f.name != ".lock"}
    expected = {
        str(f.relative_to(reference)): f.read_bytes() for f in reference.rglob("*") if f.is_file() and f.name != ".lock"
    }
    assert files == expected
    assert CliRunner().invoke(main, ["inspect", str(out), "--verify"]).exit_code == 0

    # A stopped harvest (no manifest, rows left) with the same damage: the plain rerun recomputes it and resumes.
    (out / store.MANIFEST_FILE).unlink()
    progress_file = out / "parts" / "rank00000" / store.PROGRESS_FILE
    progress = json.loads(progress_file.read_text())
    progress_file.write_text(json.dumps({**progress, "rows_committed": progress["rows"] - 1}))
    chunk.unlink()
    run_harvest(dataclasses.replace(config, repair=False))
    assert chunk.read_bytes() == (reference / store.PROJECTION / "c" / "0" / "0").read_bytes()
    assert store.Store.open(out).num_rows == store.Store.open(reference).num_rows
