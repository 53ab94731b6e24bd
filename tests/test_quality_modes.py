"""bench/quality --modes (issue 16): the mode names, the bootstrap intervals of a tau and of the paired difference
of two taus (worked by hand on two prompts), the table's numbers and verdicts, the resumption of finished modes,
and several trained drafters evaluated in one run against one plain greedy decoding per prompt."""

import json
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench.quality

from bench.quality.evaluation import evaluate_share, merge_shares  # noqa: E402
from bench.quality.modes import data_wait_share  # noqa: E402
from bench.quality.report import bar, methods_markdown, mode_rows, mode_verdict, modes_markdown  # noqa: E402
from bench.quality.run import Run  # noqa: E402
from bench.quality.scale import TINY  # noqa: E402
from bench.quality.store_modes import BF16, MODES, StoreMode, mode_done, mode_harvested, parse_modes  # noqa: E402
from bench.variants import split_variant  # noqa: E402
from dflash.evaluate.report import compare_drafters, tau_difference_interval, tau_interval, tau_ratio_interval  # noqa: E402

# Two prompts, the drafts accepted per round by a mode's drafter and by the bf16 drafter (as in test_quality_calls):
# prompt A: taus 1 + 18/3 = 7 and 1 + 1/4 = 1.25; prompt B: 1 + 1/2 = 1.5 and 1 + 4/2 = 3.
A, B = ([3, 0, 15], [0, 0, 1, 0]), ([0, 1], [2, 2])


def test_mode_names():
    modes = parse_modes("fp8, sub1/2,sub1/4,sub1/8,sub1/4+fp8,sub96,,")
    assert [(m.name, m.precision, m.subspace) for m in modes] == [
        ("fp8", "fp8", "none"),
        ("sub1/2", "bf16", "1/2"),
        ("sub1/4", "bf16", "1/4"),
        ("sub1/8", "bf16", "1/8"),
        ("sub1/4+fp8", "fp8", "1/4"),
        ("sub96", "bf16", "96"),
    ]
    assert [m.folder for m in modes[3:5]] == ["sub1_8", "sub1_4+fp8"]
    assert modes[0].method == "dflash[fp8]" and BF16.method == "dflash"  # bf16's keeps the name the bar reads
    assert parse_modes("") == []
    for bad in ("bf16", "fp16", "sub", "sub0", "sub3/2", "sub1/0", "fp8+fp8", "sub1/4+bf16", "sub1/4 fp8"):
        with pytest.raises(ValueError, match="is not a store mode"):
            parse_modes(bad)
    with pytest.raises(ValueError, match="twice"):
        parse_modes("fp8,sub1/4,fp8")


def test_tau_intervals_of_two_prompts_are_the_one_prompt_draws():
    """A draw is {A, A}, {A, B} or {B, B}; the 2.5 and 97.5 percentiles of 5000 draws are the two one-prompt draws
    (each 1/4 likely). The difference is taken on each draw: {A, A} gives 7 - 1.25, {B, B} 1.5 - 3."""
    assert tau_interval([(A[0],), (B[0],)]) == pytest.approx([1.5, 7])
    assert tau_interval([A, B]) == pytest.approx([1.5, 7])  # the first method's tau by default
    assert tau_difference_interval([A, B]) == pytest.approx([1.5 - 3, 7 - 1.25])
    assert tau_ratio_interval([A, B]) == pytest.approx([1.5 / 3, 7 / 1.25])  # as before the helper


def test_the_difference_is_paired_on_the_same_prompts():
    """One more draft accepted in every round than bf16: tau is bf16's + 1 on every draw, so the difference's
    interval is exactly [1, 1], however far each tau alone moves from prompt to prompt."""
    plus_one = [([a + 1 for a in A[1]], A[1]), ([a + 1 for a in B[1]], B[1])]
    assert tau_difference_interval(plus_one) == pytest.approx([1, 1])
    assert tau_interval([(A[1],), (B[1],)]) == pytest.approx([1.25, 3])
    assert tau_difference_interval([(A[1], A[1]), (B[1], B[1])]) == pytest.approx([0, 0])


def test_data_wait_share_weights_each_record_by_its_time():
    records = [
        {"kind": "train", "step": 10, "step_ms": 100.0, "data_wait": 0.5},
        {"kind": "val", "step": 10, "loss": 1.0},
        {"kind": "train", "step": 20, "step_ms": 300.0, "data_wait": 0.1},
    ]
    assert data_wait_share(records) == pytest.approx((0.5 * 1000 + 0.1 * 3000) / 4000)
    assert data_wait_share([]) is None


def fake_mode(mode: StoreMode, ratio: float, captured=None) -> dict:
    store = {
        "bytes_per_token": 1280 * ratio,
        "raw_bf16_ratio": ratio,
        "feature_ratio": ratio * 0.9,
        "captured": captured,
    }
    records = [{"kind": "train", "step": 10, "step_ms": 20.0, "data_wait": 0.25}]
    drafter = {"train_loss": 1.0, "val_loss": 1.5, "val_tau": 2.0, "step_ms": 20.0, "records": records}
    return {"mode": asdict(mode), "store": store, "drafter": drafter}


def test_the_mode_table_of_two_prompts():
    fp8, sub = StoreMode("fp8", "fp8"), StoreMode("sub1/4+fp8", "fp8", "1/4")
    runs = [
        {BF16.method: A[1], fp8.method: A[0], sub.method: A[1], "prompt-lookup": [0]},
        {BF16.method: B[1], fp8.method: B[0], sub.method: B[1], "prompt-lookup": [0]},
    ]
    methods = {  # taus over both prompts' rounds: bf16 1 + 5/6, fp8 1 + 19/5
        BF16.method: SimpleNamespace(tau=1 + 5 / 6, mismatches=0),
        fp8.method: SimpleNamespace(tau=1 + 19 / 5, mismatches=0),
        sub.method: SimpleNamespace(tau=1 + 5 / 6, mismatches=1),
        "prompt-lookup": SimpleNamespace(tau=1.0, mismatches=0),
    }
    prompts = [{"runs": {k: SimpleNamespace(accepted=v) for k, v in r.items()}} for r in runs]
    # evaluate's comparison of each mode's drafter with the bf16 one, which the table reads
    comparisons = compare_drafters(methods, prompts, [BF16.method, fp8.method, sub.method])
    report = SimpleNamespace(methods=methods, prompts=prompts, comparisons=comparisons)
    modes = {"bf16": fake_mode(BF16, 0.8), "fp8": fake_mode(fp8, 0.4), sub.name: fake_mode(sub, 0.11, 0.96)}
    rows = mode_rows(report, True, modes)
    assert [r["mode"] for r in rows] == ["bf16", "fp8", "sub1/4+fp8"]
    assert rows[0]["tau_95"] == pytest.approx([1.25, 3]) and "difference" not in rows[0]
    assert rows[1]["difference"] == pytest.approx(4.8 - 11 / 6)
    assert rows[1]["difference_95"] == pytest.approx([-1.5, 5.75])
    assert rows[1]["relative"] == pytest.approx((4.8 - 11 / 6) / (11 / 6))
    assert rows[1]["within_2pct"] and not rows[1]["within_2pct_95"] and not rows[1]["size_goal"]
    assert mode_verdict(rows[1]) == f"met (its 95 % interval reaches {100 * -1.5 / (11 / 6):+.1f} %)"
    assert rows[2]["difference_95"] == pytest.approx([0, 0]) and rows[2]["within_2pct_95"] and rows[2]["size_goal"]
    assert mode_verdict(rows[2]) == "FAIL (mismatches)"
    assert rows[0]["data_wait"] == pytest.approx(0.25)
    assert mode_verdict(mode_rows(report, False, modes)[1]).endswith("so far (PARTIAL)")

    table = modes_markdown(rows, report, True, steps=300)
    assert (
        "| fp8 | 512.0 | 0.400 | 0.360 | - | 4.800 (1.50 to 7.00) | +2.967 (-1.500 to +5.750) | +161.8 % | 0 |" in table
    )
    assert "| sub1/4+fp8 | 140.8 | 0.110 | 0.099 | 96.0 % |" in table and "| bf16 | 1024.0 | 0.800 |" in table
    assert "sub1/4+fp8 0.110 (met)" in table
    # the issue-4 bar reads bf16's drafter only: a mode's mismatch is the modes table's
    assert bar(report, True)["pass_0_mismatches"]

    # A sampled eval beside it: the methods table adds each drafter's first draft (acceptance / cap / shape, where
    # the eval recorded them), the same taus here
    diagnosed = {"acceptance_by_position": [0.28, 0.2], "support_by_position": [0.59, 0.4], "shape_by_position": [0.38]}
    sampled_methods = {**methods, fp8.method: SimpleNamespace(**vars(methods[fp8.method]), **diagnosed)}
    sampled = SimpleNamespace(methods=sampled_methods, prompts=prompts, comparisons=comparisons)
    rows = mode_rows(report, True, modes, sampled)
    assert rows[1]["first_draft"] == [0.28, 0.59, 0.38] and rows[0]["first_draft"] is None
    table = methods_markdown(rows, True, steps=300, temperature=1.0)
    assert "T=1, first draft: accepted / cap / shape |" in table
    assert "| +161.8 % (-81.8 to +313.6 %) | 0.28 / 0.59 / 0.38 |" in table and "| reference | - |" in table


def test_a_later_call_keeps_the_finished_modes_only(tmp_path):
    out = tmp_path / "q.json"
    Run(out, TINY, tmp_path, seed=0)
    for folder in ("fp8", "sub1_4", "sub1_4+fp8"):
        (tmp_path / MODES / folder / "shards").mkdir(parents=True)
    for folder in ("fp8", "sub1_4"):
        mode_harvested(tmp_path / "stages", folder).write_text(json.dumps({}))
    mode_done(tmp_path / "stages", "fp8").write_text(json.dumps({}))
    Run(out, TINY, tmp_path, seed=0)
    assert (tmp_path / MODES / "fp8" / "shards").is_dir()
    assert (tmp_path / MODES / "sub1_4" / "shards").is_dir()  # harvested: only its drafter is trained again
    assert not (tmp_path / MODES / "sub1_4+fp8").exists()  # unfinished: harvested and trained again


def test_several_trained_drafters_in_one_run(tiny_target, tmp_path):
    """{name: folder} drafters: one evaluate run reports each under its name, each as evaluated alone."""
    import dflash.evaluate as evaluation
    from dflash.config import EvalConfig
    from dflash.evaluate.drafters import untrained_drafter
    from dflash.export import export_drafter
    from dflash.target import load_target

    target_path = tiny_target("qwen3_5")
    target, tokenizer = load_target(target_path, "cpu", "float32")
    folders = [
        str(export_drafter(*untrained_drafter(target, tokenizer, 4, seed=s), tmp_path / f"d{s}")) for s in (1, 2)
    ]
    prompts = [{"prompt": "def add(a, b):\n    return"}, {"prompt": "for i in range(10):\n"}]
    settings = dict(model=target_path, device="cpu", seed=0, max_new_tokens=8, min_prompts=1)
    drafters = {"dflash": folders[0], "dflash[fp8]": folders[1]}
    evaluate_share({"eval_m": (drafters, prompts, 4)}, (0, 1), tmp_path, budget=None, **settings)
    merged = merge_shares("eval_m", drafters, prompts, 4, 1, tmp_path, settings)
    assert set(merged.methods) == {"dflash", "dflash[fp8]", "prompt-lookup"}
    assert list(merged.comparisons) == ["dflash[fp8]"] and merged.comparisons["dflash[fp8]"]["reference"] == "dflash"
    alone = evaluation.evaluate(
        EvalConfig(target_path, prompts, drafter=folders[1], max_new_tokens=8, device="cpu", prompt_lookup=0)
    )
    assert [r["runs"]["dflash[fp8]"].accepted for r in merged.prompts] == [
        r["runs"]["dflash"].accepted for r in alone.prompts
    ]
    assert merged.methods["dflash[fp8]"].tau == alone.methods["dflash"].tau
    assert merged.methods["dflash[fp8]"].mismatches == 0


def test_window_variants_train_with_their_window_and_survive_the_saved_json():
    # The window's tau cost next to full context (issue 24): a variant's drafter options go to the TrainConfig and
    # back from the mode's saved JSON unchanged.
    modes = parse_modes("dflash-window512,dflash-window2048,dflash2-full,dflash2-window96")
    windows = [dict(m.train)["drafter_overrides"]["sliding_window"] for m in modes]
    assert windows == [512, 2048, None, 96] and all(m.on_bf16_store for m in modes)
    assert [dict(m.train)["method"] for m in modes] == ["dflash", "dflash", "dflash2", "dflash2"]
    assert [StoreMode(**json.loads(json.dumps(asdict(m)))) for m in modes] == modes
    assert len({m: m.folder for m in modes}) == 4  # run_modes keys its work by mode (dict values in `train`)
    head_dim = parse_modes("dflash-hd32")[0]
    assert dict(head_dim.train) == {"method": "dflash", "drafter_overrides": {"head_dim": 32}}
    # a suffix on any named variant: its own options kept, the drafter option added to its overrides
    options, teacher = split_variant("dflash-pointwise-hd128")
    assert options == {"method": "dflash", "recompute": "pointwise", "drafter_overrides": {"head_dim": 128}}
    assert teacher is None
    assert split_variant("dspark-topk-window64") == (
        {"method": "dspark", "drafter_overrides": {"sliding_window": 64}},
        "topk:32",
    )
    assert split_variant("dflash2-full-hd64")[0]["drafter_overrides"] == {"sliding_window": None, "head_dim": 64}
    bad_names = ("dflash-window0", "dflash-window", "dflash3-window64", "dflash-window64x", "dflash-hd0", "-hd64")
    for bad in (*bad_names, "dflash-pointwise-hd128-window64"):
        with pytest.raises(ValueError, match="-windowN"):
            parse_modes(bad)
