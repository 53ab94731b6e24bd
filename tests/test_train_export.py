"""The trainer's exports, CLI, held-out stores and bad input, every drafter method's exact resume, and the GPU-only
checks of its CUDA graph and attention kernels."""

import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from train_support import METHOD_OPTIONS, B, assert_same_validation, config, copy_store, manifest_edit, train_cli

from cli.main import main
from dflash.config import TrainConfig
from dflash.drafter import graph
from dflash.errors import DflashError
from dflash.export import load_drafter
from dflash.store import Store
from dflash.train import Trainer, reader
from dflash.train.checkpoint import fingerprint
from dflash.train.run import run_training
from dflash.train.setup import init_distributed

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


def test_dflash2_trains_against_a_teacher_store_unless_told_and_exports_the_same_tensors(store_for, tmp_path):
    """From a top-k teacher store DFlash 2 reads the teacher (teacher_loss auto: other losses than on hard labels
    from the same start), --teacher-loss off trains as from a store without one, and both export the same tensor
    names and shapes (the loss changes nothing an engine reads); a validation store without the teacher is refused."""
    from safetensors import safe_open

    options, path = METHOD_OPTIONS["dflash2-distill"], store_for("dflash2-distill")
    runs = {}
    for mode in ("auto", "off"):
        cfg = config(path, tmp_path / mode, max_steps=3, export=True, teacher_loss=mode, **options)
        trainer = Trainer(cfg, init_distributed("cpu"))
        assert bool(trainer.teacher_names) == (mode == "auto")
        runs[mode] = run_training(cfg)
    losses = {mode: [r["loss"] for r in run["records"] if r["kind"] == "train"] for mode, run in runs.items()}
    assert losses["auto"] != losses["off"]
    tensors = {}
    for mode in runs:
        with safe_open(tmp_path / mode / "drafter" / "model.safetensors", "pt") as f:
            tensors[mode] = {k: f.get_slice(k).get_shape() for k in f.keys()}
    assert tensors["auto"] == tensors["off"] and any(k.startswith("candidate_selector.") for k in tensors["auto"])
    with pytest.raises(DflashError, match="--teacher-loss off"):
        val = dict(val_store=str(store_for("dflash2")), allow_val_overlap=True)  # the same documents, no teacher
        Trainer(config(path, tmp_path / "val", **val, **options), init_distributed("cpu"))


def _bits(values) -> torch.Tensor:
    """A store array as a tensor, bf16 bits (uint16) as int16."""
    values = np.asarray(values)
    return torch.from_numpy(values.view(np.int16) if values.dtype == np.uint16 else values)


def test_exports_with_the_target_embeddings_carry_those_the_run_trained_with(store, target, tiny_target, tmp_path):
    """`train --export-with-target-embeddings` and `export --with-target-embeddings` (for DeepSpec's evaluator)
    write the embedding and LM head of the run's target; the default export has neither."""
    from safetensors.torch import load_file

    from dflash.target_files import load_embedding_and_head

    run = tmp_path / "run"
    run_training(config(store, run, max_steps=2, export=True, export_with_target_embeddings=True))
    runner = CliRunner()
    for out, flags in (("again", ["--with-target-embeddings"]), ("plain", [])):
        result = runner.invoke(main, ["export", str(run), "--out", str(tmp_path / out), *flags])
        assert result.exit_code == 0, result.output
    embed, head = load_embedding_and_head(str(target))
    for folder in (run / "drafter", tmp_path / "again"):
        saved = load_file(folder / "model.safetensors")
        assert torch.equal(saved["embed_tokens.weight"], embed.to(torch.bfloat16))
        assert torch.equal(saved["lm_head.weight"], head.to(torch.bfloat16))
    assert {"embed_tokens.weight", "lm_head.weight"}.isdisjoint(load_file(tmp_path / "plain" / "model.safetensors"))
    args = ["export", str(run), "--out", str(tmp_path / "other"), "--with-target-embeddings"]
    other = runner.invoke(main, [*args, "--target", str(tiny_target("qwen3_5"))])
    assert other.exit_code == 2 and "holds other weights" in other.output, other.output


def test_cli_trains_and_exports(store, tmp_path):
    result = train_cli(store, tmp_path / "run", "--export", "--val-every", "1", "--log-every", "1", "--tensorboard")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "drafter" / "model.safetensors").exists()
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))
    kinds = [r["kind"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())]
    assert kinds == ["val", "train", "train", "val"]


def test_only_the_first_rank_says_where_the_drafter_was_written(monkeypatch, tmp_path):
    """Under torchrun every rank's result names the export (rank 0 wrote it): rank 0 alone prints it."""
    import dflash.train.run

    monkeypatch.setattr(dflash.train.run, "run_training", lambda cfg: {"export": "RUN/drafter"})
    for rank, printed in (("0", True), ("1", False)):
        args = ["train", "--shards", str(tmp_path), "--out", str(tmp_path / "run")]
        result = CliRunner().invoke(main, args, env={"RANK": rank, "WORLD_SIZE": "2"})
        assert result.exit_code == 0, result.output
        assert ("drafter written to RUN/drafter" in result.output) is printed, result.output


def _initial_validation(cfg: TrainConfig) -> tuple[dict, "Trainer"]:
    """Validation with the seed's initial weights (prepare restores them after its warm-up steps)."""
    trainer = Trainer(cfg, init_distributed("cpu"))
    trainer.prepare(None)
    return trainer.validate(0), trainer


def test_val_store_validates_on_the_other_store_and_trains_on_every_row(store, other_store, tmp_path):
    on_other, trainer = _initial_validation(config(store, tmp_path / "a", val_store=str(other_store)))
    # Trained on other rows, validated on the same documents (a copy: a store cannot hold out itself).
    same = copy_store(other_store, tmp_path / "same")
    reference, _ = _initial_validation(config(other_store, tmp_path / "b", val_store=str(same), allow_val_overlap=True))
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
        shards = copy_store(store, tmp_path / "store")
        (shards / "manifest.json").unlink()
        expected = "incomplete store"
    elif case == "format_version":
        shards = copy_store(store, tmp_path / "store")
        manifest_edit(shards, format_version=99)
        expected = "format version 99"
    elif case == "corrupt_chunk":
        shards = copy_store(store, tmp_path / "store")
        expected = f"row {_corrupt_first_row(shards)} "
    elif case == "head_shape":  # (other weights too: allowed, to reach the shapes)
        other = str(tiny_target("qwen3", hidden_size=32))
        extra, expected = ["--target", other, "--allow-other-target-weights"], "hidden size 64"
    elif case == "block_too_big":
        extra, expected = ["--block-size", "128"], "cannot hold a block of 128"
    elif case == "too_many_anchors":
        extra, expected = ["--anchors", "200"], "lower --anchors"
    elif case == "val_store":
        other = copy_store(store, tmp_path / "other")
        manifest = json.loads((other / "manifest.json").read_text())
        fingerprint = {**manifest["fingerprint"], "dtype": "float64"}
        # (not token_budget: a store now checks its manifest's row shape against its arrays on open)
        manifest_edit(other, layer_ids=manifest["layer_ids"][::-1], fingerprint=fingerprint)
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
        assert train_cli(store, tmp_path / "run").exit_code == 0
        extra, expected = ["--resume", "--seed", "1"], "seed: checkpoint 0, now 1"
    result = train_cli(shards, tmp_path / "run", *extra)
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


def head_dim_only(target: Path, head_dim: int) -> dict:
    """Drafter options that change only the head dim, the target's heads kept: `head_dim` alone keeps the attention
    widths instead, and this target's (4 and 2 heads of 16) do not divide into heads of 64 to 256."""
    text = json.loads((target / "config.json").read_text())
    text = text.get("text_config", text)
    heads = {k: text[k] for k in ("num_attention_heads", "num_key_value_heads")}
    return {"head_dim": head_dim, **heads}


def test_the_gpu_tests_head_dims_train_on_the_cpu_too(store, target, tmp_path):
    """The options of the two GPU-only tests below shape a drafter that trains (they skip on CPU, so a change to
    what head_dim means would otherwise surface only on a GPU, as it did on 2026-12-05)."""
    cfg = config(store, tmp_path / "run", max_steps=1, drafter_overrides=head_dim_only(target, 256))
    assert np.isfinite(run_training(cfg)["records"][0]["loss"])
    drafter = json.loads(next((tmp_path / "run" / "checkpoints").glob("step_*/state.json")).read_text())["drafter"]
    assert (drafter["head_dim"], drafter["num_attention_heads"], drafter["num_key_value_heads"]) == (256, 4, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's Triton kernels need a GPU")
@pytest.mark.parametrize("head_dim, recompute", [(64, "none"), (128, "none"), (128, "pointwise")])
def test_the_default_attention_kernels_compile_at_real_head_dims(store, target, tmp_path, head_dim, recompute):
    """On a GPU: the default BlockMask tiles and kernel options for the head dim compile and train (on 2026-12-03
    the H200 refused a mask of 64-tiles at head_dim 64, where torch's kernel tiles are 128 wide); so does the
    selective checkpoint of --recompute pointwise around flex_attention. Head dim 256 trains in bench/train.py's
    rows; this store's are too short for its kernels (the next test)."""
    overrides = head_dim_only(target, head_dim)
    cfg = config(store, tmp_path / "run", max_steps=2, device="cuda", drafter_overrides=overrides, recompute=recompute)
    records = run_training(cfg)["records"]
    assert len(records) == 2 and all(np.isfinite(r["loss"]) for r in records)
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("step_*/state.json")).read_text())
    assert state["drafter"]["head_dim"] == head_dim


@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
    reason="BACKEND=FLASH needs a GPU and flash-attn-4 (the [flash] extra)",
)
@pytest.mark.parametrize("recompute", ["none", "pointwise"])
def test_the_flash_backend_trains_the_same_losses_in_one_graph(store, target, tmp_path, recompute):
    """On a GPU with flash-attn-4: --attention-kernel-option BACKEND=FLASH trains within bf16 rounding of the Triton
    kernels' losses, with no recompile after warmup (a pointwise run on an H100 recompiled once, 2026-12-05, before
    the trainer imported flash-attn-4 up front); at head_dim 128, 2 query heads per K / V head."""
    overrides = head_dim_only(target, 128)
    runs = {}
    for name, options in (("triton", {}), ("flash", {"BACKEND": "FLASH"})):
        cfg = config(
            store,
            tmp_path / name,
            max_steps=3,
            device="cuda",
            drafter_overrides=overrides,
            recompute=recompute,
            attention_kernel_options=options,
        )
        runs[name] = [r["loss"] for r in run_training(cfg)["records"]]
    np.testing.assert_allclose(runs["flash"], runs["triton"], rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's Triton kernels need a GPU")
def test_rows_too_short_for_the_attention_kernels_are_refused_naming_the_fix(store, target, tmp_path):
    """At head_dim 256 torch's flex_attention has no kernel for this store's rows of a few dozen tokens (the H200,
    2026-12-03): the first compile is refused with the shapes and the fix, not inductor's traceback."""
    cfg = config(store, tmp_path / "run", max_steps=2, device="cuda", drafter_overrides=head_dim_only(target, 256))
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
    old = copy_store(store, tmp_path / "v1")
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
