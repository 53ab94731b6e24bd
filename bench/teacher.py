"""Choose how `--teacher topk:K` stores probabilities, by measurement: the error each encoding adds to the target's
top-K distribution (total variation, the distance DSpark trains on) and its bytes per token through each codec.

Distributions: Zipf-like (p proportional to rank^-a times log-normal noise, a per token, so top-1 probabilities
spread from flat to peaked; ids drawn by a Zipf frequency over the vocabulary, as frequent tokens recur in real
text), or the outputs of a target over the bundled corpus (--model; a tiny random-weight one is near-uniform).

    .venv/bin/python bench/teacher.py                     # synthetic, V = 151936, K = 32
    python bench/teacher.py --model /models/Qwen3-8B --device cuda
"""

import argparse

import numcodecs
import numpy as np
import torch

from dflash.tiny import corpus_texts


def synthetic(tokens: int, vocab: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 top-k probabilities [N, k] (descending), their int32 ids [N, k] and the tail mass [N]."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    frequency = ranks**-1.1 / (ranks**-1.1).sum()
    probs, ids, tails = [], [], []
    for _ in range(tokens):
        exponent = rng.uniform(0.8, 3.0)  # flat (high entropy) to peaked
        p = ranks**-exponent * rng.lognormal(0.0, 0.5, vocab)
        p /= p.sum()
        top = np.argsort(-p)[:k]
        probs.append(p[top])
        tails.append(1.0 - p[top].sum())
        ids.append(rng.choice(vocab, size=k, replace=False, p=frequency))
    return np.array(probs), np.array(ids, np.int32), np.array(tails)


@torch.no_grad()
def from_model(path: str, tokens: int, k: int, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    ids = tokenizer("\n\n".join(corpus_texts()), return_tensors="pt").input_ids[0][:tokens]
    probs, top_ids, tails = [], [], []
    for piece in ids.split(2048):
        logp = model(piece[None].to(device)).logits[0].double().log_softmax(-1)
        values, indices = logp.topk(k, -1)
        probs.append(values.exp().cpu())
        top_ids.append(indices.int().cpu())
        tails.append((1 - values.exp().sum(-1)).clamp_min(0).cpu())
    return torch.cat(probs).numpy(), torch.cat(top_ids).numpy(), torch.cat(tails).numpy()


def encodings(probs: np.ndarray, tails: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """name -> (stored array, decoded top-k probabilities, decoded tail mass)."""
    t = torch.from_numpy(probs)
    out = {}
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        stored = t.to(dtype)
        decoded = stored.double().numpy()
        tail = torch.from_numpy(tails).to(dtype).double().numpy()
        out[f"p {name} + tail {name}"] = (stored.view(torch.int16).numpy(), decoded, tail)
        out[f"p {name}, tail 1 - sum"] = (stored.view(torch.int16).numpy(), decoded, 1 - decoded.sum(-1))
        logp = t.log().to(dtype)
        decoded = logp.double().exp().numpy()
        out[f"log p {name} + tail {name}"] = (logp.view(torch.int16).numpy(), decoded, tail)
    return out


def codecs(typesize: int) -> dict:
    return {
        "zstd(1)": numcodecs.Zstd(level=1),
        "blosc-lz4 bitshuffle": numcodecs.Blosc("lz4", 5, numcodecs.Blosc.BITSHUFFLE, typesize=typesize),
        "blosc-zstd(1) bitshuffle": numcodecs.Blosc("zstd", 1, numcodecs.Blosc.BITSHUFFLE, typesize=typesize),
    }


def per_token(array: np.ndarray, codec, rows: int) -> float:
    """Compressed bytes per token, chunked like the store ([rows of T tokens, K])."""
    chunks = np.array_split(np.ascontiguousarray(array), rows)
    return sum(len(codec.encode(np.ascontiguousarray(c))) for c in chunks) / len(array)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a target checkpoint (default: synthetic distributions)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936, help="synthetic vocabulary size")
    parser.add_argument("-k", type=int, default=32)
    args = parser.parse_args()
    if args.model:
        probs, ids, tails = from_model(args.model, args.tokens, args.k, args.device)
    else:
        probs, ids, tails = synthetic(args.tokens, args.vocab, args.k)
    rows = max(1, len(probs) // 1024)
    print(f"{len(probs)} tokens, K = {args.k}; mean top-1 {probs[:, 0].mean():.3f}, mean tail {tails.mean():.3f}")
    print(f"{'encoding':<26} {'TV mean':>9} {'TV max':>9}  " + "  ".join(f"{c:>24}" for c in codecs(2)))
    for name, (stored, decoded, tail) in encodings(probs, tails).items():
        tv = 0.5 * (np.abs(decoded - probs).sum(-1) + np.abs(tail - tails))
        sizes = [per_token(stored, codec, rows) + 2 for codec in codecs(2).values()]  # + 2: the fp16 tail
        if "1 - sum" in name:
            sizes = [size - 2 for size in sizes]
        print(f"{name:<26} {tv.mean():9.2e} {tv.max():9.2e}  " + "  ".join(f"{s:22.1f} B" for s in sizes))
    raw = args.k * 4
    sizes = [per_token(ids, codec, rows) for codec in codecs(4).values()]
    print(f"{'ids int32':<26} {'':>9} {'':>9}  " + "  ".join(f"{s:22.1f} B" for s in sizes) + f"  (raw {raw} B)")


if __name__ == "__main__":
    main()
