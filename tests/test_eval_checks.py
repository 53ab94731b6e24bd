"""`dflash eval` refuses, in one line naming what differs, a drafter made for another target and a --model folder
that is not a complete target checkpoint, before anything is loaded at random or fails deep inside transformers."""

import errno
import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from dflash.config import EvalConfig
from dflash.drafter import DFlashDrafter, DrafterConfig
from dflash.errors import DflashError
from dflash.evaluate import drafting_graphed, evaluate
from dflash.export import export_drafter
from dflash.target_files import read_config_json

PROMPTS = [{"text": "def add(a, b):"}]


def _drafter_for(target_path, folder, **overrides):
    """A drafter shaped like the target at `target_path`, with `overrides` of its config fields."""
    config = DrafterConfig.from_target_config(read_config_json(str(target_path)), [1, 3, 5], 3, num_layers=1)
    fields = {**config.__dict__, **overrides}
    config = DrafterConfig(**fields)
    torch.manual_seed(0)
    return export_drafter(DFlashDrafter(config), config, folder)


def _eval(target, drafter):
    cfg = EvalConfig(str(target), PROMPTS, max_new_tokens=4, device="cpu", block_size=4, prompt_lookup=0)
    return evaluate(cfg, drafters=[str(drafter)])


def test_a_drafter_of_another_target_is_refused_naming_the_fields(tiny_target, tmp_path):
    target = tiny_target("qwen3")  # 8 layers, width 64
    wide = _drafter_for(target, tmp_path / "wide", hidden_size=32, head_dim=8, vocab_size=7)
    with pytest.raises(DflashError, match="hidden_size: drafter 32, target 64; vocab_size: drafter 7, target"):
        _eval(target, wide)
    deeper = _drafter_for(target, tmp_path / "deeper", num_target_layers=12, target_layer_ids=[1, 5, 9])
    with pytest.raises(
        DflashError, match=r"num_target_layers: drafter 12, target 8; target_layer_ids: drafter \[1, 5, 9\]"
    ):
        _eval(target, deeper)
    vocabulary = read_config_json(str(target))["vocab_size"]
    masked = _drafter_for(target, tmp_path / "mask", mask_token_id=vocabulary + 5)
    with pytest.raises(DflashError, match=f"mask_token_id: drafter {vocabulary + 5}, target vocabulary"):
        _eval(target, masked)
    other_mask = _drafter_for(target, tmp_path / "other-mask", mask_token_id=5)  # the tokenizer's <|MASK|> is 3
    with pytest.raises(DflashError, match=r"mask_token_id: drafter 5, target tokenizer's <\|MASK\|> 3"):
        _eval(target, other_mask)
    assert _eval(target, _drafter_for(target, tmp_path / "fits")).methods["dflash"].mismatches == 0


def test_eval_model_folder_problems_are_one_line_errors(tiny_target, tmp_path):
    source = tiny_target("qwen3")
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps(PROMPTS[0]) + "\n")

    def run(model):
        args = ["eval", "--model", str(model), "--data", str(data), "--prompt-lookup", "2", "--device", "cpu"]
        return CliRunner().invoke(main, args)

    def broken(name, damage):
        folder = shutil.copytree(source, tmp_path / name)
        damage(folder)
        return folder

    weights = "model.safetensors"
    cases = {
        tmp_path / "absent": "does not exist",
        broken("noconfig", lambda f: (f / "config.json").unlink()): "has no config.json",
        broken("nojson", lambda f: (f / "config.json").write_text("{")): "is not readable JSON",
        broken("notype", lambda f: (f / "config.json").write_text("{}")): "names no model_type",
        broken("noweights", lambda f: (f / weights).unlink()): "holds no model.safetensors",
        broken("cut", lambda f: (f / weights).write_bytes((f / weights).read_bytes()[:-100])): "cut short",
        _drafter_for(source, tmp_path / "drafter"): "is a DFlash drafter, not a target",
    }
    for model, message in cases.items():
        result = run(model)
        assert result.exit_code == 2 and message in result.output, (model, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_untrained_on_a_shallow_target_names_evals_own_options(tiny_target):
    target = tiny_target("qwen3", num_layers=3)
    cfg = EvalConfig(str(target), PROMPTS, untrained=True, max_new_tokens=4, device="cpu", block_size=4)
    with pytest.raises(DflashError, match="too few for an untrained drafter") as error:
        evaluate(cfg)
    assert "--layers" not in str(error.value) and "--drafter" in str(error.value)


def test_eval_report_path_and_drafter_path_are_checked_first(tiny_target, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps(PROMPTS[0]) + "\n")
    args = ["eval", "--model", str(tiny_target("qwen3")), "--data", str(data), "--device", "cpu"]
    result = CliRunner().invoke(main, [*args, "--json", str(tmp_path / "missing" / "r.json")])
    assert result.exit_code == 2 and "does not exist; create it first" in result.output, result.output
    result = CliRunner().invoke(main, [*args, "--drafter", str(data)])
    assert result.exit_code == 2 and "is a file, not a folder" in result.output, result.output


def test_eval_target_whose_weights_do_not_fit_its_config_is_one_line(tiny_target, tmp_path):
    folder = shutil.copytree(tiny_target("qwen3"), tmp_path / "t")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 32, "head_dim": 8}))
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps(PROMPTS[0]) + "\n")
    args = ["eval", "--model", str(folder), "--data", str(data), "--device", "cpu", "--prompt-lookup", "2"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.strip().splitlines()[-1].startswith("error: cannot load the target"), result.output


def _eval_args(tiny_target, tmp_path, report):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in [*PROMPTS, {"text": "import os\n"}]))
    args = ["eval", "--model", str(tiny_target("qwen3")), "--untrained", "--block-size", "4", "--data", str(data)]
    return args + ["--max-new-tokens", "4", "--device", "cpu", "--prompt-lookup", "0", "--json", str(report)]


def test_a_second_eval_into_the_same_report_is_refused_while_the_first_runs(tiny_target, tmp_path, monkeypatch):
    import dflash.evaluate

    report = tmp_path / "report.json"
    args = _eval_args(tiny_target, tmp_path, report)
    real_evaluate, seconds = dflash.evaluate.evaluate, []

    def evaluate_while_another_starts(*a, **kw):
        if not seconds:  # the first eval: two more start while it runs (and, unrefused, run plainly)
            seconds.append(None)
            seconds[:] = [CliRunner().invoke(main, args), CliRunner().invoke(main, args + ["--resume"])]
        return real_evaluate(*a, **kw)

    monkeypatch.setattr(dflash.evaluate, "evaluate", evaluate_while_another_starts)
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    for second in seconds:
        assert second.exit_code == 2, second.output
        assert f"the report {report} is being written right now by another eval (process" in second.output
    assert [p["index"] for p in json.loads(report.read_text())["prompts"]] == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl", "report.json"]  # nor the lock left


def test_a_full_disk_under_the_report_is_one_line_and_the_last_report_stays_whole(tiny_target, tmp_path, monkeypatch):
    report = tmp_path / "report.json"
    args = _eval_args(tiny_target, tmp_path, report)
    real_fsync, reports = os.fsync, []

    def fsync(fd):  # the disk fills up while the second report is written
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".dflash-tmp-report.json"):
            reports.append(fd)
            if len(reports) >= 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    message = "error: " + result.output.split("error: ", 1)[1].strip()
    assert "\n" not in message
    assert message.startswith(f"error: writing the report {report} failed: No space left on device")
    assert message.endswith("rerun with --resume: the report holds the prompts finished before this one")
    assert [p["index"] for p in json.loads(report.read_text())["prompts"]] == [0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl", "report.json"]  # no temporary, no lock
    monkeypatch.undo()
    resumed = CliRunner().invoke(main, args + ["--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert [p["index"] for p in json.loads(report.read_text())["prompts"]] == [0, 1]


def test_a_prompt_ending_in_a_tool_turn_is_skipped_with_a_count(tiny_target, caplog):
    tool_call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    called = [
        {"role": "user", "content": "Call a tool."},
        {"role": "assistant", "content": "", "tool_calls": [tool_call]},
        {"role": "tool", "content": "42"},
    ]
    prompts = [{"text": "def add(a, b):"}, {"messages": called}, {"text": "The fox"}]
    cfg = EvalConfig(str(tiny_target("qwen3")), prompts, num_prompts=2, max_new_tokens=2, device="cpu", prompt_lookup=2)
    with caplog.at_level("WARNING", logger="dflash"):
        report = evaluate(cfg)
    assert len(report.prompts) == 2
    assert "skipping 1 prompt(s) that do not end with a user turn for the target to answer (prompt 2)" in caplog.text


def test_an_eval_past_the_targets_positions_is_refused_before_decoding(tiny_target):
    cfg = EvalConfig(str(tiny_target("qwen3")), PROMPTS, max_new_tokens=5000, device="cpu", prompt_lookup=2)
    with pytest.raises(DflashError, match="past the target's max_position_embeddings 4096; pass --max-new-tokens"):
        evaluate(cfg)


def test_per_prompt_headers_never_run_together(tiny_target):
    cfg = EvalConfig(str(tiny_target("qwen3")), PROMPTS, max_new_tokens=2, device="cpu", prompt_lookup=2)
    header, row = evaluate(cfg).prompt_table().splitlines()
    assert "prompt-lookup tau, speedup  prompt-lookup-generate tau, speedup" in header
    assert len(header) == len(row)


@pytest.mark.parametrize("cut", ["2", "-0.5"])
def test_a_confidence_cut_outside_0_to_1_is_refused_before_anything_loads(tmp_path, cut):
    result = CliRunner().invoke(
        main, ["eval", "--model", str(tmp_path / "m"), "--data", "p.jsonl", "--confidence-cut", cut]
    )
    assert result.exit_code == 2, result.output
    assert f"--confidence-cut {float(cut)} is not a chance between 0 and 1" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_drafting_cuda_graph_without_the_compile_is_refused_before_anything_loads(tmp_path):
    args = ["eval", "--model", str(tmp_path / "m"), "--data", "p.jsonl", "--drafting-cuda-graph"]
    result = CliRunner().invoke(main, [*args, "--no-compile-drafter"])
    assert result.exit_code == 2, result.output
    assert "--drafting-cuda-graph replays the compiled drafting: drop --no-compile-drafter" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert "--drafting-cuda-graph" not in CliRunner().invoke(main, args).output  # on by itself: the model is missing


def test_the_drafting_is_graphed_by_default_when_compiled_on_cuda_and_only_then():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    default = EvalConfig("m", PROMPTS)
    assert drafting_graphed(default, cuda, compiled=True)
    assert not drafting_graphed(default, cpu, compiled=True) and not drafting_graphed(default, cuda, compiled=False)
    assert not drafting_graphed(EvalConfig("m", PROMPTS, drafting_cuda_graph=False), cuda, compiled=True)
