"""What one speculative decoding round costs per drafter method, eager against compiled (`dflash eval
--compile-drafter`, and with `--drafting-cuda-graph`), at each temperature: issue 52's item 4 asks that every
method's sampled round be as fast as DFlash's.

The target is a random-weight model of a real architecture (the quality fixture's Qwen3.5 hybrid shape by default)
saved to --work and loaded through `dflash eval`'s own loading, its LM head scaled up (x HEAD_SCALE) so that its
next-token distributions are peaked at random tokens; each method's drafter is randomly initialised from its config
class (block sizes: each method's default). Such drafters are rejected at almost every round at either temperature
(a flat target would accept a flat drafter's samples), so a generation is about one round per token and each round
verifies a full block: the round's cost, not its acceptance, is measured (tau is printed to show it). Every row is
one `dflash.evaluate.evaluate` over the same prompts (its warm-up pays for allocations and compiles), reporting the
verify rounds' mean wall time and the plain decoding's time per token.

    python3 bench/round_time.py --arch qwen3 --work /tmp/rounds --json rounds.json
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from dflash import methods  # noqa: E402
from dflash.config import EvalConfig  # noqa: E402
from dflash.device import resolve_dtype  # noqa: E402
from dflash.evaluate import evaluate  # noqa: E402
from dflash.target import default_layer_ids  # noqa: E402
from dflash.target_files import MASK_TOKEN  # noqa: E402
from dflash.tiny import save_random_target, tiny_config  # noqa: E402

PROMPTS = Path(__file__).resolve().parent.parent / "data" / "prompts.jsonl"
HEAD_SCALE = 30.0


def peaked_target(work: Path, arch: str, hidden: int, layers: int) -> Path:
    """A random `arch` target saved under `work`, its LM head scaled by HEAD_SCALE (reused if already there)."""
    from transformers import AutoModelForCausalLM

    folder = work / f"{arch}-{hidden}x{layers}-head{HEAD_SCALE:g}"
    if (folder / "config.json").exists():
        return folder
    save_random_target(folder, lambda vocab: tiny_config(arch, vocab, layers, hidden))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_SCALE)
    model.save_pretrained(folder)
    return folder


def random_drafters(folder: Path, names: list[str], device: str, dtype: torch.dtype) -> dict:
    """{method: (model, config)} of random drafters for the target saved in `folder`."""
    from transformers import AutoConfig, AutoTokenizer

    text = AutoConfig.from_pretrained(folder).get_text_config(decoder=True)
    mask = AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(MASK_TOKEN)
    drafters = {}
    for name in names:
        method = methods.METHODS[name]
        config = method.config_cls.from_target_config(text, default_layer_ids(text.num_hidden_layers), mask)
        torch.manual_seed(0)
        drafters[name] = (method.model_cls(config).to(device=device, dtype=dtype).eval(), config)
    return drafters


# --drafters' modes: (--compile-drafter, --drafting-cuda-graph) of each run
MODES = {"eager": (False, False), "compiled": (True, False), "graphed": (True, True)}


def measure(args, folder: Path, temperature: float, mode: str) -> list[dict]:
    compiled, graphed = MODES[mode]
    cfg = EvalConfig(
        model=str(folder),
        data=str(PROMPTS),
        num_prompts=args.prompts,
        max_new_tokens=args.new_tokens,
        temperature=temperature,
        prompt_lookup=0,
        dtype=args.dtype,
        compile_drafter=compiled,
        drafting_cuda_graph=graphed,
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(args.dtype, device)  # the eval's own reading of --dtype: the drafters match its target
    report = evaluate(cfg, drafters=random_drafters(folder, args.methods, device, dtype))
    plain_ms = 1e3 / report.plain_tokens_per_s
    rows = []
    for name, m in report.methods.items():
        rows.append(
            dict(
                method=name,
                block=m.block_size,
                temperature=temperature,
                drafter=mode,
                rounds=m.rounds,
                tau=m.tau,
                round_ms=1e3 * m.seconds / m.rounds,
                plain_token_ms=plain_ms,
                device=report.device,
                dtype=report.dtype,
            )
        )
    return rows


def vs_dflash(rows: list[dict], row: dict, value: str) -> str:
    """row[value] over DFlash's among the rows of the same temperature and drafter mode: "1.07x", or "-" without it."""
    same = [r for r in rows if (r["temperature"], r["drafter"]) == (row["temperature"], row["drafter"])]
    reference = next((r[value] for r in same if r["method"] == "dflash"), None)
    return f"{row[value] / reference:.2f}x" if reference else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=None, help="where the random target is saved (default: a temporary folder)")
    parser.add_argument("--arch", default="qwen3_5", help="the target's architecture (dflash.tiny.ARCHITECTURES)")
    parser.add_argument("--hidden", type=int, default=512, help="the target's width (the GPU quality fixture's)")
    parser.add_argument("--layers", type=int, default=8, help="the target's depth")
    parser.add_argument("--methods", default="dflash,dflash2,dspark", type=lambda s: s.split(","))
    parser.add_argument("--temperatures", default="0,1", type=lambda s: [float(t) for t in s.split(",")])
    parser.add_argument(
        "--drafters",
        default="eager,compiled,graphed",
        type=lambda s: s.split(","),
        help="how the drafters run, any of: eager, compiled (--compile-drafter), graphed (also --drafting-cuda-graph)",
    )
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", help="the eval's --dtype (issue 52 measured in float32)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="rounds-"))
    folder = peaked_target(work, args.arch, args.hidden, args.layers)
    rows = []
    for temperature in args.temperatures:
        for mode in args.drafters:
            rows += measure(args, folder, temperature, mode)
            for row in rows[-len(args.methods) :]:  # as measured: a run cut short keeps what it has
                print("row", json.dumps(row), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))
    first = rows[0]
    print(
        f"\none speculative round per method, random drafters on a random {args.arch} target (hidden {args.hidden}, "
        f"{args.layers} layers), {args.prompts} prompts x {args.new_tokens} tokens, {first['device']}, "
        f"{first['dtype']}, torch {torch.__version__}"
    )
    print("| T | drafter | method | block | rounds | tau | ms / round | vs dflash's round | plain ms / token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        ratio = vs_dflash(rows, row, "round_ms")
        print(
            f"| {row['temperature']:g} | {row['drafter']} | {row['method']} | "
            f"{row['block']} | {row['rounds']} | {row['tau']:.2f} | {row['round_ms']:.2f} | {ratio} | "
            f"{row['plain_token_ms']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
