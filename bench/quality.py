"""The quality run of issue 4: does dflash train a drafter that works, on real text nobody here wrote?

The text is this machine's Python standard library, split by a hash of each file's path into the target's
training files (70 %), the drafter's prompt files (20 %) and the eval's held-out files (10 %). Stages, through the
library entry points the CLI uses (details, sizes and measured runs: docs/benchmarks.md, "Quality run"):
  data        split the files, train a byte-level BPE tokenizer on the train files, tokenise;
  target      a small Qwen3.5 hybrid trained from scratch for a fixed time: a fixture whose answers are the data;
  regenerate  the target answers prompts from the drafter files, and 256 from the eval files (the held-out store);
  harvest     both, with the loss on the responses only;
  drafter     `dflash.train_run.run_training` (5 layers, B = 16), validated on the held-out store;
  modes       only with --modes (issue 16): per store mode, both harvests in that encoding and the same drafter
              trained on them, `mode_workers` modes at a time in worker processes sharing the GPUs;
  eval        one prompt per held-out file, temperature 0: plain greedy, the trained drafter(s), prompt lookup and
              (on the first 6) the untrained drafter, every output compared token for token with greedy.
Bar: tau(trained) >= 1.5 x tau(prompt lookup) and >= 2 x tau(untrained), 0 mismatches. With --modes, a second
table gives per mode the bytes per token on disk and the drafter's tau with its paired difference to the bf16
drafter's over the same prompts (95 % bootstrap intervals), against issue 16's bar: within 2 %, 0 mismatches.

    .venv/bin/python bench/quality.py --tiny --out /tmp/quality-tiny/quality.json   # toy sizes, CPU, ~3 minutes
    source bench/device_setup.sh && python3 bench/quality.py --work /tmp/q --stop-after harvest --out $OUT/q1.json
    source bench/device_setup.sh && python3 bench/quality.py --work /tmp/q --out $OUT/quality.json
    ... the same, plus --modes fp8,sub1/2,sub1/4,sub1/8,sub1/4+fp8   # the store modes' table (issue 16)

Finished stages are kept in --work and skipped by a later call with the same sizes and seed, and the eval saves
its reports there after every prompt, so a run spans several calls: repeat the last command until the bar is no
longer PARTIAL. --stop-after STAGE ends a call early; --set FIELD=VALUE overrides a `Scale` field; budgets and
worker counts (Run.CALL_FIELDS) may change between calls, other differences are refused unless --restart. --out
gets the JSON (rewritten after every stage) and a .log beside it; a markdown table is printed last.
"""

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import random
import re
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# fp32 dots in Triton kernels (fla's, at the fp32 eval) in IEEE rather than TF32: plain greedy decoding (one
# token per forward, fla's recurrent kernel) and the verify forwards (chunk kernel) then differ by fp32 rounding
# only, so a mismatch can only come from a true near-tie (its logit margin is reported) or a bug. fla still uses
# TF32 in one explicitly marked triangular solve of its chunk kernel.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.variants import METHOD_VARIANTS, split_variant  # noqa: E402
from dflash.data import jsonl_lines  # noqa: E402
from dflash.errors import describe_differences  # noqa: E402
from dflash.evaluate import tau_interval, tau_ratio_interval  # noqa: E402
from dflash.tiny import build_tokenizer  # noqa: E402

logger = logging.getLogger("quality")


@dataclass(frozen=True)
class Scale:
    name: str
    # data
    heldout_percent: int = 10
    # Files for the regeneration prompts: unseen by the target, like the eval's, so that the drafter learns how the
    # target continues code it has not memorised (answers to its own training files are recitation).
    drafter_percent: int = 20
    max_file_bytes: int = 400_000
    corpus_chars: int | None = None  # cap on the train text used to train the target (None: all of it)
    tokenizer_chars: int = 8_000_000  # train text the BPE trainer sees
    vocab_size: int = 8192
    # target (Qwen3.5 hybrid: full attention every 4th layer)
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 1408
    linear_value_heads: int = 8
    linear_key_heads: int = 4
    linear_head_dim: int = 64
    seq_len: int = 512  # an eval sequence is a ~120-token prompt + 256 new tokens
    batch: int = 64
    lr: float = 2e-3
    target_seconds: float = 100.0  # steady training time (after the first, autotuning steps)
    # prompts and responses
    prompt_chars: int = 400  # a prompt is whole lines of code, at least this many characters
    train_prompts: int = 24576  # as many as regen_seconds allow: 512 take 4-6 s once fla's kernels are compiled
    new_tokens: int = 256  # response length of regenerate and of the eval
    regen_batch: int = 512
    regen_workers_per_gpu: int = 1  # batches of 512 keep a GPU busy
    regen_seconds: float = 240.0  # with the harvest of twice the answers (about 150 s), call 1 stays near 520 s
    # harvest and drafter
    token_budget: int = 4096
    rows_per_step: int = 2
    drafter_epochs: int = 30
    drafter_max_steps: int = 8000
    harvest_workers: int = 4
    drafter_seconds: float = 240.0  # only printed: compile + capture + steps (no hard stop inside the trainer)
    # store modes (--modes): this many modes harvested at a time, one worker process each, sharing the GPUs (mode
    # i on GPU i % GPUs); then this many drafters trained at a time (one alone: its step time and data wait are
    # its own, not those of a GPU and CPU shared with other drafters)
    mode_workers: int = 3
    mode_train_workers: int = 1
    # eval
    eval_prompts: int = 64
    # The drafter's held-out curve: answers to windows of the eval's files (unseen by target and drafter).
    # Held-out rows of its own store would continue prompts cut from its training files.
    val_prompts: int = 256
    min_eval_prompts: int = 6
    baseline_prompts: int = 6  # the untrained drafter's prompts: the first of the eval's
    eval_seconds: float = 360.0
    # One prompt at a time is bound by the host (about 100 tokens/s, a few ms of launches per token): two eval
    # processes share a GPU. Tokens/s are then those of a shared GPU; tau and the greedy check do not change.
    eval_workers_per_gpu: int = 2
    prompt_lookup_tokens: int = 10
    # whole run: the eval budget shrinks to what is left of this (a call is cut at 600 s)
    total_seconds: float = 530.0


GPU = Scale("gpu")
TINY = Scale(
    "tiny",
    corpus_chars=3_000_000,
    tokenizer_chars=1_500_000,
    vocab_size=1024,
    hidden=64,
    layers=8,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=128,
    linear_value_heads=4,
    linear_key_heads=2,
    linear_head_dim=16,
    seq_len=256,
    batch=8,
    lr=3e-3,
    target_seconds=45.0,
    prompt_chars=200,
    train_prompts=256,
    new_tokens=48,
    regen_batch=64,
    regen_seconds=30.0,
    token_budget=512,
    rows_per_step=1,
    drafter_epochs=8,
    drafter_max_steps=300,
    harvest_workers=1,
    drafter_seconds=100.0,
    mode_workers=1,
    eval_prompts=12,
    val_prompts=32,
    min_eval_prompts=4,
    baseline_prompts=4,
    eval_seconds=25.0,
    total_seconds=270.0,
)


# ---------------------------------------------------------------------------------------------------- stages


class WorkFolderInUse(Exception):
    pass


class Run:
    """Stage timing against budgets, and the JSON results written after every stage.

    A finished stage's result is also kept as `WORK/stages/NAME.json`, written last (tmp + rename), so that a
    later call with the same --work, sizes and seed skips it: the run can be split over several device calls
    on one machine (--stop-after).
    """

    RESUMABLE = {
        "target": ["target"],
        "regenerate": ["responses*.jsonl"],
        "harvest": ["shards", "shards_val"],
        "drafter": ["run", "eval_*.json"],
    }
    # How long a call may take and how its work is spread over processes: no finished stage's result depends on
    # them, so a later call on the same --work may change them (a longer eval budget, say) and keep its stages.
    CALL_FIELDS = frozenset(
        {
            "total_seconds",
            "eval_seconds",
            "drafter_seconds",
            "min_eval_prompts",
            "regen_workers_per_gpu",
            "eval_workers_per_gpu",
            "mode_workers",
            "mode_train_workers",
        }
    )

    def __init__(self, out: Path, scale: Scale, work: Path, seed: int, restart: bool = False):
        self.out, self.scale = out, scale
        self.start = time.perf_counter()
        self.results: dict = {"scale": asdict(scale), "stages": {}}
        self.stages = work / "stages"
        identity = {"seed": seed, **{k: v for k, v in asdict(scale).items() if k not in self.CALL_FIELDS}}
        self._forget_other_runs(work, identity, restart)

    def _forget_other_runs(self, work: Path, identity: dict, restart: bool):
        """Keep the finished stages of an earlier call with the same sizes and seed; drop every other output.

        An earlier run of other sizes or seed is only deleted when asked (`restart`): its stages may have cost a
        whole device call."""
        marker = self.stages / "identity.json"
        if marker.exists() and (earlier := json.loads(marker.read_text())) != identity:
            differences = describe_differences(earlier, identity, "the run in --work", "this call")
            if not restart:
                raise WorkFolderInUse(
                    f"{work} holds a run of other sizes or seed ({differences}): give the same --set values and "
                    "--seed to go on with it, another --work, or --restart to delete it and start over"
                )
            logger.warning("work folder %s holds a run of other sizes or seed (%s): starting over", work, differences)
            shutil.rmtree(self.stages)
        self.stages.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps(identity))
        for name, outputs in self.RESUMABLE.items():
            if not (self.stages / f"{name}.json").exists():
                for path in (path for pattern in outputs for path in work.glob(pattern)):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        for path in (work / MODES).glob("*"):  # a store mode (--modes) is kept once its stores are saved
            if not mode_harvested(self.stages, path.name).exists():
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.scale.total_seconds - self.elapsed()

    def stage(self, name: str, budget: float | None, fn):
        done = self.stages / f"{name}.json"
        if name in self.RESUMABLE and done.exists():
            saved = json.loads(done.read_text())
            self.results["stages"][name] = {**saved["timing"], "resumed": True}
            logger.info("-- %s: finished by an earlier call (%s), skipped", name, done)
            return saved["result"]
        logger.info(
            "== %s: budget %s (run at %.0f s of %.0f s)",
            name,
            f"{budget:.0f} s" if budget else "-",
            self.elapsed(),
            self.scale.total_seconds,
        )
        t0 = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - t0
        self.results["stages"][name] = {"budget_s": budget, "seconds": round(seconds, 2)}
        over = f" (OVER budget by {seconds - budget:.0f} s)" if budget and seconds > budget * 1.1 else ""
        logger.info("-- %s done in %.1f s%s", name, seconds, over)
        if name in self.RESUMABLE:
            tmp = done.with_suffix(".tmp")
            tmp.write_text(json.dumps({"timing": self.results["stages"][name], "result": result}, default=str))
            tmp.rename(done)
        self.save()
        return result

    def save(self):
        self.results["elapsed_s"] = round(self.elapsed(), 2)
        self.out.write_text(json.dumps(self.results, indent=1, default=str))


# ------------------------------------------------------------------------------------------------------ data


def stdlib_files(scale: Scale) -> tuple[dict[str, str], dict[str, str], dict[str, str], dict]:
    """(train, drafter, held-out) {relative path: source}, split by a hash of the path; and counts."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, drafter, heldout = {}, {}, {}
    skipped = {"site_packages": 0, "too_big": 0, "not_utf8": 0, "empty": 0}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if {"site-packages", "dist-packages"} & set(rel.split("/")):
            skipped["site_packages"] += 1
            continue
        if not path.is_file() or path.stat().st_size > scale.max_file_bytes:
            skipped["too_big"] += 1
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            skipped["not_utf8"] += 1
            continue
        if not text.strip():
            skipped["empty"] += 1
            continue
        bucket = int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100
        if bucket < scale.heldout_percent:
            heldout[rel] = text
        elif bucket < scale.heldout_percent + scale.drafter_percent:
            drafter[rel] = text
        else:
            train[rel] = text
    counts = {"stdlib": str(root)}
    for name, files in (("train", train), ("drafter", drafter), ("heldout", heldout)):
        counts.update({f"{name}_files": len(files), f"{name}_chars": sum(map(len, files.values()))})
    counts["skipped"] = skipped
    return train, drafter, heldout, counts


def capped(texts: list[str], chars: int | None, seed: int) -> list[str]:
    """A random subset of whole files holding about `chars` characters (all of them when None)."""
    if chars is None:
        return texts
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    kept, total = [], 0
    for i in order:
        if total >= chars:
            break
        kept.append(texts[i])
        total += len(texts[i])
    return kept


def token_stream(tokenizer, texts: list[str]) -> np.ndarray:
    """Every text's tokens followed by EOS, concatenated (int32)."""
    eos = tokenizer.eos_token_id
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return np.fromiter((t for doc in ids for t in (*doc, eos)), dtype=np.int32)


def code_prompt(text: str, chars: int, rng: random.Random) -> str | None:
    """Whole lines of `text` from a random non-blank line, at least `chars` long, without the final newline
    (a prompt ending mid-line-break would split the tokenizer's newline + indentation tokens)."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip()]
    ends = np.cumsum([len(line) for line in lines])
    total = int(ends[-1]) if len(ends) else 0
    starts = [i for i in starts if total - (ends[i] - len(lines[i])) >= chars]
    if not starts:
        return None
    first = rng.choice(starts)
    out, size = [], 0
    for line in lines[first:]:
        out.append(line)
        size += len(line)
        if size >= chars:
            break
    prompt = "".join(out).rstrip("\n")
    return prompt if prompt.strip() else None


def make_prompts(files: dict[str, str], count: int, chars: int, seed: int, one_per_file: bool) -> list[dict]:
    rng = random.Random(seed)
    names = [n for n in sorted(files) if len(files[n]) >= 2 * chars]
    prompts = []
    if one_per_file:
        rng.shuffle(names)
        for name in names:
            if len(prompts) == count:
                break
            prompt = code_prompt(files[name], chars, rng)
            if prompt:
                prompts.append({"text": prompt, "file": name})
        return prompts
    # Distinct prompts: the harvest keeps one copy of identical records, so a repeat would be answered for nothing.
    seen = set()
    for _ in range(100 * count):
        if len(prompts) == count or not names:
            break
        name = rng.choice(names)
        prompt = code_prompt(files[name], chars, rng)
        if prompt and prompt not in seen:
            seen.add(prompt)
            prompts.append({"text": prompt, "file": name})
    return prompts


def slow_compile_phases(min_seconds: float = 1.0) -> dict[str, float]:
    """torch.compile's own timings (summed over this process's compiles) of its phases that took over
    min_seconds: tracing, AOT autograd, inductor's codegen, waiting for Triton's compile workers, ..."""
    from torch._dynamo.utils import compile_times

    phases = {}
    for line in compile_times(repr="str", aggregate=True).splitlines()[2:]:
        name, _, seconds = line.rpartition(", ")
        with contextlib.suppress(ValueError):
            if float(seconds) >= min_seconds:
                phases[name] = round(float(seconds), 1)
    return phases


def write_jsonl(path: Path, records: list[dict]):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


# ---------------------------------------------------------------------------------------------------- target


def target_config(scale: Scale, tokenizer):
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=scale.hidden,
        intermediate_size=scale.intermediate,
        num_hidden_layers=scale.layers,
        num_attention_heads=scale.heads,
        num_key_value_heads=scale.kv_heads,
        head_dim=scale.head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(scale.layers)],
        linear_num_value_heads=scale.linear_value_heads,
        linear_num_key_heads=scale.linear_key_heads,
        linear_key_head_dim=scale.linear_head_dim,
        linear_value_head_dim=scale.linear_head_dim,
        linear_conv_kernel_dim=4,
    )
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    return config


def windows(tokens: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - length - 1, (batch, 1), generator=generator, device="cpu")
    index = (starts + torch.arange(length + 1)).to(tokens.device)
    return tokens[index].long()


@contextlib.contextmanager
def reference_gated_delta_rule():
    """Train the fixture's Gated-DeltaNet layers on transformers' plain PyTorch code.

    fla 0.6's chunk backward refuses Triton 3.4 - 3.7.0 on Hopper (it computes wrong gradients there, fla issue
    #640), and the H200 has Triton 3.6. Only training needs the backward: every later stage (regenerate, harvest,
    eval) runs forward-only on fla's kernels again.
    """
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    from dflash.kernels import GATED_DELTA_RULE

    fast = getattr(modeling, GATED_DELTA_RULE)
    setattr(modeling, GATED_DELTA_RULE, getattr(fast, "__wrapped__", fast))
    try:
        yield
    finally:
        setattr(modeling, GATED_DELTA_RULE, fast)


@reference_gated_delta_rule()
def train_target(
    scale: Scale,
    tokenizer,
    train_ids: np.ndarray,
    heldout_ids: np.ndarray,
    folder: Path,
    device: torch.device,
    sample_prompt: str,
    seed: int,
) -> dict:
    """Plain language modelling from scratch for `scale.target_seconds` of steady steps; save_pretrained."""
    from transformers import AutoModelForCausalLM

    cuda = device.type == "cuda"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(target_config(scale, tokenizer), dtype=torch.float32).to(device)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel() + model.get_output_embeddings().weight.numel()
    logger.info(
        "target: %.1f M parameters (%.1f M without embedding / LM head), %d train tokens, %d held-out",
        params / 1e6,
        (params - embed) / 1e6,
        train_ids.size,
        heldout_ids.size,
    )
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=scale.lr,
        betas=(0.9, 0.95),
        fused=cuda,
    )
    train = torch.from_numpy(train_ids).to(device)
    heldout = torch.from_numpy(heldout_ids).to(device)
    generator = torch.Generator().manual_seed(seed)

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

    def schedule(fraction: float) -> float:
        warm = 0.03
        if fraction < warm:
            return scale.lr * max(fraction / warm, 0.02)
        progress = min(1.0, (fraction - warm) / (1 - warm))
        return scale.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def step(lr: float) -> torch.Tensor:
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = loss_of(windows(train, scale.batch, scale.seq_len, generator))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.detach()

    # The first steps pay for Triton autotuning (fla) and allocations: outside the steady time budget.
    t0 = time.perf_counter()
    step(scale.lr * 0.02)
    step(scale.lr * 0.02)
    _sync(device)
    warmup_s = time.perf_counter() - t0
    logger.info("target: first 2 steps (autotuning, allocation) %.1f s", warmup_s)

    steps, losses, start = 0, [], time.perf_counter()
    log_every = 50 if cuda else 10
    while True:
        elapsed = time.perf_counter() - start
        if elapsed >= scale.target_seconds:
            break
        loss = step(schedule(elapsed / scale.target_seconds))
        steps += 1
        if steps % 10 == 0:
            losses.append(float(loss))  # one host sync per 10 steps
        if steps % log_every == 0:
            logger.info(
                "target step %d: loss %.3f, %.0f s, %.0f tokens/s",
                steps,
                losses[-1],
                elapsed,
                steps * scale.batch * scale.seq_len / max(elapsed, 1e-9),
            )
    _sync(device)
    seconds = time.perf_counter() - start

    model.eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        heldout_loss = float(
            torch.stack([loss_of(windows(heldout, scale.batch, scale.seq_len, g)) for _ in range(8)]).mean()
        )
        g = torch.Generator().manual_seed(seed + 1)
        train_loss = float(
            torch.stack([loss_of(windows(train, scale.batch, scale.seq_len, g)) for _ in range(8)]).mean()
        )
        ids = torch.tensor([tokenizer(sample_prompt)["input_ids"]], device=device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=min(96, scale.new_tokens),
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        sample = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=False)
    logger.info(
        "target: %d steps in %.0f s; train loss %.3f, held-out loss %.3f (nats/token)",
        steps,
        seconds,
        train_loss,
        heldout_loss,
    )
    logger.info("target sample (held-out prompt, greedy):\n%s\n>>>>>>>>\n%s\n<<<<<<<<", sample_prompt[-300:], sample)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model = optimizer = train = heldout = None  # (the closures above hold them too)
    if cuda:
        torch.cuda.empty_cache()
    return {
        "parameters": params,
        "non_embedding_parameters": params - embed,
        "config": {
            k: getattr(scale, k)
            for k in (
                "hidden",
                "layers",
                "heads",
                "kv_heads",
                "head_dim",
                "intermediate",
                "linear_value_heads",
                "linear_key_heads",
                "linear_head_dim",
            )
        },
        "vocab_size": len(tokenizer),
        "autocast_bf16": cuda,
        "gated_delta_rule": "torch-reference (training only; see reference_gated_delta_rule)",
        "warmup_s": round(warmup_s, 2),
        "steps": steps,
        "tokens_seen": steps * scale.batch * scale.seq_len,
        "train_tokens": int(train_ids.size),
        "epochs": steps * scale.batch * scale.seq_len / max(train_ids.size, 1),
        "tokens_per_s": steps * scale.batch * scale.seq_len / max(seconds, 1e-9),
        "loss_curve_every_10_steps": [round(x, 4) for x in losses],
        "train_loss": train_loss,
        "heldout_loss": heldout_loss,
        "sample_prompt": sample_prompt,
        "sample_continuation": sample,
    }


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------- harvest and drafter


def harvest_store(
    scale: Scale,
    target: Path,
    data: str,
    out: Path,
    device,
    mode: "StoreMode | None" = None,
    projection_from: Path | None = None,
) -> Path:
    """`run_harvest` of the responses in `data` into the store `out`, in `mode` (default: bf16, full width)."""
    from dflash.config import HarvestConfig
    from dflash.harvest import run_harvest

    mode = mode or BF16
    return run_harvest(
        HarvestConfig(
            model=str(target),
            data=str(data),
            out=str(out),
            token_budget=scale.token_budget,
            workers=scale.harvest_workers,
            device=str(device),
            dtype="float32",
            precision=mode.precision,
            subspace=mode.subspace,
            teacher=mode.teacher or "none",
            projection_from=str(projection_from) if projection_from else None,
        )
    )


def drafter_steps(scale: Scale, rows: int) -> int:
    return min(scale.drafter_epochs * (rows // scale.rows_per_step), scale.drafter_max_steps)


def train_drafter(
    scale: Scale, store: str, val_store: str, out: Path, steps: int, device, seed: int, overrides: dict | None = None
) -> dict:
    """`run_training` of the quality run's drafter (5 layers, B = 16, DFlash unless `overrides` say otherwise) on
    `store`, validated on `val_store` 8 times over the run; its final numbers, held-out curve and metric records."""
    overrides = {"method": "dflash", **(overrides or {})}
    from dflash.config import TrainConfig
    from dflash.train_run import run_training

    cuda = str(device).startswith("cuda")
    result = run_training(
        TrainConfig(
            **{k: v for k, v in overrides.items() if k != "block_size"},
            store=str(store),
            out=str(out),
            draft_layers=5,
            block_size=overrides.get("block_size", 16),
            rows_per_step=scale.rows_per_step,
            max_steps=max(steps, 1),
            val_store=str(val_store),
            log_every=50 if cuda else 10,
            ckpt_every=10**9,
            device=str(device),
            tensorboard=False,
            seed=seed,
            val_every=max(1, steps // 8),  # a held-out curve: where overfitting starts
        )
    )
    last, val = result["records"][-1], result.get("val") or {}
    metrics = (out / "metrics.jsonl").read_text().splitlines()
    val_curve = [
        (r["step"], round(r["loss"], 4), round(r["accept_len"], 3), round(r["tau"], 3))
        for r in map(json.loads, metrics)
        if r.get("kind") == "val"
    ]
    logger.info("drafter held-out curve (step, loss, accept length, tau of decoding replayed): %s", val_curve)
    compile_phases = slow_compile_phases()
    logger.info("drafter compile, the phases over 1 s: %s", compile_phases)
    return {
        "export": result["export"],
        "steps": last["step"],
        "train_loss": round(last["loss"], 4),
        "train_accept_len": round(last["accept_len"], 3),
        "val_loss": round(val["loss"], 4) if val else None,
        "val_accept_len": round(val["accept_len"], 3) if val else None,
        "val_tau": round(val["tau"], 3) if val else None,
        "step_ms": round(last["step_ms"], 2),
        "prepare_s": {k: round(v, 1) for k, v in result["prepare_s"].items()},
        "compile_phases_s": compile_phases,
        "val_curve": val_curve,
        "records": result["records"],
    }


# ----------------------------------------------------------------------------------------------- store modes

MODES = "modes"  # WORK/modes/FOLDER: a store mode's stores and drafter run


@dataclass(frozen=True)
class StoreMode:
    """A variant of the drafter run, as `--modes` names it: a feature encoding of the store (issue 16) with its
    harvest options, or a drafter method on the bf16 store (issue 23) with its training options."""

    name: str
    precision: str = "bf16"
    subspace: str = "none"  # HarvestConfig.subspace: K or a fraction of the feature width ("1/4")
    train: tuple = ()  # TrainConfig overrides, (field, value) pairs
    teacher: str | None = None  # HarvestConfig.teacher of the method's stores (DSpark)

    def __post_init__(self):  # read back from JSON: lists of lists
        object.__setattr__(self, "train", tuple(tuple(pair) for pair in self.train))

    def __hash__(self):  # not of `train`, whose values may be dicts (drafter_overrides)
        return hash((self.name, self.precision, self.subspace, self.teacher))

    @property
    def on_bf16_store(self) -> bool:
        """A method variant trains on the bf16 run's own stores: nothing to harvest."""
        return (self.precision, self.subspace, self.teacher) == ("bf16", "none", None)

    @property
    def folder(self) -> str:
        return self.name.replace("/", "_")

    @property
    def method(self) -> str:
        """Its drafter's name in the eval report (bf16's keeps the name the bar reads)."""
        return "dflash" if self == BF16 else f"dflash[{self.name}]"


BF16 = StoreMode("bf16")


def parse_modes(text: str) -> list[StoreMode]:
    """`--modes`: store modes besides bf16, comma-separated: `fp8` (e4m3 values), `subK` or `subA/B` (the top K
    directions, or A/B of the feature width), each subspace optionally `+fp8`."""
    modes = []
    for name in (part.strip() for part in text.split(",")):
        if not name:
            continue
        if name in METHOD_VARIANTS and name != "dflash":  # the bf16 run itself is DFlash's (train_drafter)
            options, teacher = split_variant(name)
            mode = StoreMode(name, train=tuple(options.items()), teacher=teacher)
            if mode in modes:
                raise ValueError(f"--modes: {name} is given twice")
            modes.append(mode)
            continue
        match = re.fullmatch(r"fp8|sub(\d+)(?:/(\d+))?(\+fp8)?", name)
        numerator, denominator = (int(match[1]), int(match[2] or 0)) if match and match[1] else (1, 1)
        if not match or numerator < 1 or (match[2] is not None and not numerator <= denominator):
            raise ValueError(
                f"--modes: {name!r} is not a store mode; give fp8, subK or subA/B (the top K directions, or A/B <= 1 "
                "of the feature width), a subspace optionally +fp8, e.g. fp8,sub1/4,sub1/4+fp8 (bf16 is always run), "
                f"or a drafter method: {', '.join(METHOD_VARIANTS)}"
            )
        if name == "fp8":
            mode = StoreMode(name, "fp8")
        else:
            width = f"{numerator}/{denominator}" if match[2] else str(numerator)
            mode = StoreMode(name, "fp8" if match[3] else "bf16", width)
        if mode in modes:
            raise ValueError(f"--modes: {name} is given twice")
        modes.append(mode)
    return modes


def mode_done(stages: Path, folder: str) -> Path:
    """The saved result of a store mode: written last, so its presence means the mode is finished."""
    return stages / f"mode_{folder}.json"


def mode_harvested(stages: Path, folder: str) -> Path:
    """The saved stores of a store mode, written once both are harvested: its drafter may still be untrained."""
    return stages / f"mode_{folder}.stores.json"


def store_stats(path) -> dict:
    """Bytes on disk of a store (all of it, and its features alone: hidden, scales, projection), per token and
    against raw bf16 features (tokens x feature_dim x 2 bytes); its encoding and the calibration's captured share."""
    from dflash.store import Store, disk_bytes

    path = Path(path)
    manifest = Store.open(path).manifest
    f, tokens = manifest.features, manifest.counts.tokens
    features = [*path.glob("parts/*/hidden"), *path.glob("parts/*/scales"), path / "projection"]
    total, feature_bytes = disk_bytes(path), sum(disk_bytes(p) for p in features if p.exists())
    teacher_bytes = sum(disk_bytes(p) for p in path.glob("parts/*/teacher_*"))
    raw = tokens * manifest.feature_dim * 2
    return {
        "path": str(path),
        "bytes": total,
        "feature_bytes": feature_bytes,
        "teacher": manifest.teacher.name if manifest.teacher else None,
        "teacher_bytes_per_token": teacher_bytes / max(tokens, 1),
        "tokens": tokens,
        "rows": manifest.counts.rows,
        "feature_dim": manifest.feature_dim,
        "precision": f.precision,
        "width": f.width,
        "scale_groups": f.scale_groups,
        "captured": f.subspace.captured if f.subspace else None,
        "bytes_per_token": total / max(tokens, 1),
        "raw_bf16_ratio": total / max(raw, 1),
        "feature_ratio": feature_bytes / max(raw, 1),
    }


def data_wait_share(records: list[dict]) -> float | None:
    """The share of the training loop's time spent waiting for rows, over the whole run: each train record's
    `data_wait` (a share of its interval) weighted by the interval's time."""
    train, weights, last = [r for r in records if r.get("kind", "train") == "train"], [], 0
    for r in train:
        weights.append(r["step_ms"] * (r["step"] - last))
        last = r["step"]
    total = sum(weights)
    return sum(r["data_wait"] * w for r, w in zip(train, weights)) / total if total else None


def harvest_mode(
    mode: StoreMode, scale: Scale, target: str, data: str, val_data: str, folder: str, device: str, done: str
):
    """A store mode's harvests, in a worker: the drafter's responses and the held-out ones in the mode (the held-out
    store with the training store's projection); their sizes saved."""
    from dflash.store import write_json_atomic

    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)  # an unfinished earlier attempt
    t0 = time.perf_counter()
    shards = harvest_store(scale, target, data, folder / "shards", device, mode)
    projection = shards if mode.subspace != "none" else None
    val_shards = harvest_store(scale, target, val_data, folder / "shards_val", device, mode, projection_from=projection)
    result = {
        "mode": asdict(mode),
        "store": store_stats(shards),
        "val_store": store_stats(val_shards),
        "harvest_s": round(time.perf_counter() - t0, 1),
    }
    logger.info("mode %s: store %s", mode.name, result["store"])
    write_json_atomic(Path(done), result)


def train_mode(scale: Scale, folder: str, steps: int, device: str, seed: int, harvested: str, done: str):
    """A store mode's drafter, in a worker, trained as the bf16 one on the mode's stores; the mode's result saved."""
    from dflash.store import write_json_atomic

    result = json.loads(Path(harvested).read_text())
    folder = Path(folder)
    shutil.rmtree(folder / "run", ignore_errors=True)
    t0 = time.perf_counter()
    mode = StoreMode(**result["mode"])
    result["drafter"] = train_drafter(
        scale,
        result["store"]["path"],
        result["val_store"]["path"],
        folder / "run",
        steps,
        device,
        seed,
        dict(mode.train),
    )
    result["drafter_s"] = round(time.perf_counter() - t0, 1)
    write_json_atomic(Path(done), result)


def run_modes(
    scale: Scale,
    modes: list[StoreMode],
    target: Path,
    results: dict,
    work: Path,
    stages: Path,
    device: torch.device,
    seed: int,
    log: Path,
) -> dict:
    """Every store mode not finished by an earlier call (mode i on GPU i % GPUs), with the bf16 harvest's responses
    and its drafter's steps: first the harvests, `scale.mode_workers` at a time in worker processes, then the
    drafters, `scale.mode_train_workers` at a time (one alone measures its step and data wait undisturbed); then
    the saved results of all, bf16's (the harvest and drafter stages) first."""
    steps = drafter_steps(scale, results["harvest"]["rows"])
    todo = [m for m in modes if not mode_done(stages, m.folder).exists()]
    unharvested = [m for m in todo if not mode_harvested(stages, m.folder).exists()]
    if todo:
        logger.info(
            "modes: %s to train, of which %s to harvest (%s done by an earlier call); harvests %d at a time, "
            "drafters %d at a time, %d steps each",
            ", ".join(m.name for m in todo),
            ", ".join(m.name for m in unharvested) or "none",
            ", ".join(m.name for m in modes if m not in todo) or "none",
            scale.mode_workers,
            scale.mode_train_workers,
            steps,
        )
    gpus, common = gpu_count(device), dict(scale=scale, device=device.type)
    paths = {
        m: dict(folder=str(work / MODES / m.folder), harvested=str(mode_harvested(stages, m.folder))) for m in modes
    }
    from dflash.store import write_json_atomic

    bf16_stores = None
    for m in [m for m in unharvested if m.on_bf16_store]:  # a method variant: the bf16 run's stores
        bf16_stores = bf16_stores or {
            "store": store_stats(results["harvest"]["path"]),
            "val_store": store_stats(results["harvest"]["val_path"]),
        }
        write_json_atomic(Path(paths[m]["harvested"]), {"mode": asdict(m), **bf16_stores, "harvest_s": 0.0})
    unharvested = [m for m in unharvested if not m.on_bf16_store]
    in_workers(
        harvest_mode,
        [
            dict(
                mode=m,
                target=str(target),
                data=results["regenerate"]["file"],
                val_data=results["regenerate"]["val_file"],
                folder=paths[m]["folder"],
                done=paths[m]["harvested"],
                **common,
            )
            for m in unharvested
        ],
        gpus,
        log,
        at_once=max(scale.mode_workers, 1),
        names=[f"mode {m.name} harvest" for m in unharvested],
    )
    in_workers(
        train_mode,
        [dict(steps=steps, seed=seed, done=str(mode_done(stages, m.folder)), **paths[m], **common) for m in todo],
        gpus,
        log,
        at_once=max(scale.mode_train_workers, 1),
        names=[f"mode {m.name} drafter" for m in todo],
    )
    out = {
        BF16.name: {
            "mode": asdict(BF16),
            "store": store_stats(results["harvest"]["path"]),
            "val_store": store_stats(results["harvest"]["val_path"]),
            "drafter": results["drafter"],
        }
    }
    for m in modes:
        out[m.name] = json.loads(mode_done(stages, m.folder).read_text())
        if out[m.name]["store"]["rows"] != out[BF16.name]["store"]["rows"]:
            logger.warning(
                "mode %s: %d rows, bf16 %d: the stores should hold the same rows",
                m.name,
                out[m.name]["store"]["rows"],
                out[BF16.name]["store"]["rows"],
            )
    return out


# --------------------------------------------------------------------------------------------------- workers


def gpu_count(device: torch.device) -> int:
    return torch.cuda.device_count() if device.type == "cuda" else 0


def in_workers(fn, jobs: list[dict], gpus: int, log: Path, at_once: int | None = None, names: list[str] | None = None):
    """fn(**job) in a spawned process per job, job i on GPU i % gpus (the CPU when gpus is 0), at most `at_once`
    of them running at a time (default: all); fails if one fails, after all have ended.

    Each worker sees one GPU (CUDA_VISIBLE_DEVICES, inherited at spawn), so its reports name the device cuda:0
    like the parent's, and logs to the run's log file, its lines prefixed with its name (default "worker i/N").
    """
    context = multiprocessing.get_context("spawn")
    workers, environment = [], dict(os.environ)
    names = names or [f"worker {i}/{len(jobs)}" for i in range(len(jobs))]
    for i, job in enumerate(jobs):
        while at_once and sum(w.exitcode is None for w in workers) >= at_once:
            multiprocessing.connection.wait([w.sentinel for w in workers if w.exitcode is None])
        try:
            if gpus:
                os.environ["CUDA_VISIBLE_DEVICES"] = str(i % gpus)
            workers.append(context.Process(target=_worker, args=(fn, job, str(log), names[i])))
            workers[-1].start()
        finally:
            os.environ.clear()
            os.environ.update(environment)
    for worker in workers:
        worker.join()
    failed = {i: w.exitcode for i, w in enumerate(workers) if w.exitcode != 0}
    if failed:
        raise RuntimeError(f"workers {failed} (index: exit code) failed; their errors are in {log}")


def _worker(fn, job: dict, log: str, name: str):
    from transformers.utils import logging as hf_logging

    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {name} %(name)s %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout), logging.FileHandler(log, mode="a")],
    )
    hf_logging.set_verbosity_error()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # several workers share a small CPU
    try:
        fn(**job)
    except BaseException:
        logger.exception("%s failed", name)
        raise


# ------------------------------------------------------------------------------------------------ regenerate


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


# ------------------------------------------------------------------------------------------------------ eval


def evaluate_all(
    scale: Scale,
    target_path: Path,
    drafter_path: Path,
    prompts: list[dict],
    device: torch.device,
    budget: float,
    seed: int,
    work: Path,
    log: Path,
    modes: dict[str, str] | None = None,
    temperature: float = 0.0,
):
    """The trained drafter and prompt lookup in one `dflash.evaluate.evaluate` run (one plain greedy decoding
    per prompt is the reference of both: tokens/s and the mismatch check), with the drafters of the store modes
    (`modes`: report name -> drafter folder) in the same run when given, after the untrained drafter on the first
    `scale.baseline_prompts` prompts. The untrained drafter's tau is 1 by construction and it pays a verify
    forward per token: run on every prompt, it took 38 % of the eval. Its speedup is against the plain decoding of
    its own run.

    The prompts are dealt out to `eval_workers_per_gpu` workers per GPU (prompt i to worker i % W), each going
    through its share in order until `budget` is spent. Each worker saves its reports in `work` after every
    prompt and a later call goes on from them (`evaluate`'s resume), so that every held-out prompt is evaluated
    however many calls that takes. The shares are then merged into one report in prompt order. Returns the
    report and whether it covers every prompt. At a temperature above 0: the drafters alone (bf16's and the
    modes'), sampled with `seed`, verified losslessly, in a report of their own."""
    records = [{"prompt": p["text"]} for p in prompts]
    gpus = gpu_count(device)
    count = max(gpus, 1) * scale.eval_workers_per_gpu
    settings = dict(
        model=str(target_path),
        device=device.type,
        dtype="float32",
        temperature=temperature,
        seed=seed,
        max_new_tokens=scale.new_tokens,
        min_prompts=scale.min_eval_prompts,
    )
    main = "eval_main"
    drafters = str(drafter_path)
    if modes:  # another report: the one without modes (an earlier call's) has other methods
        drafters = {BF16.method: str(drafter_path), **modes}
        main = "eval_modes_" + hashlib.sha256(json.dumps(drafters).encode()).hexdigest()[:10]
    runs = {  # report name: the drafter(s), the prompts, prompt lookup's draft length
        "eval_baseline": ("untrained", records[: scale.baseline_prompts], 0),
        main: (drafters, records, scale.prompt_lookup_tokens),
    }
    if temperature > 0:
        runs = {f"{main}_T{temperature:g}": (drafters, records, 0)}
    jobs = [dict(runs=runs, share=(w, count), work=work, budget=budget, **settings) for w in range(count)]
    in_workers(evaluate_share, jobs, gpus, log)
    if temperature > 0:
        ((name, run),) = runs.items()
        report = merge_shares(name, *run, count, work, settings)
        return report, len(report.prompts) == len(records)
    baseline, report = (merge_shares(name, *run, count, work, settings) for name, run in runs.items())
    report.methods.update(baseline.methods)
    report.drafter = f"{report.drafter}, {baseline.drafter}"
    for row, baseline_row in zip(report.prompts, baseline.prompts):
        row["runs"].update(baseline_row["runs"])
    for row in report.prompts:
        row["file"] = prompts[row["index"]]["file"]
    return report, len(report.prompts) == len(records)


def share_path(work: Path, name: str, share: tuple[int, int]) -> Path:
    # "share": its rows carry the prompts' own indices (`evaluate(share=...)`); the files of earlier versions,
    # numbered within the share, are not read.
    return work / f"{name}_share{share[0]}of{share[1]}.json"


def named_drafters(drafters: str | dict[str, str]) -> list[str] | dict[str, str]:
    """`evaluate`'s drafters for a run's drafter: one folder (or "untrained"), or {method name: folder} for the
    drafters of the store modes, evaluated on the same prompts as the bf16 one."""
    return [drafters] if isinstance(drafters, str) else drafters


def evaluate_share(runs: dict, share: tuple[int, int], work: Path, budget: float | None, **settings):
    """One worker's share of each run: prompts share[0], share[0] + share[1], ... (`evaluate`'s share); its
    reports saved in `work` after every prompt and resumed from there. The budget counts from the worker's start."""
    from dflash.config import EvalConfig
    from dflash.evaluate import evaluate
    from dflash.store import write_json_atomic

    start = time.perf_counter()
    for name, (drafter, records, lookup) in runs.items():
        path, count = share_path(work, name, share), len(range(share[0], len(records), share[1]))
        earlier = json.loads(path.read_text()) if path.exists() else None
        if earlier:
            done = len(earlier["prompts"])
            logger.info(
                "eval %s: %s",
                path.name,
                f"all {done} prompts done by earlier calls"
                if done == count
                else f"going on after {done} of {count} prompts",
            )
        left = None if budget is None or name == "eval_baseline" else max(0.0, budget - (time.perf_counter() - start))
        evaluate(
            EvalConfig(data=records, prompt_lookup=lookup, time_budget=left, **settings),
            drafters=named_drafters(drafter),
            resume=earlier,
            on_prompt=lambda partial, path=path: write_json_atomic(path, asdict(partial)),
            share=share,
        )


def merge_shares(
    name: str, drafter: str | dict[str, str], records: list[dict], lookup: int, count: int, work: Path, settings: dict
):
    """The workers' reports of one run as one report (`dflash.eval_shares.merge_reports`), then the whole report
    rebuilt (totals, histogram, tau) by `evaluate` resuming from it with nothing left to run."""
    from dflash.config import EvalConfig
    from dflash.eval_shares import merge_reports
    from dflash.evaluate import evaluate

    paths = [share_path(work, name, (w, count)) for w in range(count)]
    shares = [json.loads(path.read_text()) for path in paths if path.exists()]
    if not shares:
        raise RuntimeError(f"no worker wrote a report of {name} in {work}")
    cfg = EvalConfig(
        data=records, prompt_lookup=lookup, time_budget=0.0, warmup=False, **{**settings, "min_prompts": 0}
    )
    return evaluate(cfg, drafters=named_drafters(drafter), resume=merge_reports(shares))


def bar(report, complete: bool) -> dict:
    """The issue's checks on the report; `pass` also needs the report to cover every held-out prompt."""
    methods = {name: m for name, m in report.methods.items() if not name.startswith("dflash[")}  # not the modes'
    tau = {name: m.tau for name, m in methods.items()}
    trained, lookup, untrained = tau.get("dflash"), tau.get("prompt-lookup"), tau.get("untrained-dflash")
    mismatches = {name: m.mismatches for name, m in methods.items()}
    pairs = [
        (row["runs"]["dflash"].accepted, row["runs"]["prompt-lookup"].accepted)
        for row in report.prompts
        if {"dflash", "prompt-lookup"} <= row["runs"].keys()
    ]
    checks = {
        "trained_vs_prompt_lookup": trained / lookup if trained and lookup else None,
        "trained_vs_prompt_lookup_95": tau_ratio_interval(pairs) if trained and lookup else None,
        "trained_vs_untrained": trained / untrained if trained and untrained else None,
    }
    checks["pass_1.5x_prompt_lookup"] = bool(
        checks["trained_vs_prompt_lookup"] and checks["trained_vs_prompt_lookup"] >= 1.5
    )
    checks["pass_2x_untrained"] = bool(checks["trained_vs_untrained"] and checks["trained_vs_untrained"] >= 2.0)
    checks["pass_0_mismatches"] = all(v == 0 for v in mismatches.values())
    checks["pass_so_far"] = (
        checks["pass_1.5x_prompt_lookup"] and checks["pass_2x_untrained"] and checks["pass_0_mismatches"]
    )
    checks["complete"] = complete
    checks["pass"] = checks["pass_so_far"] and complete
    return {"tau": tau, "mismatches": mismatches, **checks}


def verdict(b: dict) -> str:
    word = "PASS" if b["pass_so_far"] else "FAIL"
    return word if b["complete"] else f"{word} so far (PARTIAL: not every held-out prompt yet)"


def tau_and_comparison(report, method: str) -> tuple[float | None, list | None, int, dict]:
    """A drafter's tau in `report`, its 95 % interval over the prompts, the number of prompts, and `evaluate`'s
    paired comparison of it with the bf16 drafter (the report's first)."""
    result = report.methods.get(method)
    prompts = [
        (r["runs"][method].accepted, r["runs"][BF16.method].accepted)
        for r in report.prompts
        if {method, BF16.method} <= r["runs"].keys()
    ]
    tau = result.tau if result else None
    interval = tau_interval(prompts) if prompts and tau is not None else None
    return tau, interval, len(prompts), report.comparisons.get(method, {})


def mode_rows(report, complete: bool, modes: dict, sampled=None) -> list[dict]:
    """One row per store mode or drafter method (bf16 first): the store's size, the drafter's tau on the held-out
    prompts with its interval, and the paired difference to the bf16 drafter's over the same prompts; with the
    `sampled` report (temperature > 0), the same there."""
    reference = report.methods[BF16.method].tau
    rows = []
    for saved in modes.values():
        mode, store, drafter = StoreMode(**saved["mode"]), saved["store"], saved["drafter"]
        method = report.methods.get(mode.method)
        tau, tau_95, prompts, comparison = tau_and_comparison(report, mode.method)
        row = {
            "mode": mode.name,
            "train": dict(mode.train),
            "bytes_per_token": store["bytes_per_token"],
            "raw_bf16_ratio": store["raw_bf16_ratio"],
            "feature_ratio": store["feature_ratio"],
            "captured": store["captured"],
            "prompts": prompts,
            "tau": tau,
            "tau_95": tau_95,
            "mismatches": method.mismatches if method else None,
            "train_loss": drafter["train_loss"],
            "val_loss": drafter["val_loss"],
            "val_tau": drafter["val_tau"],
            "step_ms": drafter["step_ms"],
            "data_wait": data_wait_share(drafter["records"]),
        }
        if mode != BF16:
            # evaluate compared each mode's drafter with the bf16 one (the first), paired over the same prompts
            relative, interval = comparison.get("relative"), comparison.get("difference_95")
            row.update(
                difference=comparison.get("difference"),
                difference_95=interval,
                relative=relative,
                # the issue's bar, as measured: the point estimate, and whether the whole interval stays within it
                within_2pct=relative is not None and relative >= -0.02,
                within_2pct_95=interval is not None and interval[0] >= -0.02 * reference,
                size_goal=store["raw_bf16_ratio"] <= 0.125,
                complete=complete,
            )
        if sampled is not None:
            tau_s, tau_s_95, _, comparison_s = tau_and_comparison(sampled, mode.method)
            row.update(
                tau_sampled=tau_s,
                tau_sampled_95=tau_s_95,
                relative_sampled=comparison_s.get("relative"),
                difference_sampled_95=comparison_s.get("difference_95"),
            )
        rows.append(row)
    return rows


def mode_verdict(row: dict) -> str:
    if "difference" not in row:
        return "reference"
    if row["mismatches"]:
        word = "FAIL (mismatches)"
    elif row["within_2pct"]:
        low = row["difference_95"][0] / (row["tau"] - row["difference"])  # relative to bf16's tau
        word = (
            "met (its 95 % interval too)"
            if row["within_2pct_95"]
            else f"met (its 95 % interval reaches {100 * low:+.1f} %)"
        )
    else:
        word = "MISSED"
    return word if row["complete"] else f"{word} so far (PARTIAL)"


def modes_markdown(rows: list[dict], report, complete: bool, steps: int) -> str:
    number = lambda x, f: format(x, f) if x is not None else "-"  # noqa: E731
    span = lambda i, f: f" ({format(i[0], f)} to {format(i[1], f)})" if i else ""  # noqa: E731
    lines = [
        f"store modes (issue 16): the same target, responses and drafter settings ({steps} steps), one drafter per "
        f"store mode, on {rows[0]['prompts']} held-out prompts{'' if complete else ' (PARTIAL)'}, temperature 0; "
        "intervals: 95 % percentile bootstrap over prompts (the difference pairs both taus on each draw)",
        "",
        "| mode | bytes / token | x raw bf16 | features x raw bf16 | captured | tau (95 %) | tau - tau(bf16) (95 %) | "
        "relative | mismatches | val tau | step ms | data wait | within 2 % of bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        captured = f"{100 * r['captured']:.1f} %" if r["captured"] is not None else "-"
        difference = "-"
        if "difference" in r:
            difference = f"{number(r['difference'], '+.3f')}{span(r['difference_95'], '+.3f')}"
        relative = f"{100 * r['relative']:+.1f} %" if r.get("relative") is not None else "-"
        wait = f"{100 * r['data_wait']:.0f} %" if r["data_wait"] is not None else "-"
        lines.append(
            f"| {r['mode']} | {r['bytes_per_token']:.1f} | {r['raw_bf16_ratio']:.3f} | {r['feature_ratio']:.3f} | "
            f"{captured} | {number(r['tau'], '.3f')}{span(r['tau_95'], '.2f')} | {difference} | {relative} | "
            f"{number(r['mismatches'], 'd')} | {number(r['val_tau'], '.3f')} | {number(r['step_ms'], '.1f')} | "
            f"{wait} | {mode_verdict(r)} |"
        )
    others = rows[1:]
    lines += [
        "",
        "bar (issue 16: tau within 2 % of the bf16 drafter's on these prompts, 0 mismatches): "
        + "; ".join(f"{r['mode']} {mode_verdict(r)}" for r in others),
        "size goal (at most 0.125 of raw bf16 bytes per token, on disk): "
        + ", ".join(
            f"{r['mode']} {r['raw_bf16_ratio']:.3f} ({'met' if r['size_goal'] else 'not met'})" for r in others
        ),
    ]
    return "\n".join(lines)


def methods_markdown(rows: list[dict], complete: bool, steps: int, temperature: float | None) -> str:
    """Issue 23's table: DFlash (the bf16 row) and each drafter method on the same store, answers and prompts."""
    number = lambda x, f: format(x, f) if x is not None else "-"  # noqa: E731
    span = lambda i, f: f" ({format(i[0], f)} to {format(i[1], f)})" if i else ""  # noqa: E731

    def relative(r, key, interval_key, tau_key):
        if r.get(key) is None:
            return "-" if "difference" in r else "reference"
        base = r[tau_key] / (1 + r[key])  # the bf16 drafter's tau in that report
        low, high = (x / base for x in r[interval_key]) if r.get(interval_key) else (None, None)
        return f"{100 * r[key]:+.1f} %" + (f" ({100 * low:+.1f} to {100 * high:+.1f} %)" if low is not None else "")

    sampled = temperature is not None
    header = "| method | training options | tau T=0 (95 %) | vs DFlash T=0 (95 %) |"
    header += f" tau T={temperature:g} (95 %) | vs DFlash T={temperature:g} (95 %) |" if sampled else ""
    header += " mismatches | val tau | step ms |"
    lines = [
        f"drafter methods (issue 23): the same target, store, answers and {steps} steps for every method, on "
        f"{rows[0]['prompts']} held-out prompts{'' if complete else ' (PARTIAL)'}; intervals: 95 % percentile "
        "bootstrap over prompts (differences paired on each draw)",
        "",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    for r in rows:
        options = ", ".join(f"{k}={v}" for k, v in r["train"].items()) or "dflash, decay"
        line = (
            f"| {r['mode'] if r['train'] else 'dflash'} | {options} | {number(r['tau'], '.3f')}{span(r['tau_95'], '.2f')} | "
            f"{relative(r, 'relative', 'difference_95', 'tau')} |"
        )
        if sampled:
            line += (
                f" {number(r.get('tau_sampled'), '.3f')}{span(r.get('tau_sampled_95'), '.2f')} | "
                f"{relative(r, 'relative_sampled', 'difference_sampled_95', 'tau_sampled')} |"
            )
        line += f" {number(r['mismatches'], 'd')} | {number(r['val_tau'], '.3f')} | {number(r['step_ms'], '.1f')} |"
        lines.append(line)
    return "\n".join(lines)


def markdown(results: dict, report) -> str:
    s, t = results["scale"], results.get("target", {})
    lines = [
        f"quality run ({s['name']} sizes{', TOY NUMBERS' if s['name'] == 'tiny' else ''}): "
        f"{len(report.prompts)} held-out prompts, {report.max_new_tokens} new tokens, temperature 0, "
        f"{report.device} {report.dtype}",
        "",
        "| method | prompts | tau | tokens/s | speedup | mismatches | accepted drafts per round (0, 1, ...) |",
        "|---|---|---|---|---|---|---|",
        f"| plain greedy | {len(report.prompts)} | - | {report.plain_tokens_per_s:.1f} | 1.00x | - | - |",
    ]
    for m in report.methods.values():
        tau = f"{m.tau:.2f}" if m.tau is not None else "-"
        prompts = sum(m.name in row["runs"] for row in report.prompts)
        lines.append(
            f"| {m.name} | {prompts} | {tau} | {m.tokens_per_s:.1f} | {m.speedup:.2f}x | {m.mismatches} | "
            f"{' '.join(map(str, m.accepted_histogram))} |"
        )
    b = results["bar"]
    ratio = lambda x: f"{x:.2f}x" if x else "-"  # noqa: E731
    low_high = b.get("trained_vs_prompt_lookup_95")
    interval = f" (95 % over prompts: {low_high[0]:.2f}-{low_high[1]:.2f}x)" if low_high else ""
    lines += [
        "",
        f"bar: trained / prompt lookup {ratio(b['trained_vs_prompt_lookup'])}{interval} (>= 1.5x: "
        f"{'pass' if b['pass_1.5x_prompt_lookup'] else 'FAIL'}), trained / untrained "
        f"{ratio(b['trained_vs_untrained'])} (>= 2x: {'pass' if b['pass_2x_untrained'] else 'FAIL'}), "
        f"mismatches {b['mismatches']} ({'pass' if b['pass_0_mismatches'] else 'FAIL'}) -> "
        f"{verdict(b)}",
        "",
        "| stage | budget s | seconds |",
        "|---|---|---|",
    ]
    for name, st in results["stages"].items():
        earlier = " (earlier call)" if st.get("resumed") else ""
        lines.append(
            f"| {name} | {st['budget_s'] if st['budget_s'] is not None else '-'} | {st['seconds']:.1f}{earlier} |"
        )
    d, r, h, dr = results["data"], results.get("regenerate", {}), results.get("harvest", {}), results.get("drafter", {})
    lines += [
        "",
        f"data: stdlib files for the target / the drafter's prompts / the eval: {d['train_files']} / "
        f"{d['drafter_files']} / {d['heldout_files']} ({d['train_chars'] / 1e6:.1f} / {d['drafter_chars'] / 1e6:.1f}"
        f" / {d['heldout_chars'] / 1e6:.1f} M chars), vocab {t.get('vocab_size')}",
        f"target: {t.get('parameters', 0) / 1e6:.1f} M params, {t.get('steps')} steps, "
        f"{t.get('tokens_seen', 0) / 1e6:.1f} M tokens ({t.get('epochs', 0):.1f} epochs), "
        f"loss train {t.get('train_loss', float('nan')):.3f} / held-out {t.get('heldout_loss', float('nan')):.3f}",
        f"regenerate: {r.get('responses')} responses, {r.get('response_tokens')} tokens, "
        f"distinct 4-grams {r.get('distinct_4gram_ratio', 0):.2f}",
        f"harvest: {h.get('tokens')} tokens in {h.get('rows')} rows, {h.get('store_mb', 0):.0f} MB",
        f"drafter: {dr.get('steps')} steps, final train loss {dr.get('train_loss')}, "
        f"val accept {dr.get('val_accept_len')}, val tau {dr.get('val_tau')}",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ main


def scale_with_overrides(scale: Scale, assignments: list[str], parser: argparse.ArgumentParser) -> Scale:
    """`FIELD=VALUE` strings applied to a Scale, each value parsed as the field's type."""
    types = {f.name: type(getattr(scale, f.name)) for f in dataclasses.fields(scale) if f.name != "name"}
    changes = {}
    for assignment in assignments:
        field, _, value = assignment.partition("=")
        if field not in types or not value:
            parser.error(f"--set {assignment}: expected FIELD=VALUE with FIELD one of {', '.join(sorted(types))}")
        kind = int if types[field] is type(None) else types[field]  # (corpus_chars, a count, defaults to None)
        try:
            changes[field] = kind(value)
        except ValueError:
            parser.error(f"--set {assignment}: {field} takes a {kind.__name__}")
    return dataclasses.replace(scale, **changes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON results (rewritten after every stage); a .log beside it")
    parser.add_argument(
        "--tiny", action="store_true", help="toy sizes for a CPU check (minutes); numbers are meaningless"
    )
    parser.add_argument("--work", help="working folder (target, prompts, store, run); default: a new one under /tmp")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a size or budget of the scale (repeatable), e.g. --set regen_seconds=120",
    )
    parser.add_argument(
        "--modes",
        default="",
        metavar="MODE,...",
        help="store modes to measure besides bf16 (issue 16): fp8, subK or subA/B, a subspace "
        "optionally +fp8, e.g. fp8,sub1/2,sub1/4,sub1/8,sub1/4+fp8",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        metavar="T",
        help="with --modes: evaluate the drafters a second time sampling at temperature T (lossless verification), "
        "after the temperature-0 eval (issue 23's table)",
    )
    parser.add_argument(
        "--stop-after",
        choices=[*Run.RESUMABLE, "modes"],
        help="end after this stage; a later call with the same --work goes on from there",
    )
    parser.add_argument(
        "--restart",
        action="store_true",
        help="delete a run of other sizes or seed found in --work (by default that is an error)",
    )
    args = parser.parse_args(argv)

    scale = scale_with_overrides(TINY if args.tiny else GPU, args.set, parser)
    try:
        modes = parse_modes(args.modes)
    except ValueError as exc:
        parser.error(str(exc))
    if args.stop_after == "modes" and not modes:
        parser.error("--stop-after modes needs --modes")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Absolute: the paths saved in --work (the eval reports name the target and drafter) match on the next call.
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="dflash-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        run = Run(out, scale, work, args.seed, args.restart)
    except WorkFolderInUse as exc:
        parser.error(str(exc))
    log = out.with_suffix(".log")
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout), logging.FileHandler(log, mode="w")],
    )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    if device.type == "cuda":
        import fla  # noqa: F401 -- fail now, not after minutes of training, if the Triton kernels are missing
    elif not args.tiny:
        logger.warning("GPU sizes on the CPU: this will take hours; use --tiny")
    else:
        # One thread: on a small shared CPU, two spinning OpenMP threads next to another busy process run many
        # times slower than one.
        torch.set_num_threads(1)
    import transformers

    run.results.update(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        versions={
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        triton_f32_default=os.environ.get("TRITON_F32_DEFAULT"),
        triton_cache=os.environ.get("DFLASH_TRITON_CACHE", "cold"),  # "carried": compile times are not cold
        work=str(work),
    )
    logger.info("quality run, %s sizes, on %s; work folder %s", scale.name, run.results["device"], work)

    def stop_here(name: str) -> bool:
        if args.stop_after != name:
            return False
        logger.info("stopped after %s as asked; rerun with --work %s to go on from there", name, work)
        run.save()
        return True

    # 1. data
    def data():
        train, drafter_files, heldout, counts = stdlib_files(scale)
        run.results["data"] = counts
        train_texts = capped([train[n] for n in sorted(train)], scale.corpus_chars, args.seed)
        tokenizer = build_tokenizer(scale.vocab_size, capped(train_texts, scale.tokenizer_chars, args.seed + 1))
        train_ids = token_stream(tokenizer, train_texts)
        heldout_texts = capped([heldout[n] for n in sorted(heldout)], scale.corpus_chars, args.seed)
        heldout_ids = token_stream(tokenizer, heldout_texts)
        counts.update(
            target_train_chars=sum(map(len, train_texts)),
            train_tokens=int(train_ids.size),
            heldout_tokens=int(heldout_ids.size),
            chars_per_token=sum(map(len, train_texts)) / max(train_ids.size, 1),
        )
        logger.info("data: %s", counts)
        return drafter_files, heldout, tokenizer, train_ids, heldout_ids

    drafter_files, heldout, tokenizer, train_ids, heldout_ids = run.stage("data", 30 if not args.tiny else 20, data)
    eval_prompts = make_prompts(heldout, scale.eval_prompts, scale.prompt_chars, args.seed + 2, one_per_file=True)
    train_prompts = make_prompts(
        drafter_files, scale.train_prompts, scale.prompt_chars, args.seed + 3, one_per_file=False
    )
    val_prompts = make_prompts(heldout, scale.val_prompts, scale.prompt_chars, args.seed + 4, one_per_file=False)
    write_jsonl(work / "prompts_eval.jsonl", eval_prompts)
    write_jsonl(work / "prompts_train.jsonl", train_prompts)
    write_jsonl(work / "prompts_val.jsonl", [{"text": p["text"]} for p in val_prompts])

    # 2. target
    target = work / "target"
    target_budget = scale.target_seconds + (30 if device.type == "cuda" else 5)  # + first steps, loss, save
    run.results["target"] = run.stage(
        "target",
        target_budget,
        lambda: train_target(
            scale, tokenizer, train_ids, heldout_ids, target, device, eval_prompts[0]["text"], args.seed
        ),
    )
    if stop_here("target"):
        return 0

    # 3. regenerate
    def regen():
        from dflash.config import RegenerateConfig
        from dflash.regenerate import regenerate

        info = regenerate_on_all(scale, target, train_prompts, work, device, scale.regen_seconds, log)
        info.update(response_stats(tokenizer, Path(info["file"])))
        regenerate(
            RegenerateConfig(
                str(target),
                str(work / "prompts_val.jsonl"),
                str(work / "responses_val.jsonl"),
                max_new_tokens=scale.new_tokens,
                batch_size=scale.regen_batch,
                device=device.type,
                dtype="float32",
            ),
            progress=False,
        )
        info["val_file"] = str(work / "responses_val.jsonl")
        logger.info("regenerate: %s", {k: v for k, v in info.items() if k != "sample_response"})
        logger.info("sample response:\n%s", info["sample_response"][:400])
        return info

    run.results["regenerate"] = run.stage("regenerate", scale.regen_seconds + 10, regen)
    if stop_here("regenerate"):
        return 0

    # 4. harvest
    def harvest():
        from dflash.store import Store, disk_bytes

        shards = harvest_store(scale, target, run.results["regenerate"]["file"], work / "shards", device)
        val_shards = harvest_store(scale, target, run.results["regenerate"]["val_file"], work / "shards_val", device)
        counts = asdict(Store.open(shards).manifest.counts)
        val_rows = Store.open(val_shards).num_rows
        return {
            **counts,
            "store_mb": disk_bytes(shards) / 1e6,
            "path": str(shards),
            "val_path": str(val_shards),
            "val_rows": val_rows,
        }

    run.results["harvest"] = run.stage("harvest", 30 if device.type == "cuda" else 20, harvest)
    if stop_here("harvest"):
        return 0

    # 5. drafter
    def drafter():
        rows = run.results["harvest"]["rows"]
        steps = drafter_steps(scale, rows)
        logger.info(
            "drafter: %d train rows, %d rows per step, %d steps (%.1f epochs); held-out store of %d rows",
            rows,
            scale.rows_per_step,
            steps,
            steps * scale.rows_per_step / max(rows, 1),
            run.results["harvest"]["val_rows"],
        )
        return train_drafter(
            scale,
            run.results["harvest"]["path"],
            run.results["harvest"]["val_path"],
            work / "run",
            steps,
            device,
            args.seed,
        )

    run.results["drafter"] = run.stage("drafter", scale.drafter_seconds, drafter)
    if stop_here("drafter"):
        return 0

    # 6. store modes (issue 16)
    mode_drafters = None
    if modes:
        untrained = sum(not mode_done(run.stages, m.folder).exists() for m in modes)
        unharvested = sum(not mode_harvested(run.stages, m.folder).exists() for m in modes)
        harvests = math.ceil(unharvested / max(scale.mode_workers, 1)) * (60 if device.type == "cuda" else 40)
        budget = harvests + math.ceil(untrained / max(scale.mode_train_workers, 1)) * scale.drafter_seconds
        run.results["modes"] = run.stage(
            "modes",
            budget,
            lambda: run_modes(scale, modes, target, run.results, work, run.stages, device, args.seed, log),
        )
        if stop_here("modes"):
            return 0
        mode_drafters = {m.method: run.results["modes"][m.name]["drafter"]["export"] for m in modes}

    # 7. eval: temperature 0 (with plain greedy's mismatch check and the baselines), then sampled if asked
    sampled_eval = bool(modes and args.temperature)

    def eval_stage(name: str, temperature: float, evals_left: int = 1):
        # what is left is shared by the evals still to run: the greedy one must not leave the sampled one nothing
        budget = max(0.0, min(scale.eval_seconds, (run.left() - 10) / evals_left))
        return run.stage(
            name,
            budget,
            lambda: evaluate_all(
                scale,
                target,
                Path(run.results["drafter"]["export"]),
                eval_prompts,
                device,
                budget,
                args.seed,
                work,
                log,
                modes=mode_drafters,
                temperature=temperature,
            ),
        )

    report, complete = eval_stage("eval", 0.0, evals_left=2 if sampled_eval else 1)
    run.results["eval"] = asdict(report)
    run.results["bar"] = bar(report, complete)
    if not complete:
        logger.info(
            "eval: %d of %d held-out prompts done; the bar below is PARTIAL: rerun with --work %s to go on",
            len(report.prompts),
            len(eval_prompts),
            work,
        )
    sampled = None
    if sampled_eval:
        name = f"eval_T{args.temperature:g}"
        sampled, sampled_complete = eval_stage(name, args.temperature)
        run.results[name] = asdict(sampled)
        complete = complete and sampled_complete
    table = markdown(run.results, report)
    run.results["table"] = table
    if modes:
        rows = mode_rows(report, complete, run.results["modes"], sampled)
        steps = drafter_steps(scale, run.results["harvest"]["rows"])
        store_rows = [r for r in rows if not r["train"]]
        method_rows = [rows[0], *(r for r in rows if r["train"])]
        parts = {"rows": rows}
        if len(store_rows) > 1:
            parts["markdown"] = modes_markdown(store_rows, report, complete, steps)
        if len(method_rows) > 1:
            parts["methods_markdown"] = methods_markdown(method_rows, complete, steps, args.temperature)
        run.results["modes_table"] = parts
        table += "".join("\n\n" + parts[k] for k in ("markdown", "methods_markdown") if k in parts)
    run.save()
    logger.info("wrote %s (%.0f s in all)", out, run.elapsed())
    print("\n" + table, flush=True)
    out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
