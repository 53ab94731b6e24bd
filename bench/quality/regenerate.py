"""The target's answers to the drafter's prompts, within a time budget, on every GPU."""

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from bench.quality.corpus import write_jsonl
from bench.quality.scale import Scale
from bench.quality.workers import gpu_count, in_workers
from dflash.data import jsonl_lines

logger = logging.getLogger("quality")


def regenerate_within(scale: Scale, target: Path, prompts: list[dict], out: Path, device: str, budget: float):
    """`regenerate` on growing prefixes of the prompts (it resumes after the answered ones) until the budget."""
    from dflash.config import RegenerateConfig
    from dflash.regenerate import regenerate

    chunk = out.with_name(out.stem + "_prompts.jsonl")
    start, done, chunks, batch_seconds = time.perf_counter(), 0, 0, 0.0
    while done < len(prompts):
        elapsed = time.perf_counter() - start
        # The first chunk's time includes Triton's autotuning: the estimate for the next chunk starts with the second.
        if chunks >= 2 and elapsed + batch_seconds > budget:
            break
        upto = min(len(prompts), done + scale.regen_batch)
        write_jsonl(chunk, [{"text": p["text"]} for p in prompts[:upto]])
        t0 = time.perf_counter()
        regenerate(
            RegenerateConfig(
                str(target),
                str(chunk),
                str(out),
                max_new_tokens=scale.new_tokens,
                batch_size=scale.regen_batch,
                device=device,
                dtype="float32",
            ),
            progress=False,
        )
        batch_seconds = time.perf_counter() - t0
        done, chunks = upto, chunks + 1
        logger.info("regenerate: %d / %d prompts answered, last chunk %.1f s", done, len(prompts), batch_seconds)


def regenerate_on_all(
    scale: Scale, target: Path, prompts: list[dict], work: Path, device: torch.device, budget: float, log: Path
) -> dict:
    """The prompts dealt out to a worker per GPU (`regen_workers_per_gpu`), each answering its share within the
    budget; their responses concatenated into work/responses.jsonl (the harvest does not care about order)."""
    gpus = gpu_count(device)
    count = max(gpus, 1) * scale.regen_workers_per_gpu
    shares = [work / f"responses_{w}of{count}.jsonl" for w in range(count)]
    jobs = [
        dict(scale=scale, target=target, prompts=prompts[w::count], out=share, device=device.type, budget=budget)
        for w, share in enumerate(shares)
    ]
    in_workers(regenerate_within, jobs, gpus, log)
    out, answered = work / "responses.jsonl", 0
    with out.open("wb") as merged:
        for share in filter(Path.exists, shares):  # (a worker with no prompts writes none)
            responses = share.read_bytes()
            merged.write(responses)
            answered += sum(1 for _ in jsonl_lines(responses))
    return {"prompts": len(prompts), "answered": answered, "workers": count, "file": str(out)}


def response_stats(tokenizer, responses: Path) -> dict:
    """Response count and lengths, and distinct 4-grams (a looping target scores low)."""
    lines = jsonl_lines(responses.read_bytes())
    texts = [json.loads(line)["completion"] for _, line in lines]
    lengths, distinct = [], []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        lengths.append(len(ids))
        grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
        if grams:
            distinct.append(len(set(grams)) / len(grams))
    return {
        "responses": len(lengths),
        "response_tokens": int(sum(lengths)),
        "mean_response_tokens": float(np.mean(lengths)) if lengths else 0.0,
        "distinct_4gram_ratio": float(np.mean(distinct)) if distinct else 0.0,
        "sample_response": texts[0][:600] if texts else "",
    }
