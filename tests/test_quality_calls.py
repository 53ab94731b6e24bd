"""bench/quality across calls and processes: a later call keeps the finished stages of the same run and refuses
to delete another run's, workers get a GPU each, and the workers' eval reports merge into the report that one
process evaluating every prompt writes."""

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench.quality

from bench.quality.__main__ import main as quality_main  # noqa: E402
from bench.quality.evaluation import evaluate_share, merge_shares  # noqa: E402
from bench.quality.run import Run, WorkFolderInUse  # noqa: E402
from bench.quality.scale import TINY  # noqa: E402
from bench.quality.workers import in_workers  # noqa: E402
from dflash.config import EvalConfig  # noqa: E402
from dflash.evaluate import evaluate  # noqa: E402
from dflash.evaluate.report import tau_ratio_interval  # noqa: E402

PROMPTS = [
    {"prompt": "def add(a, b):\n    return"},
    {"prompt": "for i in range(10):\n"},
    {"prompt": "import os\nimport sys\n\ndef main():\n"},
    {"prompt": "class Point:\n    def __init__(self, x, y):\n"},
    {"prompt": "with open(path) as f:\n"},
]


def finish_stage(work: Path, name: str, output: str):
    (work / output).mkdir(parents=True)
    (work / "stages" / f"{name}.json").write_text(json.dumps({"timing": {}, "result": {}}))


def test_a_later_call_keeps_the_stages_of_its_run_and_refuses_to_delete_another_run(tmp_path):
    scale, out = TINY, tmp_path / "q.json"
    Run(out, scale, tmp_path, seed=0)
    finish_stage(tmp_path, "target", "target")
    (tmp_path / "responses_0of2.jsonl").write_text("{}\n")  # an unfinished regenerate's output

    longer_eval = dataclasses.replace(scale, eval_seconds=900.0, total_seconds=999.0, eval_workers_per_gpu=4)
    Run(out, longer_eval, tmp_path, seed=0)
    assert (tmp_path / "target").is_dir() and (tmp_path / "stages" / "target.json").exists()
    assert not (tmp_path / "responses_0of2.jsonl").exists()  # unfinished stages start again

    with pytest.raises(WorkFolderInUse, match=r"hidden: the run in --work 64, this call 128.*--restart"):
        Run(out, dataclasses.replace(scale, hidden=128), tmp_path, seed=0)
    with pytest.raises(WorkFolderInUse, match="seed: the run in --work 0, this call 1"):
        Run(out, scale, tmp_path, seed=1)
    assert (tmp_path / "target").is_dir() and (tmp_path / "stages" / "target.json").exists()

    Run(out, scale, tmp_path, seed=1, restart=True)
    assert not (tmp_path / "target").exists() and not (tmp_path / "stages" / "target.json").exists()


def test_a_kept_stage_result_is_saved_before_a_later_stage_crashes(tmp_path):
    """The held-out curves of the mode drafters were lost on 2026-12-05 when the eval after them failed: a kept
    stage's result is in --out as soon as the stage ends, and again when a later call resumes the stage."""
    out = tmp_path / "q.json"
    run = Run(out, TINY, tmp_path, seed=0)
    run.stage("modes", None, lambda: {"sub1/8": {"curve": [1.5, 2.5]}}, keep=True)
    with pytest.raises(RuntimeError, match="eval failed"):
        run.stage("eval", None, lambda: (_ for _ in ()).throw(RuntimeError("eval failed")))
    assert json.loads(out.read_text())["modes"] == {"sub1/8": {"curve": [1.5, 2.5]}}
    run.stage("target", None, lambda: {"loss": 2.0}, keep=True)
    later = Run(out, TINY, tmp_path, seed=0)
    assert later.stage("target", None, lambda: pytest.fail("a finished stage ran again"), keep=True) == {"loss": 2.0}
    assert json.loads(out.read_text())["target"] == {"loss": 2.0}


def test_cli_names_the_other_run_and_exits_2(tmp_path, capsys):
    Run(tmp_path / "q.json", TINY, tmp_path / "work", seed=0)
    finish_stage(tmp_path / "work", "target", "target")
    with pytest.raises(SystemExit) as exit_info:
        quality_main(
            ["--tiny", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "q2.json"), "--set", "layers=4"]
        )
    assert exit_info.value.code == 2
    assert "layers: the run in --work 8, this call 4" in capsys.readouterr().err
    assert (tmp_path / "work" / "target").is_dir() and not (tmp_path / "q2.json").exists()


def record_environment(path: str, fail: bool = False):
    if fail:
        raise ValueError("this worker fails")
    Path(path).write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))


def test_workers_get_one_gpu_each_and_a_failure_is_reported(tmp_path):
    before = dict(os.environ)
    jobs = [{"path": str(tmp_path / f"w{i}")} for i in range(3)]
    in_workers(record_environment, jobs, gpus=2, log=tmp_path / "log")
    assert [(tmp_path / f"w{i}").read_text() for i in range(3)] == ["0", "1", "0"]
    assert dict(os.environ) == before

    in_workers(record_environment, jobs[:1], gpus=0, log=tmp_path / "log")
    assert (tmp_path / "w0").read_text() == "unset"

    with pytest.raises(RuntimeError, match=r"workers \{1: 1\}"):
        in_workers(record_environment, [jobs[0], {**jobs[1], "fail": True}], gpus=0, log=tmp_path / "log")
    assert "this worker fails" in (tmp_path / "log").read_text()


def test_merged_worker_reports_equal_one_process_evaluating_every_prompt(tiny_target, tmp_path):
    target = tiny_target("qwen3_5")
    settings = dict(model=target, device="cpu", seed=0, max_new_tokens=12, min_prompts=1)
    runs = {"eval_main": ("untrained", PROMPTS, 4)}
    for w in range(2):  # the second worker gets prompts 1 and 3; the first stops after 1 of its 3 (budget 0)
        evaluate_share(runs, (w, 2), tmp_path, budget=0.0 if w == 0 else None, **settings)
    partial = merge_shares("eval_main", *runs["eval_main"], 2, tmp_path, settings)
    assert [row["index"] for row in partial.prompts] == [0, 1, 3]

    evaluate_share(runs, (0, 2), tmp_path, budget=None, **settings)  # a later call finishes the share
    merged = merge_shares("eval_main", *runs["eval_main"], 2, tmp_path, settings)
    whole = evaluate(EvalConfig(target, PROMPTS, untrained=True, max_new_tokens=12, device="cpu", prompt_lookup=4))
    assert [row["index"] for row in merged.prompts] == list(range(len(PROMPTS)))
    assert [row["prompt_sha256"] for row in merged.prompts] == [row["prompt_sha256"] for row in whole.prompts]
    for name, method in whole.methods.items():
        got = merged.methods[name]
        assert (got.tau, got.rounds, got.new_tokens, got.mismatches) == (
            method.tau,
            method.rounds,
            method.new_tokens,
            method.mismatches,
        )
        assert got.accepted_histogram == method.accepted_histogram
        assert [r["runs"][name].accepted for r in merged.prompts] == [r["runs"][name].accepted for r in whole.prompts]


def test_tau_ratio_interval_of_two_prompts_spans_the_all_one_and_all_other_draws():
    """With two prompts a draw is {A, A}, {A, B} or {B, B}: the 2.5 and 97.5 percentiles of 5000 draws are the
    ratios of the two one-prompt draws (each 1/4 likely); with identical prompts the interval is the ratio."""
    a, b = ([3, 0, 15], [0, 0, 1, 0]), ([0, 1], [2, 2])  # prompt A: taus 7 and 1.25; prompt B: 1.5 and 3
    low, high = tau_ratio_interval([a, b])
    assert (low, high) == pytest.approx((1.5 / 3, 7 / 1.25))
    assert tau_ratio_interval([a, a, a]) == pytest.approx([7 / 1.25, 7 / 1.25])
