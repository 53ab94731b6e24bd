"""Choose the hidden-state codec by measurement: ratio, write and read MB/s through zarr, on real activations.

Activations are the DFlash-tapped layers of a target run over the bundled corpus, packed into rows exactly as
the store packs them (same chunking, CRC32C on every chunk). MB/s counts uncompressed bytes; reads come from
the page cache, so they measure decoding, not the disk.

    .venv/bin/python bench/codecs.py                                   # tiny random target, CPU
    python bench/codecs.py --model /models/Qwen3-8B --device cuda --tokens 262144 --token-budget 12288

Each store encoding is measured (--encodings): bf16, fp8, and subspaces (sub1/4: the top quarter of the
directions, P from the activations' own second moment, as the harvest computes it), alone or with fp8. The
ratio is to the encoded bytes; "of bf16" is the on-disk size over the raw bf16 bytes.
"""

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from dflash import features
from dflash.store import disk_bytes, hidden_chunk_tokens
from dflash.tiny import corpus_texts, make_tiny_target


def candidates(typesize: int):
    def blosc(cname, shuffle, clevel):
        return BloscCodec(cname=cname, clevel=clevel, shuffle=shuffle, typesize=typesize)

    return {
        "none": [],
        "zstd(1)": [ZstdCodec(level=1)],
        "zstd(3)": [ZstdCodec(level=3)],
        "blosc-lz4 shuffle": [blosc("lz4", "shuffle", 5)],
        "blosc-lz4 bitshuffle": [blosc("lz4", "bitshuffle", 5)],
        "blosc-zstd(1) shuffle": [blosc("zstd", "shuffle", 1)],
        "blosc-zstd(1) bitshuffle": [blosc("zstd", "bitshuffle", 1)],
        "blosc-zstd(3) bitshuffle": [blosc("zstd", "bitshuffle", 3)],
    }


@torch.no_grad()
def activations(model_path: str, tokens: int, device: str, token_budget: int, n_layers: int) -> np.ndarray:
    """uint16 [rows, token_budget, n*H]: bf16 bits of n evenly spaced layers' outputs over corpus text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to(device).eval()
    num_layers = model.config.get_text_config().num_hidden_layers
    layer_ids = [round(1 + i * (num_layers - 4) / (n_layers - 1)) for i in range(n_layers)]
    ids = tokenizer("\n\n".join(corpus_texts()), return_tensors="pt").input_ids[0]
    ids = ids.repeat(tokens // len(ids) + 1)[:tokens]  # a small model's corpus may be shorter than asked
    seq = min(token_budget, 4096)
    rows = []
    for piece in ids.split(seq):
        states = model(piece[None].to(device), output_hidden_states=True).hidden_states
        rows.append(torch.cat([states[k + 1][0] for k in layer_ids], dim=-1).to(torch.bfloat16).cpu())
    flat = torch.cat(rows)[: tokens - tokens % token_budget]
    return flat.view(torch.int16).numpy().view(np.uint16).reshape(-1, token_budget, flat.shape[-1])


def encode(data: np.ndarray, encoding: str) -> np.ndarray:
    """bf16 bits [rows, T, F] -> the stored bits of `encoding` ("bf16", "fp8", "sub1/4", "sub1/4+fp8", ...)."""
    x = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    precision = "fp8" if encoding.endswith("fp8") else "bf16"
    if encoding.startswith("sub"):
        numerator, denominator = encoding[3:].split("+")[0].split("/")
        width = x.shape[-1] * int(numerator) // int(denominator)
        moment = features.SecondMoment(x.shape[-1], torch.device("cpu"))
        moment.add(x.flatten(0, 1))
        projection, captured = features.top_subspace(moment.sum, width)
        print(f"  {encoding}: the top {width} of {x.shape[-1]} directions hold {captured:.2%} of the second moment")
        x = features.project(x, projection)
    if precision == "fp8":
        return features.quantize_fp8(x, 1 if encoding.startswith("sub") else 5)[0].numpy()
    return x.contiguous().view(torch.int16).numpy().view(np.uint16)


def measure(data: np.ndarray, compressors, folder: Path, repeat: int) -> tuple[float, float, float]:
    """(ratio, write MB/s, read MB/s), the best of `repeat` timings: the machine may be shared."""
    rows, T, F = data.shape
    array = zarr.create_array(
        folder,
        shape=data.shape,
        chunks=(1, hidden_chunk_tokens(T, F * data.itemsize), F),
        dtype=data.dtype,
        compressors=[*compressors, Crc32cCodec()],
        fill_value=0,
    )
    write = read = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        array[:] = data
        write = min(write, time.perf_counter() - start)
    for _ in range(repeat):
        start = time.perf_counter()
        back = array[:]
        read = min(read, time.perf_counter() - start)
    assert np.array_equal(back, data)
    return data.nbytes / disk_bytes(folder), data.nbytes / write / 1e6, data.nbytes / read / 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="target checkpoint; default: a tiny random qwen3 target")
    parser.add_argument("--hidden-size", type=int, default=512, help="hidden size of the tiny target")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=5, help="number of tapped layers")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3, help="timings per codec; the best is printed")
    parser.add_argument("--threads", type=int, help="zarr codec threads (default: zarr's)")
    parser.add_argument(
        "--encodings", default="bf16,fp8,sub1/4,sub1/4+fp8,sub1/8+fp8", help="store encodings to measure"
    )
    args = parser.parse_args()
    if args.threads:
        zarr.config.set({"threading.max_workers": args.threads})
    work = Path(tempfile.mkdtemp(prefix="dflash-codecs-"))
    try:
        model = args.model or str(make_tiny_target(work / "target", "qwen3", hidden_size=args.hidden_size))
        data = activations(model, args.tokens, args.device, args.token_budget, args.layers)
        print(
            f"activations: {data.shape[0]} rows x {data.shape[1]} tokens x {data.shape[2]} features "
            f"({data.nbytes / 1e6:.0f} MB bf16) from {model}"
        )
        print(
            f"{'encoding':<12} {'codec (+ crc32c)':<26} {'ratio':>6} {'of bf16':>8} {'write MB/s':>11} {'read MB/s':>10}"
        )
        for encoding in args.encodings.split(","):
            encoded = encode(data, encoding)
            for name, compressors in candidates(encoded.itemsize).items():
                folder = work / name.replace(" ", "_")
                ratio, write, read = measure(encoded, compressors, folder, args.repeat)
                shutil.rmtree(folder)
                of_bf16 = encoded.nbytes / ratio / data.nbytes
                print(f"{encoding:<12} {name:<26} {ratio:>6.3f} {of_bf16:>8.4f} {write:>11.0f} {read:>10.0f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
