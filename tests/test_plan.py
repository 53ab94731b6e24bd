"""`dflash plan`: its counts against a real harvest of the same data, its sampling error against the truth."""

import json
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from dflash import plan, store
from dflash.config import HarvestConfig, TrainConfig
from dflash.drafter.blocks import eligible_anchors
from dflash.harvest import run_harvest
from dflash.plan import estimate_data, mode_bytes, plan_report
from dflash.tiny import CORPUS

BUDGET = 256


def train_run(**options) -> TrainConfig:
    """The training run plan prices: train's options on some store."""
    return TrainConfig(store="store", out="run", **options)


@pytest.fixture(scope="module")
def model(tiny_target):
    return str(tiny_target("qwen3"))


def test_full_count_equals_the_harvest(model, tmp_path):
    cfg = HarvestConfig(
        model=model, data=str(CORPUS), out=str(tmp_path / "s"), token_budget=BUDGET, workers=1, device="cpu"
    )
    estimate = estimate_data(cfg, None)
    harvested = store.Store.open(run_harvest(cfg))
    counts = harvested.manifest.counts
    assert estimate.sampled == estimate.lines and estimate.tokens_error == 0
    assert (estimate.documents, estimate.tokens, estimate.loss_tokens, estimate.rows) == (
        counts.documents,
        counts.tokens,
        counts.loss_tokens,
        counts.rows,
    )
    # The anchor contexts: every position of the store's rows that can anchor a block, by its distance to its
    # document's first position.
    contexts = np.zeros(BUDGET, np.int64)
    for r in range(counts.rows):
        row = harvested.read_row(r)
        doc_ids = torch.from_numpy(row["doc_ids"].astype(np.int64))[None]
        eligible = eligible_anchors(torch.from_numpy(row["loss_mask"])[None], doc_ids, 16)[0].nonzero()[:, 0]
        for position in eligible.tolist():
            start = int((doc_ids[0] == doc_ids[0, position]).nonzero()[0])
            contexts[position - start] += 1
    np.testing.assert_array_equal(estimate.contexts, contexts)
    # The raw row size of the mode is what the store's row arrays hold per row, before the codec.
    raw, _ = mode_bytes(harvested.features, BUDGET)
    rows = [a for name, a in harvested.parts[0].items() if name not in ("documents", "digests")]
    per_row = sum(a.nbytes for a in rows) / counts.rows
    assert raw == per_row


def test_a_sample_is_scaled_up_within_its_stated_error(model, tmp_path):
    cfg = HarvestConfig(model=model, data=str(CORPUS), out=str(tmp_path / "s"), token_budget=BUDGET, workers=1)
    truth = estimate_data(cfg, None)
    sample = estimate_data(cfg, 60)
    assert sample.sampled == 60 and sample.lines == truth.lines and sample.tokens_error > 0
    assert abs(sample.tokens - truth.tokens) < 3 * sample.tokens_error
    assert sample.tokens != truth.tokens  # a sample, not the whole file


def test_plan_prints_every_mode_and_whether_it_fits(model, tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "plan",
            "--model",
            model,
            "--data",
            str(CORPUS),
            "--out",
            str(tmp_path / "s"),
            "--token-budget",
            str(BUDGET),
            "--workers",
            "1",
            "--precision",
            "fp8",
            "--subspace",
            "1/4",
        ],
    )
    assert result.exit_code == 0, result.output
    for mode in ("| bf16 |", "| fp8 |", "| sub1/4+fp8 |", "| sub1/8 |"):
        assert mode in result.output
    assert "the chosen mode (fp8, subspace 1/4)" in result.output and ": fits" in result.output
    assert "H200-hours" in result.output and not (tmp_path / "s").exists()
    assert "of weights (the checkpoint's files): whole on each GPU" in result.output
    # no --teacher: the plan names the method for sampled serving and the one for both temperatures (issue 52)
    teacher_line = " ".join(result.output.split())
    assert "train --method dspark" in teacher_line and "--drafter-option selector_top_k=64" in teacher_line
    bad = CliRunner().invoke(
        main, ["plan", "--model", model, "--data", str(CORPUS), "--out", str(tmp_path / "s"), "--sample", "1"]
    )
    assert bad.exit_code == 2 and "--sample 1" in bad.output


def test_plan_prints_the_weights_per_gpu_of_a_split_target(model, tmp_path):
    from dflash.parallel import checkpoint_bytes
    from dflash.plan import _size

    args = ["plan", "--model", model, "--data", str(CORPUS), "--out", str(tmp_path / "s"), "--workers", "1"]
    result = CliRunner().invoke(main, [*args, "--token-budget", str(BUDGET), "--tensor-parallel", "2"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("target "))
    per_gpu = checkpoint_bytes(model) / 2
    assert "split over --tensor-parallel 2" in line and f"{_size(per_gpu)} per GPU" in line, line
    assert "on each group of 2" in result.output


@pytest.mark.parametrize(
    "split, message",
    [
        ("3", "--tensor-parallel 3 does not divide the target's 4 attention heads and 2 KV heads"),
        ("4", "--tensor-parallel 4 does not divide the target's 2 KV heads"),
    ],
)
def test_plan_refuses_a_split_the_targets_heads_do_not_divide(model, tmp_path, split, message):
    """The harvest would crash on every process of the group: plan refuses to price it, in harvest's words."""
    args = ["plan", "--model", model, "--data", str(CORPUS), "--out", str(tmp_path / "s"), "--tensor-parallel", split]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert "pick a --tensor-parallel that divides" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "s").exists()


def test_plan_refuses_an_out_that_harvest_refuses_in_harvests_words(model, tmp_path):
    (tmp_path / "file").write_text("")
    for out, message in (
        (tmp_path / "file", "is a file, not a folder"),
        (tmp_path / "file" / "s", "is not writable"),
    ):
        outputs = []
        for command in ("plan", "harvest"):
            args = [command, "--model", model, "--data", str(CORPUS), "--out", str(out), "--workers", "1"]
            result = CliRunner().invoke(main, args + (["--device", "cpu"] if command == "harvest" else []))
            assert result.exit_code == 2 and message in result.output, (command, result.output)
            assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
            outputs.append(result.output)
        assert outputs[0] == outputs[1]


@pytest.mark.parametrize(
    "command, options, message",
    [
        ("plan", ["--subspace", "1/0"], "--subspace 1/0 is not a width between 1 and the feature width"),
        ("harvest", ["--subspace", "1/0"], "--subspace 1/0 is not a width between 1 and the feature width"),
        ("plan", ["--subspace", "0"], "--subspace 0 is not a width between 1 and the feature width"),
        ("plan", ["--layers=-1"], "bad --layers [-1]: [-1] outside the target's 8 layers"),
        ("harvest", ["--layers=-1"], "bad --layers [-1]: [-1] outside the target's 8 layers"),
        ("plan", ["--layers", "3,3"], "bad --layers [3, 3]: duplicates"),  # harvest refuses it: plan too
        ("plan", ["--layers", "4,2"], "bad --layers [4, 2]: not in increasing order"),
        ("plan", ["--token-budget", "64", "--max-length", "100"], "--max-length 100 must be between 1 and the token"),
        ("plan", ["--token-budget", "0"], "token budget 0 is too small to hold a block of 16 tokens"),
        ("harvest", ["--subspace", "1/4", "--projection-from", "/nonexistent"], "/nonexistent is not a dflash store"),
        ("harvest", ["--self-check=-1"], "--self-check -1 must be at least 0 (0 skips the check)"),
        ("plan", ["--method", "dflash", "--block-size", "0"], "--block-size 0 drafts no token; give --block-size 2"),
        ("plan", ["--method", "dflash", "--block-size", "1"], "--block-size 1 drafts no token; give --block-size 2"),
        ("plan", ["--token-budget", "16", "--method", "dflash", "--block-size", "32"], "cannot hold a block of 32 "),
        (
            "plan",
            ["--data", "WEIGHTED:0.01"],
            "takes round(0.01 x 50 records) = 0 of them; give it a weight of at least 0.02",
        ),
    ],
)
def test_bad_options_are_one_line_naming_the_problem_and_the_fix(model, tmp_path, command, options, message):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(CORPUS.read_text().splitlines(keepends=True)[:50]))
    options = [str(data) + option[len("WEIGHTED") :] if option.startswith("WEIGHTED") else option for option in options]
    args = [command, "--model", model, "--out", str(tmp_path / "s"), "--workers", "1"]
    args += [] if "--data" in options else ["--data", str(data)]
    result = CliRunner().invoke(main, args + (["--device", "cpu"] if command == "harvest" else []) + options)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "s").exists()


def test_a_padded_stores_size_on_disk_counts_its_padding_as_zeros(model, tmp_path):
    text = " ".join(CORPUS.read_text().splitlines()[:3])  # one document, most of its row left as padding
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"text": text}) + "\n")
    cfg = HarvestConfig(model=model, data=str(data), out=str(tmp_path / "s"), token_budget=2048, workers=1)
    assert estimate_data(cfg, None).padding > 0.6
    report = plan_report(cfg, None, train_run(epochs=1, draft_layers=1))
    units = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    sizes = re.search(r"needs ([\d.]+) (\w+) raw, ~([\d.]+) (\w+) on disk", report).groups()
    raw, on_disk = (float(sizes[i]) * units[sizes[i + 1]] for i in (0, 2))
    run_harvest(replace(cfg, device="cpu"))
    stored = sum(f.stat().st_size for f in (tmp_path / "s").rglob("*") if f.is_file())
    assert stored < 0.5 * raw and 0.8 < on_disk / stored < 1.5, (raw, on_disk, stored)


def test_plan_prints_the_train_steps_memory_and_the_anchors_that_fit(model, tmp_path, monkeypatch):
    """Train's default anchors grow with the row: plan says whether they fit an H200, and else which count does."""
    from dflash.harvest import check_options, feature_encoding, tapped_layers

    cfg = HarvestConfig(model=model, data=[str(CORPUS)], out=str(tmp_path / "s"), token_budget=BUDGET, workers=1)
    default = round(BUDGET * 512 / 3072)
    fits = re.search(
        r"drafter \(train's default method\), (\d+) anchors a row .*: ~[\d.,]+ \w+ on a GPU, .*: fits$",
        plan_report(cfg, None, train_run(epochs=1, draft_layers=2)),
        re.M,
    )
    assert fits and int(fits.group(1)) == default
    # on a GPU with the memory the estimate gives half the default anchors, the line names the most that fit
    config = plan.load_config(model)
    layers = tapped_layers(check_options(cfg), config.get_text_config().num_hidden_layers)
    encoding = feature_encoding(cfg, len(layers), len(layers) * config.get_text_config().hidden_size)
    row_raw = mode_bytes(encoding, BUDGET)[0]
    method = plan.methods.get("dflash2")
    dcfg = method.config_cls.from_target_config(config, layers, 0, num_layers=2, block_size=16)
    chunk, params = plan.loss.default_chunk_size(dcfg.vocab_size), plan.memory.parameter_count(method.model_cls, dcfg)
    totals = {
        a: sum(
            plan.memory.step_memory(
                dcfg, plan.memory.StepShape(1, 1, BUDGET, a, chunk, row_raw, params, 0, True)
            ).values()
        )
        for a in range(1, default + 1)
    }
    layer_params = plan.memory.parameter_count(method.model_cls, dcfg, layers_only=True)
    pointwise = plan.memory.StepShape(
        1, 1, BUDGET, default, chunk, row_raw, params, 0, True, recompute="pointwise", layer_parameters=layer_params
    )
    lighter = sum(plan.memory.step_memory(dcfg, pointwise).values())
    assert lighter < totals[default]
    assert f"~{plan._size(lighter)} with --recompute pointwise" in plan_report(
        cfg, None, train_run(epochs=1, draft_layers=2)
    )
    monkeypatch.setattr(plan, "H200_MEMORY", totals[default // 2])
    report = plan_report(cfg, None, train_run(epochs=1, draft_layers=2))
    most = max(a for a, t in totals.items() if t <= totals[default // 2])
    assert next(line for line in report.splitlines() if line.startswith("memory ")).endswith(
        f"does not fit: --anchors {most} does"
    )
    # train would refuse the default and name `most`: the hours are priced at those
    train = next(line for line in report.splitlines() if line.startswith("train "))
    assert (
        f", {most} anchors a row (the most that fit an H200: train's default for {BUDGET} tokens, {default}, " in train
    )


def row_seconds(report: str) -> list[float]:
    """The train lines' seconds a row: the default method's context choice, then the other."""
    lines = report[report.index("\ntrain ") :].splitlines()[1:3]
    return [float(re.search(r"~([\d.e+-]+) s a row", line)[1]) for line in lines]


def test_plan_prices_the_window_against_full_context_where_the_documents_reach_it(model, tmp_path):
    texts = [json.loads(line).get("text", "") for line in CORPUS.read_text().splitlines()]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(texts[i : i + 40])}) + "\n" for i in range(0, 120, 40)))
    long = HarvestConfig(model=model, data=str(data), out=str(tmp_path / "s"), token_budget=8192, workers=1)
    assert np.flatnonzero(estimate_data(long, None).contexts).max() > 2048
    report = plan_report(long, None, train_run(epochs=1))
    assert (
        "dflash2 drafter (train's default method), 1365 anchors a row (train's default for 8192 tokens), its "
        "2048-token window:" in report
    )
    window, full = row_seconds(report)
    assert 0 < window < full and "no block's context here reaches" not in report
    short = replace(long, data=str(CORPUS), token_budget=BUDGET)
    report = plan_report(short, None, train_run(epochs=1))
    window, full = row_seconds(report)
    assert window == full and "(no block's context here reaches 2048 tokens)" in report


def test_plan_prices_a_head_dim_256_drafter_also_at_128_and_names_an_unmeasured_head_dim(tiny_target, tmp_path):
    wide = str(tiny_target("qwen3", num_layers=3, hidden_size=1024))  # 4 heads of 256, as Qwen3.5's drafters
    cfg = HarvestConfig(model=wide, data=str(CORPUS), out=str(tmp_path / "s"), token_budget=BUDGET, workers=1)
    cfg = replace(cfg, layers=[0, 1])
    report = plan_report(cfg, None, train_run(epochs=1, method="dflash"))
    train = report[report.index("\ntrain ") :].splitlines()[1:6]
    assert train[2].startswith(
        "           full context at head_dim 128, its widths kept (--drafter-option head_dim=128"
    )
    assert train[3].startswith("           full context with --attention-kernel-option BACKEND=FLASH")
    full, at_128, flash = (float(re.search(r"~([\d.e+-]+) s a row", line)[1]) for line in train[0:1] + train[2:4])
    assert 0 < at_128 < full and 0 < flash < full  # only the attention is faster: at BUDGET-token rows, a little
    assert "TFLOP/s at head_dim 256;" in train[4]
    narrow = replace(cfg, model=str(tiny_target("qwen3")), layers=None)
    narrow = plan_report(narrow, None, train_run(epochs=1, method="dflash"))
    assert "head_dim 16 priced at 256's" in narrow and "at head_dim 128, its widths kept" not in narrow
    assert "BACKEND=FLASH" not in narrow  # measured at 256 only


def test_plan_says_when_no_document_can_anchor_a_block(model, tmp_path):
    data = tmp_path / "short.jsonl"
    data.write_text("".join(json.dumps({"text": "Hi there."}) + "\n" for _ in range(5)))
    cfg = HarvestConfig(model=model, data=str(data), out=str(tmp_path / "s"), token_budget=BUDGET, workers=1)
    report = plan_report(cfg, None, train_run(epochs=1))
    assert "nothing to train on: no position here can anchor a block of 16 tokens" in report
    assert "nan" not in report and "H200-hours for" not in report


def test_plan_prices_the_method_and_anchors_given_and_refuses_anchors_that_do_not_fit(model, tmp_path):
    args = ["plan", "--model", model, "--data", str(CORPUS), "--out", str(tmp_path / "s"), "--workers", "1"]
    args += ["--token-budget", str(BUDGET)]
    result = CliRunner().invoke(main, [*args, "--method", "dflash", "--anchors", "20"])
    assert result.exit_code == 0, result.output
    train = result.output[result.output.index("\ntrain ") :]
    assert "epochs of a 5-layer dflash drafter, 20 anchors a row, full context: ~" in train
    assert "with a 2048-token window (--drafter-option sliding_window=2048)" in train
    assert "memory     a train step of a 5-layer dflash drafter, 20 anchors a row, on one row" in train
    fewer = CliRunner().invoke(main, [*args, "--method", "dflash", "--anchors", "10"]).output
    assert row_seconds(fewer)[0] < row_seconds(result.output)[0]  # half the blocks: less of everything but fc
    bad = CliRunner().invoke(main, [*args, "--anchors", str(BUDGET)])
    assert bad.exit_code == 2 and f"--anchors {BUDGET} cannot fit a {BUDGET}-token row" in bad.output, bad.output
    assert len(bad.output.strip().splitlines()) == 1


@pytest.mark.parametrize("heads, repeat", [(24, 3), (16, 1)])
def test_the_memory_line_prices_the_kv_copies_of_the_flash_backend(heads, repeat):
    """bench/train.py's drafters at 4 x 3072 tokens: 24 query heads over 4 K / V heads run as 3 copies of each K / V
    head under FLASH, each copy a [tokens, 4 x 256] bf16 K and V of every layer (one layer at a time under
    --recompute pointwise); 16 / 4 is a power-of-two group, with no copies and no line."""
    method = plan.methods.get("dflash")
    dcfg = method.config_cls(
        hidden_size=2560, intermediate_size=9216, num_attention_heads=heads, num_key_value_heads=4, head_dim=256,
        num_layers=5, vocab_size=248320, mask_token_id=0, target_layer_ids=[1, 8, 15, 22, 29], num_target_layers=32,
    )  # fmt: skip
    token_budget, anchors = 12288, 2048
    no_lift = type("Encoding", (), {"subspace": None, "width": 0})
    step = plan._step_memory(method, dcfg, token_budget, anchors, 10**8, no_lift)
    assert step.kv_repeat == repeat
    copy_bytes = (token_budget + anchors * dcfg.block_size) * 2 * (repeat - 1) * 4 * 256 * 2  # K and V, bf16
    assert step.flash[0] - step.need == pytest.approx(dcfg.num_layers * copy_bytes, rel=1e-6)
    assert step.flash[1] - step.pointwise == pytest.approx(copy_bytes, rel=1e-6)
    lines = plan._memory_lines("5-layer dflash drafter", step, anchors)
    assert len(lines) == (2 if repeat > 1 else 1)
    if repeat > 1:
        assert f"with BACKEND=FLASH each K / V head is repeated {repeat}x" in lines[1]
        assert f"~{plan._size(step.flash[1])} with --recompute pointwise" in lines[1]
