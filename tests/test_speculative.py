"""Speculative decoding: exact greedy equivalence (dense and hybrid targets), tau and the acceptance rules, and
the eval built on it."""

import dataclasses
import json
import logging

import pytest
import torch
from click.testing import CliRunner
from devices import CPU_AND_CUDA

from dflash.config import EvalConfig
from dflash.drafter import DFlashDrafter, DrafterConfig
from dflash.drafter.proposers import DFlashProposer, Draft, PromptLookupProposer
from dflash.errors import DflashError
from dflash.evaluate import SpeculativeMethod, evaluate
from dflash.evaluate.decoding import (
    accept_greedy,
    accept_sampled,
    generate_prompt_lookup,
    plain_greedy,
    speculative_generate,
    target_probs,
)
from dflash.regenerate import encode_prompt, eos_token_ids
from dflash.target import load_target

PROMPTS = [
    {
        "messages": [
            {"role": "user", "content": "Explain what `logging.NullHandler` in the Python standard library does."}
        ]
    },
    {"prompt": "def parse(line):\n    return"},
]
BLOCK = 8


def as_json(report) -> dict:
    """The report as the CLI writes it and a resume reads it."""
    return json.loads(json.dumps(dataclasses.asdict(report)))


@pytest.fixture(scope="module")
def loaded(tiny_target):
    """arch -> (target, eos ids, encoded prompts)."""
    cache = {}

    def load(arch):
        if arch not in cache:
            target, tokenizer = load_target(tiny_target(arch))
            prompts = [torch.tensor(encode_prompt(tokenizer, record)) for record in PROMPTS]
            cache[arch] = (target, eos_token_ids(target, tokenizer), prompts, tokenizer)
        return cache[arch]

    return load


class OracleProposer:
    """Drafts the target's own greedy continuation for the first `right[r]` tokens of round r, then wrong ones."""

    layer_ids: list[int] = []

    def __init__(self, reference: torch.Tensor, right: list[int], vocab_size: int):
        self.reference, self.right, self.vocab_size = reference, list(right), vocab_size
        self.rounds = 0

    def propose(self, committed, features, num_tokens, temperature, generator):
        n = committed.numel()
        assert torch.equal(committed, self.reference[:n]), "the loop committed a token greedy decoding would not"
        right = self.right[min(self.rounds, len(self.right) - 1)]
        self.rounds += 1
        draft = self.reference[n : n + num_tokens].clone()
        draft[right:] = (draft[right:] + 1) % self.vocab_size  # differs from the target's argmax there
        return Draft(draft)


def random_drafter(target, tokenizer):
    config = DrafterConfig.from_target_config(
        target.config, [1, 3, 5], tokenizer.convert_tokens_to_ids("<|MASK|>"), num_layers=1, block_size=BLOCK
    )
    torch.manual_seed(0)
    return DFlashDrafter(config).eval(), config


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_greedy_speculative_equals_plain_greedy(loaded, arch):
    target, eos_ids, prompts, tokenizer = loaded(arch)
    drafter, config = random_drafter(target, tokenizer)
    proposer = DFlashProposer(drafter, config, target)
    for prompt in prompts:
        plain = plain_greedy(target, prompt, 40, eos_ids)
        speculative = speculative_generate(target, proposer, prompt, 40, eos_ids, max_drafts=BLOCK - 1)
        assert speculative.tokens == plain.tokens
        # A random drafter is rejected in (nearly) every round: many rollbacks happened.
        assert len(speculative.accepted) >= len(plain.tokens) // 2


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_greedy_and_sampled_dflash2_decoding_on_real_targets(loaded, arch):
    """A DFlash 2 drafter (selector away from its identity start, a window shorter than the prompts) through the
    real decoding loop: at temperature 0 it reproduces plain greedy decoding, sampled it runs to the end."""
    from dflash.methods.dflash2 import DFlash2Config, DFlash2Drafter, DFlash2Proposer

    target, eos_ids, prompts, tokenizer = loaded(arch)
    config = DFlash2Config.from_target_config(
        target.config,
        [1, 3, 5],
        tokenizer.convert_tokens_to_ids("<|MASK|>"),
        num_layers=1,
        block_size=BLOCK,
        selector_rank=8,
        selector_top_k=4,
        sliding_window=BLOCK,  # the smallest a block of BLOCK takes
    )
    torch.manual_seed(0)
    drafter = DFlash2Drafter(config).eval()
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.normal_()
    proposer = DFlash2Proposer(drafter, config, target)
    for prompt in prompts:
        plain = plain_greedy(target, prompt, 30, eos_ids)
        assert speculative_generate(target, proposer, prompt, 30, eos_ids, max_drafts=BLOCK - 1).tokens == plain.tokens
    generator = torch.Generator().manual_seed(1)
    out = speculative_generate(target, proposer, prompts[0], 20, eos_ids, 1.0, generator, BLOCK - 1)
    assert sum(a + 1 for a in out.accepted) == len(out.tokens) - 1


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_plain_greedy_equals_transformers_generate(loaded, arch):
    target, eos_ids, prompts, _ = loaded(arch)
    plain = plain_greedy(target, prompts[0], 30, eos_ids)
    reference = target.generate(prompts[0][None], max_new_tokens=30, do_sample=False)[0, prompts[0].numel() :]
    assert plain.tokens == reference.tolist()[: len(plain.tokens)]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_oracle_right_for_k_then_wrong(loaded, arch):
    """Right for k = 3 tokens then wrong, blocks of 8: every round accepts exactly 3 mid-block, tau = 4."""
    target, eos_ids, prompts, _ = loaded(arch)
    rounds, k = 5, 3
    max_new = 1 + rounds * (k + 1)
    plain = plain_greedy(target, prompts[0], max_new, eos_ids)
    assert len(plain.tokens) == max_new, "fixture prompt must not hit EOS early"
    proposer = OracleProposer(torch.cat([prompts[0], torch.tensor(plain.tokens)]), [k], target.config.vocab_size)
    method = SpeculativeMethod(proposer, max_drafts=BLOCK - 1, temperature=0.0)
    run = method.run(target, prompts[0], max_new, plain, eos_ids, None)
    assert run.mismatch_at is None
    assert run.accepted == [k] * rounds
    assert run.tau == k + 1 == SpeculativeMethod.overall_tau([run])
    assert run.rounds == rounds and run.new_tokens == max_new


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_oracle_mixed_rejections_and_full_acceptance(loaded, arch):
    """Rejections at varying depths, full blocks right after rollbacks (pending tokens re-fed), budget cut."""
    target, eos_ids, prompts, _ = loaded(arch)
    right = [0, 2, 7, 5, 7, 1, 6, 7]
    max_new = 40
    plain = plain_greedy(target, prompts[0], max_new, eos_ids)
    assert len(plain.tokens) == max_new
    proposer = OracleProposer(torch.cat([prompts[0], torch.tensor(plain.tokens)]), right, target.config.vocab_size)
    out = speculative_generate(target, proposer, prompts[0], max_new, eos_ids, max_drafts=BLOCK - 1)
    assert out.tokens == plain.tokens
    expected, produced = [], 1
    for k in right:  # drafts are capped so that the bonus token fits the budget
        if produced >= max_new:
            break
        expected.append(min(k, BLOCK - 1, max_new - produced - 1))
        produced += expected[-1] + 1
    assert out.accepted == expected


class FeatureCheckingOracle(OracleProposer):
    """Also checks, every round, that the features it is given are the target's own for all committed tokens
    but the last, as a fresh cache-free forward computes them."""

    layer_ids = [1, 3, 5]

    def __init__(self, target, *args):
        super().__init__(*args)
        self.target = target

    def propose(self, committed, features, num_tokens, temperature, generator):
        hidden = self.target(committed[None, :-1], output_hidden_states=True).hidden_states
        expected = torch.cat([hidden[k + 1][0] for k in self.layer_ids], dim=-1)
        assert features.shape == expected.shape
        torch.testing.assert_close(features, expected, atol=1e-4, rtol=1e-4)
        return super().propose(committed, features, num_tokens, temperature, generator)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_drafter_sees_the_target_features_of_all_committed_context(loaded, arch):
    target, eos_ids, prompts, _ = loaded(arch)
    plain = plain_greedy(target, prompts[1], 24, eos_ids)
    reference = torch.cat([prompts[1], torch.tensor(plain.tokens)])
    proposer = FeatureCheckingOracle(target, reference, [0, 3, 7, 2], target.config.vocab_size)
    out = speculative_generate(target, proposer, prompts[1], 24, eos_ids, max_drafts=BLOCK - 1)
    assert out.tokens == plain.tokens and proposer.rounds == len(out.accepted)


def test_dflash_proposer_block_and_positions(loaded):
    """Block [last committed, MASK x (B-1)] at the next absolute positions; context = positions 0..n-2."""
    target, _, _, tokenizer = loaded("qwen3")
    _, config = random_drafter(target, tokenizer)
    seen = {}

    def fake_drafter(block_embeds, features, q_positions, ctx_positions, mask):
        seen.update(embeds=block_embeds, features=features, q=q_positions, ctx=ctx_positions, mask=mask)
        return torch.zeros(*block_embeds.shape)

    committed = torch.tensor([11, 12, 13, 14, 15])
    features = torch.randn(4, 3 * target.config.hidden_size)
    draft = DFlashProposer(fake_drafter, config, target).propose(committed, features, 5, 0.0, None)
    block = torch.tensor([15] + [config.mask_token_id] * (BLOCK - 1))
    torch.testing.assert_close(seen["embeds"][0], target.get_input_embeddings()(block))
    assert torch.equal(seen["features"][0], features)
    assert seen["q"].tolist() == [list(range(4, 4 + BLOCK))] and seen["ctx"].tolist() == [[0, 1, 2, 3]]
    assert draft.tokens.numel() == 5 and draft.probs is None and seen["mask"] is None  # no window: all visible


def test_accept_greedy_hand_built():
    vocab, target_choice = 10, torch.tensor([4, 1, 7, 7, 2])
    logits = torch.nn.functional.one_hot(target_choice, vocab).float()
    assert accept_greedy(Draft(torch.tensor([4, 1, 3, 7])), logits) == (2, 7)  # right for 2, then wrong
    assert accept_greedy(Draft(torch.tensor([4, 1, 7, 7])), logits) == (4, 2)  # all right: bonus after the block
    assert accept_greedy(Draft(torch.tensor([5, 1, 7, 7])), logits) == (0, 4)
    assert accept_greedy(Draft(torch.tensor([], dtype=torch.long)), logits[:1]) == (0, 4)


@pytest.mark.parametrize("point_mass", [False, True])
def test_speculative_sampling_emits_the_target_distribution(point_mass):
    """The first committed token follows the target's p whatever the drafter's q (Leviathan et al.)."""
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    counts = torch.zeros(4)
    trials = 6000
    for _ in range(trials):
        if point_mass:
            draft = Draft(torch.tensor([2]))
        else:
            draft = Draft(torch.multinomial(q, 1, generator=generator)[:, 0], q)
        accepted, bonus = accept_sampled(draft, target_probs(p.log(), 1.0), generator)
        counts[int(draft.tokens[0]) if accepted else bonus] += 1
    assert torch.allclose(counts / trials, p[0], atol=0.02)


def test_sampling_runs_on_hybrid_target(loaded):
    target, eos_ids, prompts, tokenizer = loaded("qwen3_5")
    drafter, config = random_drafter(target, tokenizer)
    generator = torch.Generator().manual_seed(1)
    out = speculative_generate(
        target, DFlashProposer(drafter, config, target), prompts[0], 24, eos_ids, 1.0, generator, BLOCK - 1
    )
    assert 1 <= len(out.tokens) <= 24
    assert all(0 <= t < target.config.vocab_size for t in out.tokens)
    assert sum(a + 1 for a in out.accepted) == len(out.tokens) - 1


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_prompt_lookup_is_exact(loaded, arch):
    target, eos_ids, prompts, _ = loaded(arch)
    for prompt in prompts:
        plain = plain_greedy(target, prompt, 40, eos_ids)
        lookup = speculative_generate(
            target, PromptLookupProposer(5, eos_ids=eos_ids), prompt, 40, eos_ids, max_drafts=5
        )
        assert lookup.tokens == plain.tokens
    if arch == "qwen3":  # transformers refuses assisted generation on stateful (hybrid) models
        generation, forwards = generate_prompt_lookup(target, prompts[1], 40, 5)
        assert generation.tokens == plain.tokens
        assert 1 <= forwards <= len(generation.tokens)


def test_evaluate_report_and_cli(tiny_target, tmp_path, caplog):
    target_path = tiny_target("qwen3_5")
    cfg = EvalConfig(
        target_path, PROMPTS, untrained=True, max_new_tokens=12, device="cpu", block_size=BLOCK, prompt_lookup=4
    )
    report = evaluate(cfg)
    assert set(report.methods) == {"untrained-dflash", "prompt-lookup"}
    for method in report.methods.values():
        assert method.mismatches == 0 and method.tau >= 1
        assert sum(method.accepted_histogram) == method.rounds
    assert len(report.prompts) == 2 and "untrained-dflash" in report.table()
    assert as_json(report)["methods"]["prompt-lookup"]["rounds"] == report.methods["prompt-lookup"].rounds

    from cli.main import main

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "report.json"
    args = ["eval", "--model", str(target_path), "--untrained", "--block-size", "4", "--data", str(data)]
    args += ["--num-prompts", "1", "--max-new-tokens", "6", "--device", "cpu", "--json", str(out)]
    with caplog.at_level(logging.INFO, logger="dflash"):
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert (
        "untrained-dflash" in result.output
        and json.loads(out.read_text())["methods"]["untrained-dflash"]["mismatches"] == 0
    )
    assert "kernels: attention sdpa, gated_delta_rule torch-reference" in caplog.text
    rows = [line.split() for line in result.output.splitlines() if line.split()[:1] == ["0"]]
    assert len(rows) == 1 and rows[0][1] == str(json.loads(out.read_text())["prompts"][0]["plain"]["new_tokens"])
    bad = CliRunner().invoke(main, ["eval", "--model", str(target_path), "--data", str(data), "--prompt-lookup", "0"])
    assert bad.exit_code == 2 and "nothing to evaluate" in bad.output
    bad = CliRunner().invoke(main, args + ["--block-size", "1"])
    assert bad.exit_code == 2 and "--block-size must be at least 2, got 1" in bad.output
    bad = CliRunner().invoke(main, args + ["--drafter", str(tmp_path)])
    assert bad.exit_code == 2 and "either --drafter or --untrained" in bad.output


def test_evaluate_several_drafters_against_one_plain_run_within_a_time_budget(tiny_target, tmp_path):
    from dflash.evaluate.drafters import untrained_drafter
    from dflash.export import export_drafter

    target_path = tiny_target("qwen3_5")
    target, tokenizer = load_target(target_path, "cpu", "float32")
    model, config = untrained_drafter(target, tokenizer, BLOCK, seed=1)
    folder = export_drafter(model, config, tmp_path / "drafter")
    partials = []
    cfg = EvalConfig(
        target_path,
        PROMPTS * 3,
        max_new_tokens=8,
        device="cpu",
        block_size=BLOCK,
        prompt_lookup=0,
        time_budget=0.0,
        min_prompts=2,
    )
    report = evaluate(cfg, drafters=[str(folder), "untrained"], on_prompt=partials.append)
    assert set(report.methods) == {"dflash", "untrained-dflash"}
    assert len(report.prompts) == 2  # the budget is spent at once: exactly min_prompts run
    assert [len(p.prompts) for p in partials] == [1, 2] and all(p.methods["dflash"].mismatches == 0 for p in partials)
    with pytest.raises(DflashError, match="both be reported"):
        evaluate(dataclasses.replace(cfg, data=PROMPTS, max_new_tokens=4), drafters=["untrained", "untrained"])


def test_drafters_are_named_by_method_each_with_its_own_block_size(tiny_target, tmp_path):
    """Several drafters of different methods: each is named by its method (`dspark[A]`, `dflash[B]`) and reports
    its own block size; the top-level block_size is --block-size's, the untrained drafter's, None without one."""
    from dflash.evaluate.drafters import untrained_drafter
    from dflash.export import export_drafter
    from dflash.methods.dspark import DSparkConfig, DSparkDrafter

    target_path = tiny_target("qwen3")
    target, tokenizer = load_target(target_path, "cpu", "float32")
    mask = tokenizer.convert_tokens_to_ids("<|MASK|>")
    spark = DSparkConfig.from_target_config(target.config, [1, 3, 5], mask, num_layers=1, markov_rank=8)
    torch.manual_seed(0)
    a = export_drafter(DSparkDrafter(spark).eval(), spark, tmp_path / "a")
    b = export_drafter(*untrained_drafter(target, tokenizer, BLOCK, seed=1), tmp_path / "b")
    cfg = EvalConfig(target_path, PROMPTS[:1], max_new_tokens=6, device="cpu", prompt_lookup=0, block_size=BLOCK)
    report = as_json(evaluate(cfg, drafters=[str(a), str(b)]))
    sizes = {name: m["block_size"] for name, m in report["methods"].items()}
    assert sizes == {f"dspark[{a}]": spark.block_size, f"dflash[{b}]": BLOCK} and spark.block_size != BLOCK
    assert report["block_size"] is None
    untrained = evaluate(dataclasses.replace(cfg, block_size=4), drafters=["untrained"])
    assert untrained.block_size == 4 and untrained.methods["untrained-dflash"].block_size == 4


def test_eval_compares_several_drafters_paired_over_the_prompts(tiny_target, tmp_path):
    """`--drafter A --drafter B ...`: every drafter on the same prompts, each compared with the first (a copy of A
    differs by exactly 0); the same folder twice is refused."""
    import shutil
    from pathlib import Path

    from cli.main import main
    from dflash.evaluate.drafters import untrained_drafter
    from dflash.export import export_drafter

    target_path = tiny_target("qwen3_5")
    target, tokenizer = load_target(target_path, "cpu", "float32")
    a, b, copy = (str(tmp_path / name) for name in ("a", "b", "copy"))
    for seed, folder in ((1, a), (2, b)):
        export_drafter(*untrained_drafter(target, tokenizer, BLOCK, seed=seed), Path(folder))
    shutil.copytree(a, copy)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS * 2))
    out = tmp_path / "report.json"
    args = ["eval", "--model", str(target_path), "--data", str(data), "--max-new-tokens", "10", "--device", "cpu"]
    args += ["--prompt-lookup", "0", "--json", str(out)]
    result = CliRunner().invoke(main, args + ["--drafter", a, "--drafter", b, "--drafter", copy])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert list(report["methods"]) == [f"dflash[{a}]", f"dflash[{b}]", f"dflash[{copy}]"]
    same = report["comparisons"][f"dflash[{copy}]"]
    assert same["difference"] == 0 and same["difference_95"] == [0, 0]
    other = report["comparisons"][f"dflash[{b}]"]
    taus = {name: m["tau"] for name, m in report["methods"].items()}
    assert other["reference"] == f"dflash[{a}]" and other["difference"] == pytest.approx(
        taus[f"dflash[{b}]"] - taus[f"dflash[{a}]"]
    )
    assert f"dflash[{b}] - dflash[{a}]: tau" in result.output
    twice = CliRunner().invoke(main, args[:-2] + ["--drafter", a, "--drafter", a])
    assert twice.exit_code == 2 and "given twice" in twice.output


def test_drafter_comparison_equals_a_loop_over_the_same_bootstrap_draws():
    """compare_drafters: tau difference to the first drafter and its 95 % interval, each draw taking both drafters'
    rounds on the same prompts; checked against a plain loop in float64 over the same draws."""
    import types

    import numpy as np

    from dflash.evaluate.report import Run, compare_drafters

    rng = np.random.default_rng(7)
    names = ["dflash[a]", "dflash[b]", "prompt-lookup"]
    rows = [
        {"runs": {n: Run(0, 0.0, 0, None, rng.integers(0, 16, rng.integers(1, 9)).tolist()) for n in names}}
        for _ in range(11)
    ]

    def tau(rounds):
        return sum(x + 1 for x in rounds) / len(rounds)

    methods = {n: types.SimpleNamespace(tau=tau([x for r in rows for x in r["runs"][n].accepted])) for n in names}
    result = compare_drafters(methods, rows, names[:2])
    assert list(result) == ["dflash[b]"]
    b = result["dflash[b]"]
    assert b["difference"] == pytest.approx(methods["dflash[b]"].tau - methods["dflash[a]"].tau, abs=1e-12)
    assert b["relative"] == pytest.approx(b["difference"] / methods["dflash[a]"].tau, abs=1e-12)
    differences = []
    for drawn in np.random.default_rng(0).integers(0, len(rows), size=(5000, len(rows))):
        a_rounds, b_rounds = ([x for i in drawn for x in rows[i]["runs"][n].accepted] for n in names[:2])
        differences.append(tau(b_rounds) - tau(a_rounds))
    assert b["difference_95"] == pytest.approx(np.percentile(differences, [2.5, 97.5]).tolist(), abs=1e-12)
    assert b["difference_95"][0] < b["difference_95"][1]


def test_evaluate_resumes_a_partial_report(tiny_target):
    prompts = PROMPTS + [{"prompt": "import os\nimport sys\n\ndef main():\n"}]
    cfg = EvalConfig(
        tiny_target("qwen3_5"),
        prompts,
        untrained=True,
        max_new_tokens=10,
        device="cpu",
        block_size=BLOCK,
        prompt_lookup=4,
    )
    whole = evaluate(cfg)
    partial = evaluate(dataclasses.replace(cfg, time_budget=0.0, min_prompts=1))
    assert len(partial.prompts) == 1
    calls = []
    resumed = evaluate(cfg, resume=as_json(partial), on_prompt=calls.append)
    assert len(calls) == 2 and [p["index"] for p in resumed.prompts] == [0, 1, 2]
    assert resumed.prompts[0]["plain"] == partial.prompts[0]["plain"]  # taken over, not run again
    for name, method in whole.methods.items():
        assert (resumed.methods[name].tau, resumed.methods[name].rounds) == (method.tau, method.rounds)
        assert resumed.methods[name].accepted_histogram == method.accepted_histogram
        assert [p["runs"][name].new_tokens for p in resumed.prompts] == [
            p["runs"][name].new_tokens for p in whole.prompts
        ]
    earlier = as_json(partial)
    with pytest.raises(DflashError, match="max_new_tokens: earlier report 10, this eval 11"):
        evaluate(dataclasses.replace(cfg, max_new_tokens=11), resume=earlier)
    with pytest.raises(DflashError, match="methods"):
        evaluate(dataclasses.replace(cfg, prompt_lookup=0), resume=earlier)
    with pytest.raises(
        DflashError, match="block_size: earlier report 8, this eval 4.*seed: earlier report 0, this eval 7"
    ):
        evaluate(dataclasses.replace(cfg, block_size=4, seed=7), resume=earlier)
    with pytest.raises(DflashError, match="not this prompt file's prompt 0"):
        evaluate(dataclasses.replace(cfg, data=prompts[::-1]), resume=earlier)
    tampered = as_json(partial)
    tampered["prompts"][0]["prompt_sha256"] = "0" * 64  # same length, other tokens
    with pytest.raises(DflashError, match="not this prompt file's prompt 0"):
        evaluate(cfg, resume=tampered)
    two = evaluate(dataclasses.replace(cfg, time_budget=0.0, min_prompts=2))
    with pytest.raises(DflashError, match="holds prompt 1, this eval has 1 prompts"):
        evaluate(dataclasses.replace(cfg, data=prompts[:1]), resume=as_json(two))
    for breakage in ("runs", "plain"):
        broken = as_json(partial)
        del broken["prompts"][0][breakage]
        with pytest.raises(DflashError, match="not a dflash eval report of this version"):
            evaluate(cfg, resume=broken)
    twice = as_json(partial)
    twice["prompts"] *= 2
    with pytest.raises(DflashError, match="holds prompt 0 twice"):
        evaluate(cfg, resume=twice)
    older = as_json(partial)
    del older["seed"]
    with pytest.raises(DflashError, match="lacks seed: it was written by an older dflash"):
        evaluate(cfg, resume=older)
    # Compiled and eager drafters (and graphed drafting) time differently: a report of one does not go on with the
    # other. A report from before the keys ran eager, as this CPU eval does, and is taken as such.
    compiled = as_json(partial) | {"drafter_compiled": True}
    with pytest.raises(DflashError, match="drafter_compiled: earlier report True, this eval False"):
        evaluate(cfg, resume=compiled)
    graphed = as_json(partial) | {"drafting_cuda_graph": True}
    with pytest.raises(DflashError, match="drafting_cuda_graph: earlier report True, this eval False"):
        evaluate(cfg, resume=graphed)
    before_the_keys = as_json(partial)
    del before_the_keys["drafter_compiled"], before_the_keys["drafting_cuda_graph"]
    assert len(evaluate(cfg, resume=before_the_keys).prompts) == 3


def test_cache_argument_follows_the_forward_signature():
    from dflash.evaluate.decoding import cache_argument

    class Renamed:
        def forward(self, input_ids, cache=None, use_cache=None): ...

    class Original:
        def forward(self, input_ids, past_key_values=None, use_cache=None): ...

    assert (cache_argument(Renamed()), cache_argument(Original())) == ("cache", "past_key_values")


def test_eval_cli_resumes_its_report(tiny_target, tmp_path):
    from cli.main import main

    target_path = tiny_target("qwen3_5")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "report.json"
    args = ["eval", "--model", str(target_path), "--untrained", "--block-size", "4", "--data", str(data)]
    args += ["--max-new-tokens", "6", "--device", "cpu", "--json", str(out)]
    first = CliRunner().invoke(main, args + ["--num-prompts", "1"])
    assert first.exit_code == 0, first.output
    earlier = json.loads(out.read_text())
    second = CliRunner().invoke(main, args + ["--resume"])
    assert second.exit_code == 0, second.output
    report = json.loads(out.read_text())
    assert [p["index"] for p in report["prompts"]] == [0, 1] and report["prompts"][0] == earlier["prompts"][0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl", "report.json"]  # no temporary file left
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 2 and "pass --resume" in again.output and json.loads(out.read_text()) == report
    no_json = CliRunner().invoke(main, args[:-2] + ["--resume"])
    assert no_json.exit_code == 2 and "--json" in no_json.output
    out.write_text("[1, 2]")
    not_a_report = CliRunner().invoke(main, args + ["--resume"])
    assert not_a_report.exit_code == 2 and "not a dflash eval report" in not_a_report.output


def test_a_sampled_eval_samples_its_baseline_and_leaves_greedy_prompt_lookup_out(tiny_target, monkeypatch):
    """At --temperature 0.7 the plain baseline every speedup is measured against samples at 0.7 and says so, and
    transformers' greedy prompt lookup is not in the table; at 0 both are as before."""
    import dflash.evaluate
    from dflash.evaluate.decoding import plain_decode

    temperatures = []

    def recording(target, prompt, budget, eos_ids, temperature=0.0, generator=None):
        temperatures.append(temperature)
        return plain_decode(target, prompt, budget, eos_ids, temperature, generator)

    monkeypatch.setattr(dflash.evaluate, "plain_decode", recording)
    target_path = tiny_target("qwen3")  # dense: transformers' prompt lookup runs on it
    cfg = EvalConfig(target_path, PROMPTS, untrained=True, max_new_tokens=8, device="cpu", block_size=BLOCK)
    greedy = evaluate(cfg)
    assert "prompt-lookup-generate" in greedy.methods and set(temperatures) == {0.0}
    assert greedy.baseline == "plain greedy" and "plain greedy" in greedy.table()
    temperatures.clear()
    sampled = evaluate(dataclasses.replace(cfg, temperature=0.7))
    assert set(sampled.methods) == {"untrained-dflash", "prompt-lookup"} and set(temperatures) == {0.7}
    assert sampled.baseline == "plain sampling T=0.7"
    assert "plain sampling T=0.7" in sampled.table() and "plain greedy" not in sampled.table()
    assert as_json(sampled)["baseline"] == "plain sampling T=0.7"
    # the per-position diagnostics of a sampled eval: acceptance <= the support's mass (1 for a full-vocabulary q),
    # and >= that mass times q's shape on it (draft_overlap)
    untrained = sampled.methods["untrained-dflash"]
    rows = zip(untrained.acceptance_by_position, untrained.support_by_position, untrained.shape_by_position)
    assert untrained.acceptance_by_position and all(m * f - 1e-6 <= a <= m + 1e-6 <= 1 + 2e-6 for a, m, f in rows)
    assert not greedy.methods["untrained-dflash"].acceptance_by_position  # greedy verification has none
    # the table shows them per method: accepted, then its cap, each position to 2 decimals
    accepted = " ".join(f"{a:.2f}" for a in untrained.acceptance_by_position)
    cap = " ".join(f"{m:.2f}" for m in untrained.support_by_position)
    assert f"untrained-dflash: accepted {accepted}\n" in sampled.table() and cap.startswith("1.00")
    assert sampled.table().endswith(f"untrained-dflash: cap      {cap}") and "per draft position" not in greedy.table()


def test_plain_decoding_samples_at_a_temperature(loaded):
    from dflash.evaluate.decoding import plain_decode

    target, eos_ids, prompts, _ = loaded("qwen3")
    greedy = plain_decode(target, prompts[0], 20, eos_ids).tokens
    draws = [
        plain_decode(target, prompts[0], 20, eos_ids, 1.0, torch.Generator().manual_seed(s)).tokens for s in (0, 0, 1)
    ]
    assert draws[0] == draws[1] and draws[0] != draws[2] and greedy not in draws
    assert greedy == plain_greedy(target, prompts[0], 20, eos_ids).tokens


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_compiled_drafting_equals_eager_for_every_method(loaded, device):
    """--compile-drafter: each method's proposer, compiled (dynamic context length), and with --drafting-cuda-graph
    (its forward over the context padded to a bucket of 8 here, its drafting from the block at static shapes, both
    on CUDA replayed from CUDA graphs), drafts the tokens and the q of its eager self at every context length
    (8 to 40 tokens before the block), greedy and sampled from the same generator state, without recompiling when the
    context grows or the round drafts fewer tokens."""
    import copy

    from dflash import methods
    from dflash.drafter.graph import compiled_graphs, forget_compiled_code

    target, eos_ids, prompts, tokenizer = loaded("qwen3")
    target = target if device == "cpu" else copy.deepcopy(target).to(device)
    mask = tokenizer.convert_tokens_to_ids("<|MASK|>")
    extra = {"dflash": {}, "dflash2": {"selector_rank": 8, "selector_top_k": 4}, "dspark": {"markov_rank": 8}}
    forget_compiled_code()
    for name, options in extra.items():
        method = methods.METHODS[name]
        config = method.config_cls.from_target_config(target.config, [1, 3, 5], mask, num_layers=1, **options)
        torch.manual_seed(0)
        drafter = method.model_cls(config).eval()
        for module in drafter.modules():  # away from the identity / zero starts, so the method's head matters
            for parameter in module.parameters(recurse=False):
                torch.nn.init.normal_(parameter, std=0.3)
        drafter.to(device)
        eager, *fast = (
            method.proposer_cls(drafter, config, target, compiled=c, cuda_graph=g, context_bucket=8)
            for c, g in [(False, False), (True, False), (True, True)]
        )
        graphs = None
        for context, drafts, temperature in [(9, 5, 0.0), (9, 5, 0.8), (23, 5, 0.0), (30, 2, 0.8), (41, 5, 0.8)]:
            committed = torch.randint(0, config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
            features = torch.randn(context - 1, config.feature_dim, generator=torch.Generator().manual_seed(1))
            committed, features = committed.to(device), features.to(device)
            with torch.inference_mode():
                want, *gots = (
                    p.propose(committed, features, drafts, temperature, torch.Generator(device).manual_seed(2))
                    for p in (eager, *fast)
                )
            for got in gots:
                assert torch.equal(want.tokens, got.tokens) and len(got.tokens) == drafts, name
                assert (want.probs is None) == (got.probs is None) == (temperature == 0)
                if temperature:
                    torch.testing.assert_close(got.probs, want.probs, rtol=1e-4, atol=1e-6)
            if context == 23:  # both temperatures compiled: later lengths and counts reuse the graphs
                graphs = compiled_graphs()
        assert compiled_graphs() == graphs, name
        widths = {signature[1][0][1] for signature in fast[1].forward.captured}  # features [1, width, F]
        assert widths == {8, 24, 32, 40}, name  # one graph per bucket
