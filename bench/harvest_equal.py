"""Does a harvest on N processes store the same content as a harvest on one? Both run the real CLI
(`python -m cli harvest`, then `torchrun --nproc-per-node N -m cli harvest`) on the same data, and the two
stores are compared document by document through the store's reading API.

The target is a random-weight Qwen3.5 hybrid (3 Gated-DeltaNet layers per full-attention layer, heads of up to
128 as in the real model) of width --hidden with dflash.tiny's tokenizer, saved with save_pretrained; the data is
a JSONL of --documents chat and text documents of log-uniformly spread lengths, a few longer than the token
budget (split into pieces).

    python bench/harvest_equal.py --device cuda --procs 2 --json equal.json     # on a 2-GPU machine
    python bench/harvest_equal.py --tiny --device cpu                           # toy sizes on the CPU

The ranks pack different documents into rows and forward batches than the single process does, and on the GPU
a bf16 kernel's result can depend on the batch's shape, so hidden states may differ in their last bits. Hence:
token ids, position ids, doc ids and loss masks must be equal exactly; hidden states are reported per document
as the fraction of bitwise-equal values and the largest absolute difference, and must stay within --tolerance
of the document's largest |value| (a misplaced or foreign document differs by the order of the values).

Verdict: IDENTICAL (bit for bit), EQUAL UP TO ROUNDING, or DIFFERENT (exit status 1). The wall times of both
runs are printed; they include starting Python, tokenising, loading the target and compiling kernels.
"""

import argparse
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the repository's dflash

from dflash.store import TOKEN_ARRAYS, Store  # noqa: E402
from dflash.tiny import corpus_texts, save_random_target  # noqa: E402

LABELS = ("one", "many")  # the one-process store, the N-process store
TINY = dict(hidden=64, documents=60, token_budget=512, forward_tokens=1024, work="/tmp/dflash-harvest-equal-tiny")


# ---------------------------------------------------------------------------------------------- inputs


def target_config(vocab_size: int, hidden: int, layers: int):
    from transformers import Qwen3_5TextConfig

    head_dim = min(128, hidden // 4)
    heads = hidden // head_dim
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=head_dim,
        linear_num_value_heads=heads,
        linear_num_key_heads=max(1, heads // 2),
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
    )


def write_corpus(path: Path, count: int, max_tokens: int, seed: int = 0) -> None:
    """`count` JSONL documents, every third a chat; lengths log-uniform from a few tokens to `max_tokens`.

    Text is cut from the bundled corpus (what the tokenizer was trained on) at about 2 characters a token.
    """
    rng = np.random.default_rng(seed)
    pool = "\n\n".join(corpus_texts())
    lines = []
    for i in range(count):
        chars = int(2 * np.exp(rng.uniform(np.log(4), np.log(max_tokens))))
        start = int(rng.integers(0, len(pool) - chars))
        text = pool[start : start + chars]
        if i % 3 == 0:
            cut = len(text) // 3
            turns = [{"role": "user", "content": text[:cut]}, {"role": "assistant", "content": text[cut:]}]
            record = {"messages": turns}
        else:
            record = {"text": text}
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")


def harvest_command(args, model: Path, data: Path, out: Path, procs: int) -> list[str]:
    cli = [
        "-m",
        "cli",
        "harvest",
        "--model",
        str(model),
        "--data",
        str(data),
        "--out",
        str(out),
        "--token-budget",
        str(args.token_budget),
        "--forward-tokens",
        str(args.forward_tokens),
        "--overflow",
        "split",
        "--workers",
        str(args.workers),
        "--dtype",
        args.dtype,
        *(["--device", args.device] if args.device else []),
    ]
    if procs == 1:
        return [sys.executable, *cli]
    # --standalone: a free rendezvous port, whatever else runs on the machine
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs), *cli]


def run_harvest(command: list[str], log: Path) -> float:
    """Wall seconds of the command; its output goes to `log`, whose tail is shown if it fails."""
    # The environment is passed through (on the GPU machine it keeps NVLink multicast off: NCCL_NVLS_ENABLE=0).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    print("$ " + " ".join(command), flush=True)
    start = time.perf_counter()
    with open(log, "w") as output:
        process = subprocess.run(command, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    text = log.read_text()
    if process.returncode != 0:
        sys.exit(f"the harvest failed (exit status {process.returncode}); the end of {log}:\n{text[-4000:]}")
    for line in text.splitlines():
        if "row groups after" in line:  # each rank's pipeline summary (PipelineStalls)
            print("  " + line.split("\r")[-1])
    return seconds


# ---------------------------------------------------------------------------------------------- comparison


def document_spans(shards: Store) -> dict[tuple[int, int], tuple[int, slice]]:
    """(doc_id, piece) -> (global row, token slice in that row)."""
    return {
        (doc_id, piece): (row, slice(start, start + length))
        for doc_id, piece, row, start, length in shards.documents().tolist()
    }


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def compare_document(one: dict, many: dict) -> dict:
    """One document's slices of every row array in both stores."""
    same_bits = one["hidden"] == many["hidden"]
    reference, other = bf16_values(one["hidden"]), bf16_values(many["hidden"])
    difference = np.where(same_bits, 0, np.abs(reference - other))  # a NaN on one side only counts as infinite
    return {
        "length": len(one["input_ids"]),
        "tokens_equal": all(np.array_equal(one[name], many[name]) for name in TOKEN_ARRAYS),
        "bitwise_equal": float(same_bits.mean()),
        "max_abs_diff": float(np.nan_to_num(difference, nan=np.inf).max()),
        "max_abs_value": float(np.nanmax(np.abs(reference))),
    }


def compare_stores(one_path: Path, many_path: Path) -> dict:
    stores = one, many = Store.open(one_path), Store.open(many_path)
    one_spans, many_spans = document_spans(one), document_spans(many)
    # The one-process store is read row by row; the other's rows hold other documents, so they stay cached.
    read_one, read_many = functools.lru_cache(maxsize=1)(one.read_row), functools.cache(many.read_row)
    documents = {}
    for key, (row, span) in sorted(one_spans.items(), key=lambda item: item[1][0]):
        if key in many_spans:
            many_row, many_span = many_spans[key]
            documents[key] = compare_document(
                {name: array[span] for name, array in read_one(row).items()},
                {name: array[many_span] for name, array in read_many(many_row).items()},
            )
    counts = ("documents", "tokens", "loss_tokens")
    return {
        "missing": sorted(one_spans.keys() - many_spans.keys()),
        "extra": sorted(many_spans.keys() - one_spans.keys()),
        "counts_equal": all(getattr(one.manifest.counts, c) == getattr(many.manifest.counts, c) for c in counts),
        "layout": {
            name: {"parts": len(s.part_names), **dataclasses.asdict(s.manifest.counts)}
            for name, s in zip(LABELS, stores)
        },
        "documents": documents,
    }


def verdict(comparison: dict, tolerance: float) -> tuple[bool, str]:
    documents = comparison["documents"].values()
    wrong_tokens = [key for key, doc in comparison["documents"].items() if not doc["tokens_equal"]]
    if comparison["missing"] or comparison["extra"] or not comparison["counts_equal"] or wrong_tokens:
        return False, (
            f"DIFFERENT: {len(comparison['missing'])} documents missing, {len(comparison['extra'])} extra, "
            f"manifest counts {'equal' if comparison['counts_equal'] else 'differ'}, token arrays differ in "
            f"{len(wrong_tokens)} documents {wrong_tokens[:5]}"
        )
    if all(doc["bitwise_equal"] == 1.0 for doc in documents):
        return True, f"IDENTICAL: all {len(documents)} documents, token arrays and hidden states bit for bit"
    worst = max(doc["max_abs_diff"] / max(doc["max_abs_value"], 1e-30) for doc in documents)
    equal = "EQUAL UP TO ROUNDING" if worst <= tolerance else "DIFFERENT"
    return worst <= tolerance, (
        f"{equal}: token arrays identical in all {len(documents)} documents; hidden states differ by at most "
        f"{worst:.2e} of a document's largest |value| (tolerance {tolerance})"
    )


def summarise(comparison: dict) -> None:
    for name, layout in comparison["layout"].items():
        print(f"store {name}: {layout}")
    docs = comparison["documents"]
    if not docs:
        return
    bitwise = np.array([doc["bitwise_equal"] for doc in docs.values()])
    tokens = np.array([doc["length"] for doc in docs.values()])
    print(
        f"hidden states: {int((bitwise == 1).sum())} of {len(docs)} documents bitwise equal; bitwise-equal values "
        f"{100 * (bitwise * tokens).sum() / tokens.sum():.3f} % of all, per document min {100 * bitwise.min():.2f} % "
        f"median {100 * np.median(bitwise):.2f} %"
    )
    print("largest differences: (doc_id, piece) length | bitwise equal | max abs diff | max |value|")
    for key, doc in sorted(docs.items(), key=lambda item: -item[1]["max_abs_diff"])[:5]:
        print(
            f"  {key} {doc['length']} | {100 * doc['bitwise_equal']:.2f} % | {doc['max_abs_diff']:.3g} | "
            f"{doc['max_abs_value']:.3g}"
        )


# ---------------------------------------------------------------------------------------------- main


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=2, help="processes (GPUs) of the second harvest")
    parser.add_argument("--device", help="the harvest's --device (default: its own, cuda:$LOCAL_RANK or the CPU)")
    parser.add_argument("--hidden", type=int, default=1024, help="the target's width")
    parser.add_argument("--layers", type=int, default=8, help="the target's depth (5 layers tapped by the DFlash rule)")
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--forward-tokens", type=int, default=16384)
    parser.add_argument("--dtype", default="bfloat16", help="the target's compute dtype in the harvest")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (a few hundred lines need none)")
    parser.add_argument("--tolerance", type=float, default=0.1, help="largest hidden difference / largest |value|")
    parser.add_argument("--work", default="/tmp/dflash-harvest-equal", help="target, data and both stores")
    parser.add_argument("--json", help="also write the comparison and timings here")
    parser.add_argument("--tiny", action="store_true", help=f"toy sizes (defaults {TINY}) for a check on the CPU")
    if parser.parse_known_args()[0].tiny:  # toy defaults; options given explicitly still win
        parser.set_defaults(**TINY)
    return parser.parse_args()


def main():
    args = parse_args()
    work = Path(args.work)
    model = save_random_target(
        work / f"target-{args.hidden}x{args.layers}",
        lambda vocab: target_config(vocab, args.hidden, args.layers),
        dtype="bfloat16",
    )
    data = work / f"data-{args.documents}x{args.token_budget}.jsonl"
    write_corpus(data, args.documents, max_tokens=3 * args.token_budget // 2)
    stores = {"one": work / "store-1", "many": work / f"store-{args.procs}"}
    seconds = {}
    for name, procs in zip(LABELS, (1, args.procs)):
        shutil.rmtree(stores[name], ignore_errors=True)
        command = harvest_command(args, model, data, stores[name], procs)
        seconds[name] = run_harvest(command, work / f"harvest-{procs}.log")
    comparison = compare_stores(stores["one"], stores["many"])
    summarise(comparison)
    ok, text = verdict(comparison, args.tolerance)
    tokens = comparison["layout"]["one"]["tokens"]
    print(
        f"wall time: 1 process {seconds['one']:.1f} s ({tokens / seconds['one']:,.0f} tok/s), {args.procs} processes "
        f"{seconds['many']:.1f} s ({tokens / seconds['many']:,.0f} tok/s); {tokens:,} tokens, "
        f"device {args.device or 'default'}"
    )
    print(text)
    if args.json:
        documents = [{"doc_id": d, "piece": p, **doc} for (d, p), doc in comparison["documents"].items()]
        report = {**comparison, "documents": documents, "verdict": text, "equal": ok, "seconds": seconds}
        Path(args.json).write_text(json.dumps({**report, "options": vars(args)}, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
