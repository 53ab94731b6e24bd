"""Shared by the harvest tests: the tiny harvest's options, its CLI, and readers of what a store holds."""

import json
import os
from pathlib import Path

import numpy as np
import torch
from click.testing import CliRunner

from cli.main import main
from dflash import store
from dflash.store import Store
from dflash.tiny import CORPUS

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 256
OPTIONS = dict(
    token_budget=BUDGET, forward_tokens=2 * BUDGET, overflow="split", dtype="float32", workers=1, device="cpu"
)


def write_harvest_data(folder: Path, lines: int, long_from: int) -> Path:
    """The harvest tests' data: the first `lines` corpus lines (chat and text), a 3-token document and a long one
    (the texts of the first `long_from` lines) that splits into pieces."""
    corpus = CORPUS.read_text().splitlines()[:lines]
    long_text = "\n\n".join(json.loads(line).get("text", "") for line in corpus[:long_from])
    corpus += [json.dumps({"text": "Hi."}), json.dumps({"text": long_text})]
    path = folder / "train.jsonl"
    path.write_text("\n".join(corpus) + "\n")
    return path


def cli_args(model, data, out, **overrides) -> list[str]:
    options = {**OPTIONS, **overrides}
    args = ["harvest", "--model", str(model), "--data", str(data), "--out", str(out)]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def stored_documents(path) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    """(doc_id, piece) -> that document's slice of every row array, located through the documents table."""
    shards = Store.open(path)
    rows, documents = {}, {}
    for doc_id, piece, row, start, length in shards.documents().tolist():
        if row not in rows:
            rows[row] = shards.read_row(row)
        assert (doc_id, piece) not in documents, f"document {doc_id} piece {piece} stored twice"
        documents[doc_id, piece] = {name: rows[row][name][start : start + length] for name in rows[row]}
    return documents


def bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()


def assert_hidden_close(stored: torch.Tensor, reference: torch.Tensor, what: str) -> float:
    """Within one bf16 ulp; returns the bit-identical fraction."""
    bound = reference.abs() * 2**-7 + 1e-6
    worst = ((stored - reference).abs() - bound).max().item()
    assert worst <= 0, f"{what}: stored hidden states differ from the reference by more than 1 bf16 ulp"
    return (stored == reference).float().mean().item()


def assert_same_content(path, reference_path):
    """Same documents, same tokens, hidden states within the stated tolerance."""
    got, expected = stored_documents(path), stored_documents(reference_path)
    assert got.keys() == expected.keys()
    identical = []
    for key, doc in expected.items():
        for name in ("input_ids", "position_ids", "doc_ids", "loss_mask"):
            np.testing.assert_array_equal(got[key][name], doc[name], err_msg=f"{name} of document {key}")
        identical.append(assert_hidden_close(bf16(got[key]["hidden"]), bf16(doc["hidden"]), f"document {key}"))
    assert np.mean(identical) >= 0.99


def subprocess_env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}


def run_cli(args: list[str]):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def store_files(path: Path) -> dict[str, bytes]:
    return {
        str(f.relative_to(path)): f.read_bytes() for f in path.rglob("*") if f.is_file() and f.name != store.LOCK_FILE
    }


def swap_files(a: Path, b: Path) -> None:
    """Exchange two files' contents: two chunk files each keep a valid CRC32C, in the other's place."""
    data = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data)
