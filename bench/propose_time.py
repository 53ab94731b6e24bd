"""What one drafting call costs per method and mode, the verification left out: `propose` of a block after --context
tokens, as `dflash eval` runs it (eager, compiled: --compile-drafter, graphed: also --drafting-cuda-graph), greedy
and sampled. bench/round_time.py times whole rounds, whose target forward and verification dilute the drafting;
this isolates it, and with --profile prints the host's and the device's busiest ops for one method's graphed
sampled call, to find what a round spends beyond DFlash's.

Random drafters of each method's config on a random target (bench/round_time.py's, the LM head scaled), the features
random, every call synchronised at the end of the timed loop (ms per call = wall time / calls).

    python3 bench/propose_time.py --arch qwen3 --work /tmp/rounds --profile dflash2
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # round_time's random target and drafters

from round_time import MODES, peaked_target, random_drafters, vs_dflash  # noqa: E402

from dflash import methods  # noqa: E402
from dflash.drafter.graph import forget_compiled_code  # noqa: E402


def time_proposer(proposer, committed, features, temperature: float, calls: int) -> float:
    """ms per propose of the whole block, after warm-up calls (compiles, captures)."""
    drafts = proposer.block_size - proposer.first_draft
    generator = torch.Generator(device=committed.device).manual_seed(0)
    for _ in range(3):
        proposer.propose(committed, features, drafts, temperature, generator)
    synchronize(committed.device)
    start = time.perf_counter()
    for _ in range(calls):
        proposer.propose(committed, features, drafts, temperature, generator)
    synchronize(committed.device)
    return 1e3 * (time.perf_counter() - start) / calls


def profile_proposer(proposer, committed, features, temperature: float, calls: int = 20) -> str:
    drafts = proposer.block_size - proposer.first_draft
    generator = torch.Generator(device=committed.device).manual_seed(0)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if committed.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(calls):
            proposer.propose(committed, features, drafts, temperature, generator)
        synchronize(committed.device)
    averages = profile.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=15)]
    if committed.device.type == "cuda":
        tables.append(averages.table(sort_by="self_device_time_total", row_limit=12))
    return "\n".join(tables)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=None, help="where the random target is saved (default: a temporary folder)")
    parser.add_argument("--arch", default="qwen3", help="the target's architecture (dflash.tiny.ARCHITECTURES)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--methods", default="dflash,dflash2,dspark", type=lambda s: s.split(","))
    parser.add_argument("--modes", default="compiled,graphed", type=lambda s: s.split(","), help=f"of {list(MODES)}")
    parser.add_argument("--temperatures", default="0,1", type=lambda s: [float(t) for t in s.split(",")])
    parser.add_argument("--context", type=int, default=200, help="committed tokens before the block")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per row")
    parser.add_argument("--profile", default=None, help="a method whose graphed calls to profile at each temperature")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    folder = peaked_target(Path(args.work or tempfile.mkdtemp(prefix="propose-")), args.arch, args.hidden, args.layers)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    drafters = random_drafters(folder, args.methods, str(device), torch.float32)
    vocab = target.config.get_text_config(decoder=True).vocab_size
    committed = torch.randint(0, vocab, (args.context,), generator=torch.Generator().manual_seed(0)).to(device)
    rows, profiles = [], []
    forget_compiled_code()
    with torch.inference_mode():
        for name, (drafter, config) in drafters.items():
            features = torch.randn(args.context - 1, config.feature_dim, generator=torch.Generator().manual_seed(1))
            features = features.to(device)
            for mode in args.modes:
                compiled, graphed = MODES[mode]
                proposer = methods.METHODS[name].proposer_cls(
                    drafter, config, target, compiled=compiled, cuda_graph=graphed
                )
                for temperature in args.temperatures:
                    ms = time_proposer(proposer, committed, features, temperature, args.calls)
                    rows.append(
                        dict(method=name, drafter=mode, temperature=temperature, propose_ms=ms, device=str(device))
                    )
                    print("row", json.dumps(rows[-1]), flush=True)
                    if name == args.profile and mode == "graphed":
                        profiles.append((temperature, profile_proposer(proposer, committed, features, temperature)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    for temperature, table in profiles:
        print(f"\nprofile: {args.profile}, graphed, T={temperature:g}, 20 calls\n{table}")
    print(
        f"\none propose per method (block after {args.context} tokens), random drafters on a random {args.arch} target "
        f"(hidden {args.hidden}, {args.layers} layers), {device}, float32, torch {torch.__version__}"
    )
    print("| T | mode | method | ms / propose | vs dflash's |")
    print("|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: (r["temperature"], list(MODES).index(r["drafter"]))):
        ratio = vs_dflash(rows, row, "propose_ms")
        print(f"| {row['temperature']:g} | {row['drafter']} | {row['method']} | {row['propose_ms']:.3f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
