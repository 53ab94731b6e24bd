"""How much work one drafting round launches, per drafter method: the aten ops of one `propose` (a block drafted
from a context of --context tokens), greedy and sampled, counted by torch's profiler.

A decoding round on a GPU shared by several eval processes is bound by the host's launches, so a method's ops per
propose predicts its eager round's cost against DFlash's (issue 52, item 4). These are eager counts
(`dflash eval --no-compile-drafter`); compiled, the default on CUDA, bench/round_time.py measures the rounds. Views
count as ops here as they do on the host; the table's last column is the ratio to the first drafter's sampled count.

    .venv/bin/python bench/propose_ops.py --model TARGET --drafter DFLASH --drafter DFLASH2 --drafter DSPARK
"""

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from dflash import methods  # noqa: E402
from dflash.export import load_drafter  # noqa: E402


def propose_ops(proposer, committed: torch.Tensor, features: torch.Tensor, drafts: int, temperature: float) -> dict:
    """aten op names -> calls of one propose (after one untimed call, which builds what is built once)."""
    generator = torch.Generator(device=committed.device).manual_seed(0)
    with torch.inference_mode():
        proposer.propose(committed, features, drafts, temperature, generator)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            proposer.propose(committed, features, drafts, temperature, generator)
    return collections.Counter(e.name for e in profile.events() if e.name.startswith("aten::"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the target's folder (its embeddings and LM head draft)")
    parser.add_argument("--drafter", action="append", required=True, help="an exported drafter folder (repeatable)")
    parser.add_argument("--context", type=int, default=200, help="committed tokens before the block")
    parser.add_argument("--temperature", type=float, default=1.0, help="the sampled column's temperature")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    committed = torch.randint(0, target.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    rows, reference = [], None
    for folder in args.drafter:
        drafter, cfg = load_drafter(folder, dtype=torch.float32)
        proposer = methods.METHODS[cfg.method].proposer_cls(drafter.eval(), cfg, target)
        width = drafter.fc.in_features  # the tapped layers' concatenated features (a subspace store's k)
        features = torch.randn(args.context - 1, width, generator=torch.Generator().manual_seed(1))
        drafts = proposer.block_size - proposer.first_draft
        greedy, sampled = (
            sum(propose_ops(proposer, committed, features, drafts, t).values()) for t in (0.0, args.temperature)
        )
        reference = reference or sampled
        rows.append((cfg.method, cfg.block_size, drafts, greedy, sampled, sampled / reference, folder))
    print(
        f"\naten ops of one propose, context {args.context} tokens, T=0 and T={args.temperature:g} (torch {torch.__version__})"
    )
    print("| method | block | drafts | ops T=0 | ops sampled | sampled vs the first |\n|---|---|---|---|---|---|")
    for method, block, drafts, greedy, sampled, ratio, folder in rows:
        print(f"| {method} ({folder}) | {block} | {drafts} | {greedy} | {sampled} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
