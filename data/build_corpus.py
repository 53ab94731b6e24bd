"""Rebuild the bundled corpus from the docstrings of Python's standard library (real text, PSF licence).

    python data/build_corpus.py

Writes data/corpus.jsonl (plain-text and chat documents) and data/prompts.jsonl (chat prompts without answers).
The output depends only on the Python version that runs it; the committed files came from CPython 3.11.
"""

import importlib
import inspect
import json
import random
from pathlib import Path

MODULES = [
    "abc",
    "argparse",
    "array",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "enum",
    "fnmatch",
    "fractions",
    "functools",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "inspect",
    "io",
    "itertools",
    "json",
    "logging",
    "math",
    "operator",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "shlex",
    "shutil",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "weakref",
    "zipfile",
    "zlib",
]


def docstrings():
    for name in MODULES:
        module = importlib.import_module(name)
        if module.__doc__ and len(module.__doc__) > 200:
            yield name, module.__doc__.strip()
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 150 and getattr(obj, "__module__", "") == name:
                yield f"{name}.{attr}", doc


def main():
    rng = random.Random(0)
    items = sorted(set(docstrings()))
    rng.shuffle(items)
    corpus, prompts = [], []
    for i, (name, doc) in enumerate(items[:600]):
        if i % 3 == 0:
            question = {"role": "user", "content": f"Explain what `{name}` in the Python standard library does."}
            corpus.append({"messages": [question, {"role": "assistant", "content": doc}]})
            prompts.append({"messages": [question]})
        else:
            corpus.append({"text": doc})
    here = Path(__file__).parent
    (here / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in corpus))
    (here / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts[:64]))
    print(f"{len(corpus)} documents, {len(prompts[:64])} prompts")


if __name__ == "__main__":
    main()
