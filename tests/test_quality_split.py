"""bench/quality's file split: the eval measures the drafter on code that neither the target nor the drafter
trained on, and giving the drafter its own files leaves the eval's files as they were."""

import dataclasses
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench.quality

from bench.quality.corpus import make_prompts, stdlib_files  # noqa: E402
from bench.quality.scale import TINY  # noqa: E402


def test_the_three_sets_are_disjoint_and_the_eval_set_does_not_move():
    scale = TINY
    train, drafter, heldout, counts = stdlib_files(scale)
    assert train and drafter and heldout
    assert not (set(train) & set(drafter)) and not (set(train) & set(heldout)) and not (set(drafter) & set(heldout))
    assert counts["drafter_files"] == len(drafter) and counts["heldout_chars"] == sum(map(len, heldout.values()))
    total = len(train) + len(drafter) + len(heldout)
    assert 0.05 < len(heldout) / total < 0.15 and 0.14 < len(drafter) / total < 0.26  # 10 % and 20 % by hash

    train0, drafter0, heldout0, _ = stdlib_files(dataclasses.replace(scale, drafter_percent=0))
    assert not drafter0
    assert heldout0 == heldout
    assert set(train0) == set(train) | set(drafter)


def test_the_drafters_prompts_are_distinct_and_stop_when_the_files_run_out():
    """Drawn with replacement, prompts repeat; the harvest keeps one copy of a repeated record, so a repeat would
    be answered for nothing. A corpus with fewer distinct prompts than asked gives all it has."""
    files = {f"f{i}.py": "".join(f"line_{i}_{j} = {j}\n" for j in range(40)) for i in range(3)}
    prompts = make_prompts(files, 60, 20, seed=0, one_per_file=False)
    texts = [p["text"] for p in prompts]
    assert len(texts) == 60 == len(set(texts))
    every = make_prompts(files, 300, 20, seed=0, one_per_file=False)  # 3 x 40 lines: < 120
    assert len({p["text"] for p in every}) == len(every) < 120


def test_the_quality_run_starts_as_a_module_from_the_repository():
    """`python3 -m bench.quality` (the command every plan and doc gives) finds its stages and names itself."""
    repository = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "bench.quality", "--help"], cwd=repository, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python3 -m bench.quality") and "--modes" in result.stdout
