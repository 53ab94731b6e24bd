"""The tensor-parallel harvest on the CPU: processes (gloo) in groups of --tensor-parallel, each group one copy of
the target split by transformers' plan, make the store the unsplit harvest makes: the same documents in the same
rows, the same tokens, features within the bf16 compute tolerance (docs/harvest-parallel.md has the numbers);
refusals before the target loads."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash import store
from dflash.config import HarvestConfig
from dflash.errors import DflashError
from dflash.harvest import run_harvest
from dflash.parallel import check_weights_fit
from dflash.selfcheck import COMPUTE_NOISE
from dflash.store import Store
from dflash.tiny import CORPUS, save_random_target

ROOT = Path(__file__).resolve().parent.parent
# bf16 compute, as on a GPU: the split's all-reduces sum partial products in another order than one matmul does.
OPTIONS = dict(
    token_budget=256, forward_tokens=512, overflow="split", dtype="bfloat16", workers=1, device="cpu", self_check=2
)
TOLERANCE = COMPUTE_NOISE[torch.bfloat16]  # the self-check's, relative per document and layer slice


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("\n".join(CORPUS.read_text().splitlines()[:60]) + "\n")
    return path


def harvest_args(model, data, out, **overrides) -> list[str]:
    args = ["-m", "cli", "harvest", "--model", str(model), "--data", str(data), "--out", str(out)]
    for key, value in {**OPTIONS, **overrides}.items():
        flag = key.replace("_", "-")
        args += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_processes(procs: int, args: list[str]) -> list[subprocess.Popen]:
    """`python ARGS` as the `procs` ranks of one torchrun-like launch on this machine (output captured)."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(procs),
    }
    return [
        subprocess.Popen(
            [sys.executable, *args],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(procs)
    ]


def run_processes(procs: int, args: list[str]) -> list[str]:
    """Run the launch to its end; every process must succeed. Returns their outputs. A launch whose port was taken
    between `_free_port` and rank 0's bind (another program on the machine) is started once more on another port;
    what it wrote is resumed, as after any stop."""
    for attempt in range(2):
        started = start_processes(procs, args)
        outputs = [p.communicate(timeout=600)[0] for p in started]
        if attempt or not any("address already in use" in output.lower() for output in outputs):
            break
    for rank, (process, output) in enumerate(zip(started, outputs)):
        assert process.returncode == 0, f"rank {rank}:\n{output[-4000:]}"
    return outputs


def harvest_in_process(model, data, out, world_size: int = 1) -> Path:
    """The unsplit reference: every part harvested in this process, one after the other."""
    for rank in range(world_size):
        run_harvest(
            HarvestConfig(model=str(model), data=str(data), out=str(out), rank=rank, world_size=world_size, **OPTIONS)
        )
    return out


def feature_differences(path: Path, reference: Path) -> tuple[float, float]:
    """(largest absolute, largest relative per document and layer slice) difference of the stored features; the
    documents table (which document in which row, at which offset) and every token array must be equal."""
    got, expected = Store.open(path), Store.open(reference)
    np.testing.assert_array_equal(got.documents(), expected.documents())
    width = expected.manifest.target.hidden_size
    largest, worst = 0.0, 0.0
    for row in range(expected.num_rows):
        mine, theirs = got.read_row(row), expected.read_row(row)
        for name in store.TOKEN_ARRAYS:
            np.testing.assert_array_equal(mine[name], theirs[name], err_msg=f"{name} of row {row}")
        a, b = (torch.from_numpy(r["hidden"].view(np.int16)).view(torch.bfloat16).float() for r in (mine, theirs))
        largest = max(largest, (a - b).abs().max().item())
        doc_ids = theirs["doc_ids"]
        for doc in set(doc_ids.tolist()) - {-1}:
            at = torch.from_numpy(doc_ids == doc)
            for columns in range(0, b.shape[-1], width):
                x, y = a[at, columns : columns + width], b[at, columns : columns + width]
                worst = max(worst, ((x - y).norm() / y.norm().clamp_min(1e-30)).item())
    return largest, worst


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "qwen3_5"])
def test_a_split_target_harvests_the_unsplit_store(arch, tiny_target, data_file, tmp_path):
    model = tiny_target(arch)
    one = harvest_in_process(model, data_file, tmp_path / "one")
    outputs = run_processes(2, harvest_args(model, data_file, tmp_path / "split", tensor_parallel=2))
    assert "split over 2 processes by transformers' tensor-parallel plan" in outputs[0]
    assert ("experts grouped_mm" in outputs[0]) == (arch == "qwen3_moe")  # the fastest, split too
    assert "rank 1 of group 0 (global ranks 0..1), a follower (it writes nothing)" in outputs[1]
    largest, worst = feature_differences(tmp_path / "split", one)
    print(f"{arch}: split vs unsplit, largest |difference| {largest:.3g}, worst relative {worst:.3g}")
    assert worst <= TOLERANCE
    split = Store.open(tmp_path / "split")
    assert split.manifest.world_size == 1 and split.self_check.passed
    assert "tensor_parallel" not in split.manifest.options  # a launch detail: the store is as an unsplit one


def test_an_expert_parallel_split_harvests_the_unsplit_store(tiny_target, data_file, tmp_path):
    """--expert-parallel: each of the 2 processes holds 2 of the 4 experts whole (transformers' ep plan), the
    attention stays tensor-parallel; the store is the unsplit one within the same tolerance."""
    model = tiny_target("qwen3_moe")
    one = harvest_in_process(model, data_file, tmp_path / "one")
    args = harvest_args(model, data_file, tmp_path / "ep", tensor_parallel=2, expert_parallel=True)
    outputs = run_processes(2, args)
    split = "by transformers' tensor-parallel plan, its experts by the expert-parallel plan (2 of 4 per process)"
    assert all(split in output for output in outputs)
    largest, worst = feature_differences(tmp_path / "ep", one)
    print(f"qwen3_moe: expert-parallel vs unsplit, largest |difference| {largest:.3g}, worst relative {worst:.3g}")
    assert worst <= TOLERANCE
    store_ = Store.open(tmp_path / "ep")
    assert store_.self_check.passed and "expert_parallel" not in store_.manifest.options


def test_two_groups_of_two_harvest_the_two_part_store(tiny_target, data_file, tmp_path):
    """4 processes = 2 groups x 2: the groups share the data as 2 unsplit ranks do; each writes its part."""
    model = tiny_target("llama")
    two = harvest_in_process(model, data_file, tmp_path / "two", world_size=2)
    outputs = run_processes(4, harvest_args(model, data_file, tmp_path / "groups", tensor_parallel=2))
    assert "rank 0 of group 1 (global ranks 2..3), its leader (it writes)" in outputs[2]
    largest, worst = feature_differences(tmp_path / "groups", two)
    print(f"2 groups x 2: largest |difference| {largest:.3g}, worst relative {worst:.3g}")
    assert worst <= TOLERANCE and Store.open(tmp_path / "groups").manifest.world_size == 2


def test_a_compact_store_of_two_groups_has_one_projection(tiny_target, data_file, tmp_path):
    """--subspace with --precision fp8: the groups' leaders calibrate alike and the store keeps one P."""
    model, compact = tiny_target("llama"), dict(subspace="1/8", precision="fp8", calibration_tokens=2048)
    run_processes(4, harvest_args(model, data_file, tmp_path / "groups", tensor_parallel=2, **compact))
    opened = Store.open(tmp_path / "groups")
    assert opened.manifest.features.subspace is not None and opened.self_check.passed
    assert store.read_projection(tmp_path / "groups") is not None


def test_a_killed_follower_leaves_a_store_that_resumes(tiny_target, tmp_path):
    """kill -9 of the follower mid-harvest: the leader fails at its next forward, the committed rows stay, and the
    same launch resumes after them into the store the unsplit harvest makes."""
    data = tmp_path / "long.jsonl"
    data.write_text("\n".join(CORPUS.read_text().splitlines()[:200] * 4) + "\n")
    model, out = tiny_target("llama"), tmp_path / "split"
    args = harvest_args(model, data, out, tensor_parallel=2, dedup=False, self_check=0)
    leader, follower = start_processes(2, args)
    progress = out / "parts" / store.part_name(0) / store.PROGRESS_FILE
    deadline = time.monotonic() + 300
    while not (progress.exists() and json.loads(progress.read_text())["rows_committed"] > 0):
        assert leader.poll() is None and time.monotonic() < deadline, leader.communicate()[0][-3000:]
        time.sleep(0.05)
    follower.kill()
    follower.communicate()
    output = leader.communicate(timeout=120)[0]
    assert leader.returncode == 2 and "a process of tensor-parallel group 0 stopped" in output, output[-3000:]
    committed = json.loads(progress.read_text())
    assert 0 < committed["rows_committed"] < committed["rows"], committed
    resumed = run_processes(2, args)
    assert f"resuming after row {committed['rows_committed']}" in resumed[0]
    one = tmp_path / "one"
    run_harvest(
        HarvestConfig(model=str(model), data=str(data), out=str(one), **{**OPTIONS, "dedup": False, "self_check": 0})
    )
    assert feature_differences(out, one)[1] <= TOLERANCE


def test_a_group_of_one_is_todays_path(tiny_target, data_file, tmp_path, monkeypatch):
    """--tensor-parallel 1 (the default): no process group, no announcing, no distributed load; the harvest's ranks
    as before the option existed (under torchrun too), and regenerate's one process outside torchrun (under it, its
    processes share the prompts as groups of one: test_eval_and_regenerate_without_a_split_share_...)."""
    from transformers import PreTrainedModel

    from dflash import parallel
    from dflash.config import RegenerateConfig
    from dflash.regenerate import regenerate
    from dflash.tiny import PROMPTS

    def refuse(*args, **kwargs):
        raise AssertionError("a process group was set up for --tensor-parallel 1")

    monkeypatch.setattr(parallel, "Group", refuse)
    monkeypatch.setattr(torch.distributed, "init_process_group", refuse)
    monkeypatch.setenv("WORLD_SIZE", "2")  # a torchrun launch of unsplit ranks
    monkeypatch.setenv("RANK", "0")
    loads, from_pretrained = [], PreTrainedModel.from_pretrained.__func__

    def recorded(cls, *args, **kwargs):
        loads.append(kwargs)
        return from_pretrained(cls, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(recorded))
    model = tiny_target("qwen3_moe")
    run_harvest(HarvestConfig(model=str(model), data=str(data_file), out=str(tmp_path / "s"), **OPTIONS))
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    regenerate(RegenerateConfig(model=str(model), data=str(PROMPTS), out=str(tmp_path / "a.jsonl"), max_new_tokens=4))
    assert len(loads) == 2  # the harvest's target (its self-check reuses it) and regenerate's
    assert not any({"distributed_config", "tp_plan", "device_mesh"} & set(kwargs) for kwargs in loads)
    assert not torch.distributed.is_initialized()


# ------------------------------------------------------------------------------------------------- refusals


def test_a_world_that_groups_do_not_divide_is_refused(tiny_target, data_file, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    model = tiny_target("llama")
    config = HarvestConfig(model=str(model), data=str(data_file), out=str(tmp_path / "s"), tensor_parallel=2, **OPTIONS)
    with pytest.raises(DflashError, match=r"--tensor-parallel 2 does not divide the 3 processes"):
        run_harvest(config)
    assert not (tmp_path / "s").exists()


def test_a_split_the_targets_heads_do_not_divide_is_refused_before_loading(
    tiny_target, data_file, tmp_path, monkeypatch
):
    from dflash.config import EvalConfig, RegenerateConfig
    from dflash.evaluate import evaluate
    from dflash.regenerate import regenerate

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr("dflash.parallel.Group", None)  # refused before any process group, so before loading
    model = str(tiny_target("llama"))  # 4 attention heads, 2 KV heads
    message = r"--tensor-parallel 3 does not divide the target's 4 attention heads and 2 KV heads .*divides 2"
    config = HarvestConfig(model=model, data=str(data_file), out=str(tmp_path / "s"), tensor_parallel=3, **OPTIONS)
    with pytest.raises(DflashError, match=message):
        run_harvest(config)
    with pytest.raises(DflashError, match=message):
        evaluate(EvalConfig(model, [{"text": "a"}], untrained=True, device="cpu", tensor_parallel=3))
    with pytest.raises(DflashError, match=message):
        regenerate(RegenerateConfig(model, str(data_file), str(tmp_path / "o.jsonl"), device="cpu", tensor_parallel=3))
    assert not (tmp_path / "s").exists() and not (tmp_path / "o.jsonl").exists()


def test_a_model_without_a_tp_plan_is_refused_naming_its_type(data_file, tmp_path, monkeypatch):
    from transformers import StableLmConfig

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4)
    model = save_random_target(tmp_path / "stablelm", lambda vocab: StableLmConfig(vocab_size=vocab, **shape))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = HarvestConfig(model=str(model), data=str(data_file), out=str(tmp_path / "s"), tensor_parallel=2, **OPTIONS)
    with pytest.raises(DflashError, match=r"no tensor-parallel plan for the model type 'stablelm'"):
        run_harvest(config)


def test_expert_parallel_is_refused_without_a_split_or_an_ep_plan_before_loading(
    tiny_target, data_file, tmp_path, monkeypatch
):
    from dflash.config import EvalConfig, RegenerateConfig

    def harvest(model, **options):
        config = HarvestConfig(model=str(model), data=str(data_file), out=str(tmp_path / "s"), **OPTIONS, **options)
        run_harvest(config)

    monkeypatch.setattr("dflash.parallel.Group", None)  # refused before any process group
    without = r"--expert-parallel splits an MoE target's experts over a tensor-parallel group: give --tensor-parallel"
    with pytest.raises(DflashError, match=without):
        harvest(tiny_target("qwen3_moe"), expert_parallel=True)
    with pytest.raises(DflashError, match=without):
        EvalConfig("m", "p", untrained=True, expert_parallel=True)
    with pytest.raises(DflashError, match=without):
        RegenerateConfig(model="m", data="p", out="o", expert_parallel=True)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        DflashError, match=r"no expert-parallel plan for the model type 'llama'.*drop --expert-parallel"
    ):
        harvest(tiny_target("llama"), tensor_parallel=2, expert_parallel=True)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(DflashError, match=r"the 4 experts .*: pick a --tensor-parallel that divides 4"):
        harvest(tiny_target("qwen3_moe"), tensor_parallel=3, expert_parallel=True)
    assert not (tmp_path / "s").exists()


def test_weights_over_the_groups_gpu_memory_are_refused_naming_the_way_out(tiny_target, monkeypatch):
    from dflash import parallel

    model = tiny_target("llama")
    weights = parallel.checkpoint_bytes(str(model))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(weights * 0.3), 10 * weights))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    with pytest.raises(DflashError, match=r"do not fit in the free memory of 2 GPU\(s\).*--tensor-parallel 4 or more"):
        check_weights_fit(str(model), 2, torch.device("cuda", 0))
    check_weights_fit(str(model), 4, torch.device("cuda", 0))


@pytest.mark.parametrize(
    "free, total, names_others, names_split",
    [(0.0, 10.0, True, False), (0.3, 10.0, True, True), (0.3, 0.31, False, True)],
)
def test_weights_over_the_free_memory_name_what_holds_it(
    tiny_target, monkeypatch, free, total, names_others, names_split
):
    """Free memory taken by other processes (eval workers sharing a GPU, 2026-12-05) is named as such; more GPUs
    are advised only while some memory is free (none free once divided gives no count)."""
    from dflash import parallel

    model, weights = tiny_target("llama"), 2 * 10**9
    monkeypatch.setattr(parallel, "checkpoint_bytes", lambda model: weights)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(weights * free), int(weights * total)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    with pytest.raises(DflashError) as error:
        check_weights_fit(str(model), 1, torch.device("cuda", 0))
    message = str(error.value)
    assert f"free of {weights * total / 1e9:.1f} GB" in message
    assert ("other processes hold" in message and "nvidia-smi" in message) == names_others
    assert ("--tensor-parallel 4 or more" in message) == names_split


def test_memory_this_process_holds_in_its_allocators_cache_counts_as_free(tiny_target, monkeypatch):
    """A second load in one process (an eval after another) finds the GPU full of its own freed, still reserved
    blocks: those serve the load, so they count as free."""
    from dflash import parallel

    model, weights = tiny_target("llama"), 2 * 10**9
    monkeypatch.setattr(parallel, "checkpoint_bytes", lambda model: weights)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (0, 10 * weights))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2 * weights)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 3 * weights)
    check_weights_fit(str(model), 1, torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2 * weights + weights // 2)
    with pytest.raises(DflashError, match="other processes hold") as error:  # 10 - 2.5: its own are not counted
        check_weights_fit(str(model), 1, torch.device("cuda", 0))
    assert f"other processes hold {7.5 * weights / 1e9:.1f} GB" in str(error.value)


# ------------------------------------------------------------------------------------------------------ eval


def eval_args(model, *extra: str) -> list[str]:
    from dflash.tiny import PROMPTS

    args = [*("-m", "cli", "eval", "--model", str(model), "--data", str(PROMPTS), "--untrained")]
    args += [*("--max-new-tokens", "24", "--prompt-lookup", "4", "--device", "cpu", "--dtype", "float32")]
    return [*args, *extra]


def rounds(report: dict) -> list[dict]:
    """Each prompt's runs, their timings left out."""
    return [{name: {**run, "seconds": None} for name, run in p["runs"].items()} for p in report["prompts"]]


def test_eval_split_over_two_processes_gives_the_single_process_rounds(tiny_target, tmp_path):
    """Every process runs the same evaluation on the split target's replicated outputs; the first one reports.
    float32: the split differs by ~1e-6, far below any logit gap the greedy choices could flip on."""
    args = eval_args(tiny_target("llama"), "--num-prompts", "3")
    run_processes(1, [*args, "--json", str(tmp_path / "one.json")])
    outputs = run_processes(2, [*args, "--json", str(tmp_path / "split.json"), "--tensor-parallel", "2"])
    assert "report written to" in outputs[0] and "report written to" not in outputs[1]
    one, split = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "split.json"))
    assert rounds(split) == rounds(one) and any(run["accepted"] for prompt in rounds(one) for run in prompt.values())


def test_eval_of_two_groups_of_two_merges_the_single_process_report(tiny_target, tmp_path):
    """4 processes = 2 groups x 2 over 5 prompts: group 0 evaluates prompts 0, 2, 4, group 1 prompts 1, 3 (uneven
    shares); the first process merges every group's rows into the report one process writes, and nothing else is
    left beside it. Resumed by another layout (2 groups on a 3-prompt report), the same rounds again."""
    args = eval_args(tiny_target("llama"), "--num-prompts", "5")
    run_processes(1, [*args, "--json", str(tmp_path / "one.json")])
    groups = [*args, "--json", str(tmp_path / "groups.json"), "--tensor-parallel", "2"]
    outputs = run_processes(4, groups)
    assert "report written to" in outputs[0] and not any("report written to" in o for o in outputs[1:])
    assert "eval: share 1 of 2, 2 of the 5 prompts, 2 to run" in outputs[2]
    assert "eval: share 0 of 2, 3 of the 5 prompts, 3 to run" in outputs[0]
    one, merged = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "groups.json"))
    assert [p["index"] for p in merged["prompts"]] == list(range(5))
    assert [p["prompt_sha256"] for p in merged["prompts"]] == [p["prompt_sha256"] for p in one["prompts"]]
    assert rounds(merged) == rounds(one) and any(run["accepted"] for prompt in rounds(one) for run in prompt.values())
    for name, method in one["methods"].items():
        got = merged["methods"][name]
        for key in ("tau", "rounds", "new_tokens", "accepted_histogram", "mismatches", "first_mismatch"):
            assert got[key] == method[key], (name, key)
    assert merged["plain_tokens_per_s"] > 0 and set(merged) == set(one)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["groups.json", "one.json"]

    # A 3-prompt report of one process, resumed to 5 prompts by the 2 groups: prompt 3 and 4 are left to run.
    run_processes(1, [*eval_args(tiny_target("llama"), "--num-prompts", "3"), "--json", str(tmp_path / "r.json")])
    resumed = run_processes(4, [*args, "--json", str(tmp_path / "r.json"), "--tensor-parallel", "2", "--resume"])
    assert "eval: share 1 of 2, 2 of the 5 prompts, 1 to run" in resumed[2]
    assert rounds(json.loads((tmp_path / "r.json").read_text())) == rounds(one)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["groups.json", "one.json", "r.json"]


def test_a_world_that_groups_do_not_divide_is_refused_by_eval(tiny_target, monkeypatch):
    from dflash.config import EvalConfig
    from dflash.evaluate import evaluate
    from dflash.tiny import PROMPTS

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")  # a split of 2 the target's heads take
    config = EvalConfig(str(tiny_target("llama")), str(PROMPTS), untrained=True, device="cpu", tensor_parallel=2)
    with pytest.raises(DflashError, match=r"--tensor-parallel 2 does not divide the 3 processes: launch a multiple"):
        evaluate(config)


def test_shares_merge_in_prompt_order_and_a_prompt_in_two_is_refused():
    from dflash.evaluate.shares import merge_reports, share_of

    shares = [{"target": "t", "prompts": [{"index": i} for i in range(n, 5, 2)]} for n in (0, 1)]
    assert [i for i in range(5) if share_of(i, (1, 2))] == [1, 3]
    merged = merge_reports(shares)
    assert merged["target"] == "t" and [row["index"] for row in merged["prompts"]] == [0, 1, 2, 3, 4]
    with pytest.raises(DflashError, match=r"prompt 2 is in two shares of the eval \(reports 0 and 2\)"):
        merge_reports([*shares, {"prompts": [{"index": 2}]}])


def test_a_groups_failure_reaches_the_first_process_after_its_results(monkeypatch):
    """GroupShares on one in-memory store: group 1's leader posts two results, then fails; the first process takes
    both, then raises naming the group and its error."""
    from types import SimpleNamespace

    from dflash.parallel import GroupShares, Layout

    store = torch.distributed.HashStore()
    first, other = (GroupShares(SimpleNamespace(layout=Layout(2, g, 2, 0), store=store), "test") for g in (0, 1))
    assert first.collects and not first.posts and other.posts and not other.collects
    first.tell(["resume", 3])
    assert other.told() == ["resume", 3]
    other.post({"start": 3})
    assert first.store.check(["1/row0"])
    assert first.collect() == [{"start": 3}] and first.collect() == []
    assert not first.store.check(["1/row0"])  # taken results leave the store
    other.post({"start": 7})
    other.end(error="out of memory")
    taken = []
    with pytest.raises(DflashError, match=r"tensor-parallel group 1 stopped \(out of memory\)"):
        first.wait(taken.extend)
    assert taken == [{"start": 7}]


# ------------------------------------------------------------------------------------------------ regenerate


def regenerate_args(model, out: Path, *extra: str) -> list[str]:
    from dflash.tiny import PROMPTS

    args = ["-m", "cli", "regenerate", "--model", str(model), "--data", str(PROMPTS), "--out", str(out)]
    return [*args, "--max-new-tokens", "24", "--batch-size", "2", "--device", "cpu", "--dtype", "float32", *extra]


def test_regenerate_split_over_two_processes_writes_the_single_process_output(tiny_target, tmp_path):
    """float32, greedy: every process generates alike on the split target's replicated logits; the first writes."""
    model = tiny_target("qwen3_moe")
    run_processes(1, regenerate_args(model, tmp_path / "one.jsonl"))
    outputs = run_processes(2, regenerate_args(model, tmp_path / "split.jsonl", "--tensor-parallel", "2"))
    assert "split over 2 processes by transformers' tensor-parallel plan" in outputs[0]
    assert "responses written" in outputs[0] and "responses written" not in outputs[1]
    assert (tmp_path / "split.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
    resumed = run_processes(2, regenerate_args(model, tmp_path / "split.jsonl", "--tensor-parallel", "2"))
    assert "0 responses written" in resumed[0]


def test_an_expert_parallel_regenerate_writes_the_single_process_output(tiny_target, tmp_path):
    """float32, greedy: the experts split by transformers' ep plan, the full model (LM head too) loads and
    generates as one process does."""
    model = tiny_target("qwen3_moe")
    run_processes(1, regenerate_args(model, tmp_path / "one.jsonl"))
    split = ["--tensor-parallel", "2", "--expert-parallel"]
    outputs = run_processes(2, regenerate_args(model, tmp_path / "ep.jsonl", *split))
    assert "its experts by the expert-parallel plan (2 of 4 per process)" in outputs[0]
    assert (tmp_path / "ep.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()


def test_regenerate_of_two_groups_of_two_writes_the_single_process_output(tiny_target, tmp_path):
    """4 processes = 2 groups x 2, 23 prompts in batches of 5: group 0 answers batches 0, 2, 4 (13 prompts), group
    1 batches 1, 3 (10): the first process appends them in prompt order, the single-process output line for line.
    Then an output of the first 10 prompts, resumed by the 2 groups, is completed into the same output."""
    from dflash.tiny import PROMPTS

    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(PROMPTS.read_text().splitlines()[:23]) + "\n")
    model = tiny_target("llama")

    def args(out: str, prompts: Path = data) -> list[str]:
        return [*regenerate_args(model, tmp_path / out, "--batch-size", "5"), "--data", str(prompts)]

    run_processes(1, args("one.jsonl"))
    outputs = run_processes(4, [*args("groups.jsonl"), "--tensor-parallel", "2"])
    assert "23 responses written" in outputs[0] and not any("responses written" in o for o in outputs[1:])
    assert "rank 0 of group 1 (global ranks 2..3), its leader (it writes)" in outputs[2]
    one = (tmp_path / "one.jsonl").read_text().splitlines()
    assert len(one) == 23 and (tmp_path / "groups.jsonl").read_text().splitlines() == one

    first = tmp_path / "first.jsonl"
    first.write_text("\n".join(data.read_text().splitlines()[:10]) + "\n")
    run_processes(1, args("resumed.jsonl", first))
    resumed = run_processes(4, [*args("resumed.jsonl"), "--tensor-parallel", "2"])
    assert "13 responses written, 10 already there" in resumed[0]
    assert (tmp_path / "resumed.jsonl").read_text().splitlines() == one
    leftovers = {p.name for p in tmp_path.iterdir()} - {"prompts.jsonl", "first.jsonl"}
    assert leftovers == {f"{n}.jsonl{s}" for n in ("one", "groups", "resumed") for s in ("", ".settings.json")}


def test_eval_and_regenerate_without_a_split_share_the_prompts_over_two_processes(tiny_target, tmp_path):
    """Under torchrun with --tensor-parallel 1 each process is a group of one: 2 processes share the prompts and the
    first writes what one process writes (the eval's rounds, regenerate's output line for line)."""
    from dflash.tiny import PROMPTS

    model = tiny_target("llama")
    args = eval_args(model, "--num-prompts", "3")
    run_processes(1, [*args, "--json", str(tmp_path / "one.json")])
    outputs = run_processes(2, [*args, "--json", str(tmp_path / "two.json")])
    assert "eval: share 1 of 2, 1 of the 3 prompts, 1 to run" in outputs[1]
    assert "report written to" in outputs[0] and "report written to" not in outputs[1]
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    assert rounds(two) == rounds(one) and [p["index"] for p in two["prompts"]] == [0, 1, 2]

    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(PROMPTS.read_text().splitlines()[:7]) + "\n")
    regen = lambda out: [*regenerate_args(model, tmp_path / out, "--batch-size", "3"), "--data", str(data)]  # noqa: E731
    run_processes(1, regen("one.jsonl"))
    outputs = run_processes(2, regen("two.jsonl"))
    assert "7 responses written" in outputs[0] and "responses written" not in outputs[1]
    assert (tmp_path / "two.jsonl").read_text().splitlines() == (tmp_path / "one.jsonl").read_text().splitlines()


def test_a_split_regenerate_stops_every_process_when_the_first_refuses(tiny_target, tmp_path):
    out = tmp_path / "answers.jsonl"
    model = tiny_target("llama")
    run_processes(1, regenerate_args(model, out, "--max-new-tokens", "4"))
    started = start_processes(2, regenerate_args(model, out, "--tensor-parallel", "2"))
    outputs = [p.communicate(timeout=300)[0] for p in started]
    assert all(p.returncode != 0 for p in started)
    assert "was written with other generation settings" in outputs[0]
    assert "the first process refused" in outputs[1] and "other generation settings" in outputs[1]


def test_regenerate_through_a_server_is_not_split():
    from dflash.config import RegenerateConfig

    with pytest.raises(DflashError, match=r"--tensor-parallel splits a local target"):
        RegenerateConfig(data="p", out="o", server="http://localhost:8000", tensor_parallel=2)


def test_a_tensor_parallel_group_of_one_is_the_unsplit_path(tiny_target, monkeypatch):
    """`--tensor-parallel 1` opens no group: one process, and the ranks of a torchrun harvest, run the unsplit code
    (no process group, no announcements); only eval and regenerate under torchrun make groups of one to share
    their prompts."""
    from dflash.parallel import open_group

    model = str(tiny_target("llama"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert open_group(model, 1, torch.device("cpu")) is None
    assert open_group(model, 1, torch.device("cpu"), shares_work=True) is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert open_group(model, 1, torch.device("cpu")) is None
    assert not torch.distributed.is_initialized()
