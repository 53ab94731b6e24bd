"""dflash/data/sources.py: record shapes, file kinds, folders, mixtures, dedup, --limit and every bad input."""

import gzip
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from dflash.data import DataConfig, load_documents
from dflash.data.sources import iter_records, parse_source
from dflash.errors import DflashError

SYSTEM, QUESTION, ANSWER = "You answer briefly.", "What does a hash map store?", "Key and value pairs."
OPENAI = {
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": ANSWER},
    ]
}
SHAREGPT = {
    "conversations": [
        {"from": "system", "value": SYSTEM},
        {"from": "human", "value": QUESTION},
        {"from": "gpt", "value": ANSWER},
    ]
}
RECORDS = [
    OPENAI,
    {"text": "def add(a, b):\n    return a + b\n"},
    {"prompt": "x = 1", "completion": "0 + y"},
    {"conversations": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]},
    {"messages": [{"role": "user", "content": "And a set?"}, {"role": "assistant", "content": "Only the keys."}]},
]
TOOL_CHAT = {
    "messages": [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": "get_weather(city='Oslo')"},
        {"role": "tool", "content": "rain, 4 degrees"},
        {"role": "assistant", "content": "It rains at 4 degrees."},
    ]
}
# A template that renders only the three chat roles (skipping any other turn), or refuses other roles outright.
SKIPPING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REFUSING_TEMPLATE = SKIPPING_TEMPLATE.replace(
    "{% if m['role'] in ['system', 'user', 'assistant'] %}",
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role') }}{% endif %}{% if true %}",
)


def _lines(records) -> bytes:
    return "".join(json.dumps(record) + "\n" for record in records).encode()


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    name = path.name
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = dict.fromkeys(key for record in records for key in record)  # a record without one: null
        table = pa.Table.from_pylist([{key: record.get(key) for key in columns} for record in records])
        pq.write_table(table, path, row_group_size=2)  # several row groups
    elif name.endswith(".gz"):
        path.write_bytes(gzip.compress(_lines(records)))
    elif name.endswith(".zst"):
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(_lines(records)))
    else:
        path.write_bytes(_lines(records))
    return str(path)


def _texts(prefix: str, n: int) -> list[dict]:
    return [{"text": f"{prefix} number {i}"} for i in range(n)]


def _load(data, tokenizer_path, **options):
    return load_documents(DataConfig(data, **options), tokenizer_path)


def _same(a, b):
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert (x.doc_id, x.piece) == (y.doc_id, y.piece)
        assert np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.loss_mask, y.loss_mask)


@pytest.mark.parametrize("name", ["data.json", "data.jsonl.gz", "data.jsonl.zst", "data.parquet"])
def test_every_file_kind_gives_the_documents_of_plain_jsonl(tmp_path, tokenizer_path, name):
    plain, plain_stats = _load(_write(tmp_path / "plain.jsonl", RECORDS), tokenizer_path)
    other, other_stats = _load(_write(tmp_path / name, RECORDS), tokenizer_path)
    _same(plain, other)
    assert (other_stats.chat, other_stats.text, other_stats.completion) == (3, 1, 1)
    assert other_stats.loss_tokens == plain_stats.loss_tokens


def test_a_folder_of_shards_reads_its_files_sorted_and_recursively(tmp_path, tokenizer_path):
    plain, _ = _load(_write(tmp_path / "plain.jsonl", RECORDS), tokenizer_path)
    folder = tmp_path / "shards"
    _write(folder / "part-0.parquet", RECORDS[:2])
    _write(folder / "part-1.jsonl.gz", RECORDS[2:3])
    _write(folder / "zz" / "part-2.jsonl.zst", RECORDS[3:])
    (folder / "README.md").write_text("not data")  # other files are not read
    sharded, stats = _load(str(folder), tokenizer_path)
    _same(plain, sharded)
    assert stats.sources[0]["records"] == len(RECORDS)
    wheres = [where for where, _ in iter_records(str(folder))]
    assert wheres[0].endswith("part-0.parquet row 1") and wheres[-1].endswith("part-2.jsonl.zst line 2")


def test_sharegpt_with_a_system_prompt_equals_its_openai_form(tmp_path, tokenizer_path):
    [openai], _ = _load(_write(tmp_path / "a.jsonl", [OPENAI]), tokenizer_path)
    [sharegpt], _ = _load(_write(tmp_path / "b.jsonl", [SHAREGPT]), tokenizer_path)
    _same([openai], [sharegpt])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    assert SYSTEM in tokenizer.decode(sharegpt.input_ids)  # the system prompt is kept
    assert tokenizer.decode(sharegpt.input_ids[sharegpt.loss_mask == 1]) == ANSWER + "<|im_end|>"


def test_a_rendered_tool_turn_is_kept_with_the_loss_off(tmp_path, tokenizer_path):
    [document], _ = _load(_write(tmp_path / "tool.jsonl", [TOOL_CHAT]), tokenizer_path)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    assert "<|im_start|>tool\nrain, 4 degrees<|im_end|>" in tokenizer.decode(document.input_ids)
    assert tokenizer.decode(document.input_ids[document.loss_mask == 1]) == (
        "get_weather(city='Oslo')<|im_end|>It rains at 4 degrees.<|im_end|>"
    )


@pytest.mark.parametrize(
    "template, problem",
    [
        (SKIPPING_TEMPLATE, r"does not render message 3 \(role 'tool'\)"),
        (REFUSING_TEMPLATE, "cannot render its tool turns"),
    ],
)
def test_a_tool_turn_the_template_cannot_render_is_refused(tmp_path, template, problem, save_tokenizer):
    tokenizer_path = save_tokenizer(tmp_path / "tokenizer", template)
    path = _write(tmp_path / "tool.jsonl", [{"text": "fine"}, TOOL_CHAT])
    with pytest.raises(DflashError, match=f"tool.jsonl line 2: .*{problem}.*tokenizer whose chat template renders"):
        _load(path, tokenizer_path)


def test_weights_take_round_w_times_n_records_in_a_seeded_order(tmp_path, tokenizer_path):
    a = _write(tmp_path / "a.jsonl", _texts("alpha", 10))
    b = _write(tmp_path / "b.parquet", _texts("beta", 4))

    def mixed(*specs, seed=0):
        documents, stats = _load(list(specs), tokenizer_path, seed=seed)
        return [doc.input_ids.tobytes() for doc in documents], stats

    order, stats = mixed(a, f"{b}:0.5")
    assert [s["used"] for s in stats.sources] == [10, 2] and len(order) == stats.documents == 12
    assert [s["weight"] for s in stats.sources] == [1.0, 0.5]
    assert mixed(a, f"{b}:0.5")[0] == order  # the same seed, the same documents in the same order
    other, _ = mixed(a, f"{b}:0.5", seed=1)
    assert other != order and len(other) == 12
    repeated, stats = mixed(f"{a}:0.3", f"{b}:2.5")  # 3 of a; 2 whole passes of b and 2 of its 4 records again
    assert [s["used"] for s in stats.sources] == [3, 10]
    times = Counter(repeated)
    assert len(times) == 3 + 4 and sorted(times.values()) == [1, 1, 1, 2, 2, 3, 3]
    documents, _ = _load([f"{a}:0.3", f"{b}:2.5"], tokenizer_path)
    first = {}
    for doc in documents:  # a repeated record is tokenised once: its documents are views of the same tokens
        same = first.setdefault(doc.input_ids.tobytes(), doc)
        assert same is doc or np.shares_memory(same.input_ids, doc.input_ids)
    assert len(first) == 7 and doc.doc_id == len(documents) - 1
    assert [doc.doc_id for doc in _load([a, b], tokenizer_path)[0]] == list(range(14))  # distinct ids


def test_one_source_of_weight_one_keeps_its_file_order(tmp_path, tokenizer_path):
    path = _write(tmp_path / "a.jsonl", _texts("alpha", 6))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    documents, _ = _load(f"{path}:1", tokenizer_path, seed=5)
    assert [tokenizer.decode(doc.input_ids) for doc in documents] == [f"alpha number {i}" for i in range(6)]


def test_identical_records_are_kept_once_within_and_across_sources(tmp_path, tokenizer_path):
    a = _write(tmp_path / "a.jsonl", [OPENAI, {"text": "one"}, {"text": "one"}, {"text": "two"}])
    b = _write(tmp_path / "b.jsonl.gz", [SHAREGPT, {"text": "three"}])  # SHAREGPT is OPENAI in another shape
    documents, stats = _load([a, b], tokenizer_path)
    assert [(s["records"], s["deduplicated"], s["used"], s["documents"]) for s in stats.sources] == [
        (4, 1, 3, 3),
        (2, 1, 1, 1),
    ]
    assert (stats.records_read, stats.deduplicated, stats.documents) == (6, 2, 4)
    assert sum(s["tokens"] for s in stats.sources) == stats.tokens
    assert sum(s["loss_tokens"] for s in stats.sources) == stats.loss_tokens
    _, kept = _load([a, b], tokenizer_path, dedup=False)
    assert (kept.deduplicated, kept.documents) == (0, 6)


def test_limit_keeps_the_first_records_of_the_mixture(tmp_path, tokenizer_path):
    a = _write(tmp_path / "a.jsonl", _texts("alpha", 5))
    b = _write(tmp_path / "b.jsonl", _texts("beta", 5))
    whole, _ = _load([a, b], tokenizer_path)
    first, stats = _load([a, b], tokenizer_path, limit=3)
    assert stats.documents == 3 and sum(s["used"] for s in stats.sources) == 3
    _same(whole[:3], first)
    with pytest.raises(DflashError, match="--limit 0"):
        _load([a, b], tokenizer_path, limit=0)


def test_a_path_with_a_colon_is_read_whole_when_it_exists(tmp_path, tokenizer_path):
    path = _write(tmp_path / "run:2.jsonl", _texts("alpha", 2))
    assert parse_source(path).weight is None
    assert _load(path, tokenizer_path)[1].documents == 2
    assert parse_source(f"{path}:3").weight == 3.0


def test_iter_records_gives_normalised_records_with_their_place(tmp_path):
    path = _write(tmp_path / "p.parquet", [SHAREGPT, {"prompt": "Say hi"}])
    records = list(iter_records([path]))
    assert records == [(f"{path} row 1", OPENAI), (f"{path} row 2", {"prompt": "Say hi"})]


@pytest.mark.parametrize(
    "spec, problem",
    [
        ("a.jsonl:-1", r"the weight '-1' after the last ':' is not a number >= 0.*PATH:WEIGHT"),
        ("a.jsonl:abc", r"the weight 'abc'.*PATH:WEIGHT"),
        ("a.jsonl:", r"the weight ''"),
        ("missing.jsonl", r"missing.jsonl: it does not exist; pass a JSONL or Parquet file"),
        ("empty", r"data folder .*empty holds no data file"),
    ],
)
def test_bad_sources_are_named(tmp_path, tokenizer_path, spec, problem):
    (tmp_path / "empty").mkdir()
    _write(tmp_path / "a.jsonl", _texts("alpha", 2))
    with pytest.raises(DflashError, match=problem):
        _load(str(tmp_path / spec), tokenizer_path)


@pytest.mark.parametrize(
    "name, content",
    [
        ("bad.jsonl.gz", b"this is not gzip"),
        ("cut.jsonl.gz", gzip.compress(_lines(_texts("alpha", 50)))[:-30]),
        ("bad.jsonl.zst", b"this is not zstd"),
        ("bad.parquet", b"PAR1 nothing"),
    ],
)
def test_damaged_files_are_named(tmp_path, tokenizer_path, name, content):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DflashError, match=f"{name} is damaged"):
        _load(str(tmp_path / name), tokenizer_path)


@pytest.mark.parametrize(
    "record, problem",
    [
        ({"title": "hi"}, 'none of the keys "messages", "text", "prompt" \\(nor ShareGPT "conversations"\\)'),
        ({"conversations": [{"from": "alien", "value": "hi"}]}, "turn 1 has the role 'alien'"),
        ({"conversations": []}, '"conversations" must be a non-empty list'),
        ({"conversations": [{"from": "human", "value": "hi"}], "messages": []}, 'both "conversations" and "messages"'),
        ({"conversations": [{"from": "human", "value": "hi"}]}, "no assistant turn"),
    ],
)
@pytest.mark.parametrize("name", ["data.jsonl.zst", "data.parquet"])
def test_bad_records_name_the_file_and_the_record(tmp_path, tokenizer_path, record, problem, name):
    path = _write(tmp_path / name, [{"text": "fine"}, {"text": "also fine"}, record])
    place = "line 3" if name.endswith(".zst") else "row 3"
    with pytest.raises(DflashError, match=f"{name} {place}: .*{problem}"):
        _load(path, tokenizer_path)


@pytest.mark.parametrize(
    "line, problem",
    [
        # json counts the column past a trailing line break as line 2's first: the line's own is named instead
        ('{"text": "abc"', "Expecting ',' delimiter at column 15: the line ends before its object does (cut off?)"),
        ('{"text": "ab', "Unterminated string starting at column 10: the line ends before its object does (cut off?)"),
        ('{"text": "a\tb"}', "Invalid control character at column 12)"),
        ('{"text": "a"} x', "Extra data at column 15)"),
    ],
)
def test_a_malformed_json_line_is_named_at_its_own_column(tmp_path, line, problem):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_lines([{"text": "fine"}]) + line.encode() + b"\n")
    with pytest.raises(DflashError, match=f"d.jsonl line 2: malformed JSON \\({re.escape(problem)}"):
        list(iter_records([path]))


def test_a_jsonl_file_with_a_byte_order_mark_reads_as_without(tmp_path, tokenizer_path):
    plain = _write(tmp_path / "plain.jsonl", _texts("alpha", 3))
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + Path(plain).read_bytes())  # as Windows editors save UTF-8
    assert [r for _, r in iter_records([marked])] == [r for _, r in iter_records([plain])]
    _same(_load(str(marked), tokenizer_path)[0], _load(str(plain), tokenizer_path)[0])


def _harvest_options(tmp_path, config_text: str, *flags: str):
    """The HarvestConfig a command built from its options gets, given a --config file and flags."""
    import click
    from click.testing import CliRunner

    from cli.options import config_option, config_options, reports_errors
    from dflash.config import HarvestConfig, given

    @click.command("harvest")
    @config_option
    @config_options(HarvestConfig)
    @reports_errors
    def harvest(**options):
        cfg = given(HarvestConfig, options)
        click.echo(json.dumps({"data": cfg.data, "dedup": cfg.dedup, "limit": cfg.limit, "seed": cfg.data_seed}))

    config = tmp_path / "c.toml"
    config.write_text(f'model = "m"\nout = "o"\n{config_text}')
    result = CliRunner().invoke(harvest, ["--config", str(config), *flags])
    return json.loads(result.output) if result.exit_code == 0 else result


def test_data_is_repeatable_on_the_command_line_and_a_list_in_a_config_file(tmp_path):
    got = _harvest_options(tmp_path, "", "--data", "a.jsonl", "--data", "b.parquet:0.25", "--no-dedup", "--limit", "9")
    assert got == {"data": ["a.jsonl", "b.parquet:0.25"], "dedup": False, "limit": 9, "seed": 0}
    got = _harvest_options(tmp_path, 'data = ["a.jsonl", "shards/:2"]\ndata-seed = 3\n')
    assert got == {"data": ["a.jsonl", "shards/:2"], "dedup": True, "limit": None, "seed": 3}
    assert _harvest_options(tmp_path, 'data = "a.jsonl"\n', "--data", "b.jsonl")["data"] == ["b.jsonl"]  # flags win
    result = _harvest_options(tmp_path, "data = [1]\n")
    assert result.exit_code == 2 and "data = [1] is not a string or a list of strings" in result.output


def test_a_single_data_string_still_makes_a_config():
    from dflash.config import HarvestConfig

    assert HarvestConfig(model="m", data="corpus.jsonl", out="o").data == ["corpus.jsonl"]


def test_the_manifest_keeps_per_source_counts_and_loads_without_them(tmp_path, tokenizer_path):
    import dataclasses

    from dflash import store
    from dflash.manifest import Manifest, TargetSpec, TokenizerSpec

    def header(world_size):
        target = TargetSpec("m", "qwen3", "hash", num_layers=4, hidden_size=8, vocab_size=1000)
        return store.new_manifest(
            target=target,
            layer_ids=[0, 1],
            token_budget=64,
            tokenizer=TokenizerSpec("m", 1000, {}),
            fingerprint={"world_size": world_size},
        )

    a = _write(tmp_path / "a.jsonl", [{"text": "one"}, {"text": "one"}])
    _, stats = _load([a], tokenizer_path)
    old = header(1).to_json()
    assert "sources" not in old and Manifest.from_json(old, "old").sources == ()
    manifest = dataclasses.replace(header(1), sources=tuple(stats.sources))
    loaded = Manifest.from_json(json.loads(json.dumps(manifest.to_json())), "new")
    assert loaded.sources == manifest.sources and loaded.identity == manifest.identity
    assert f"source     {a}: 2 records read, 1 duplicates dropped, 1 used -> 1 documents" in "\n".join(
        loaded.describe()
    )
    broken = {**manifest.to_json(), "sources": [{"source": "a.jsonl", "records": -1}]}
    with pytest.raises(DflashError, match=r"field sources\[0\]\.weight is missing"):
        Manifest.from_json(broken, "broken")


def test_documents_are_views_of_an_unlinked_token_file(tmp_path, tokenizer_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    path = _write(tmp_path / "a.jsonl", RECORDS)
    documents, stats = _load(path, tokenizer_path, spill_dir=spill)
    assert all(isinstance(d.input_ids, np.memmap) and isinstance(d.loss_mask, np.memmap) for d in documents)
    assert documents[0].input_ids.dtype == np.int32 and documents[0].loss_mask.dtype == np.uint8
    assert sum(len(d.input_ids) for d in documents) == stats.tokens and not list(spill.iterdir())
    assert documents[0].input_ids.flags.writeable  # copy-on-write maps: torch.from_numpy takes them as they are


def test_mixing_holds_no_record_in_memory(tmp_path):
    """Tens of MB of records: the mixing pass and the reading of the chosen records stay far below the file's size."""
    import tracemalloc

    from dflash.data import _parse_document
    from dflash.data.sources import mix

    filler = "x" * 5000
    records = [{"text": f"{i} {filler}"} for i in range(5000)] + [{"text": f"0 {filler}"}]  # one copy
    path = _write(tmp_path / "big.jsonl", records)
    size = (tmp_path / "big.jsonl").stat().st_size
    tracemalloc.start()
    try:
        mixture = mix([f"{path}:1.5"], _parse_document, seed=3)
        mixing_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        wanted = np.unique(mixture.order)
        read = sum(1 for _ in mixture.read(wanted))
        reading_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert size > 25e6 and len(mixture.order) == 7500 and read == len(wanted) == 5000
    # Holding the records would take more than the file's size; 17 bytes a record, a line and buffers are < 2 MB.
    assert mixing_peak < size / 10 and reading_peak < size / 10, (mixing_peak, reading_peak, size)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_records_stopped_early_without_zstandard_installed(tmp_path, monkeypatch):
    # zstandard's error class is named in an except clause, evaluated also when a reader stops early (the
    # generator closed): without zstandard (the GPU machine's case) that must not raise an ImportError.
    monkeypatch.setitem(__import__("sys").modules, "zstandard", None)  # `import zstandard` raises ImportError
    records = iter_records([_write(tmp_path / "a.jsonl", RECORDS)])
    next(records)
    records.close()
