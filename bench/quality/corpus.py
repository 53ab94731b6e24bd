"""The run's text: this machine's Python standard library split into the target's, the drafter's and the eval's
files, and prompts cut from them; each file as it is (fixture "code") or its prose alone (fixture "prose")."""

import ast
import hashlib
import json
import logging
import random
import sysconfig
from pathlib import Path

import numpy as np

from bench.quality.scale import Scale

logger = logging.getLogger("quality")


def stdlib_files(scale: Scale) -> tuple[dict[str, str], dict[str, str], dict[str, str], dict]:
    """(train, drafter, held-out) {relative path: source}, split by a hash of the path; and counts."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, drafter, heldout = {}, {}, {}
    skipped = {"site_packages": 0, "too_big": 0, "unreadable": 0, "empty": 0}
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
            text = prose(text) if scale.fixture == "prose" else text
        except (UnicodeDecodeError, OSError, SyntaxError, ValueError):
            skipped["unreadable"] += 1
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


def prose(source: str, min_chars: int = 200, min_letters: float = 0.85) -> str:
    """A Python file's long strings that read as text (docstrings, pydoc_data's topics), blank-line separated:
    those of at least `min_chars` characters, `min_letters` of them letters or white space."""
    texts = [
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) >= min_chars
    ]
    return "\n\n".join(t for t in texts if sum(c.isalpha() or c.isspace() for c in t) >= min_letters * len(t))


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


def write_jsonl(path: Path, records: list[dict]):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
