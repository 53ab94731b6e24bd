"""Each method's export against docs/export.md (the keys and tensors the engines read, written down from their
sources), and reloaded through transformers' AutoModel (our modeling file) and our own loader to the trained
drafter's outputs, logits and selector scores."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from test_dflash2 import dflash2_config, randomise
from test_drafter import small_config
from test_dspark import dspark_config, dspark_drafter
from test_export import drafter, inputs

from dflash.export import export_drafter, load_drafter
from dflash.methods.dflash2 import DFlash2Drafter
from dflash.methods.dspark import DSparkDrafter

DOC = Path(__file__).resolve().parent.parent / "docs" / "export.md"

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def doc_section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def doc_table(section: str, header: str) -> list[str]:
    """The backticked first cells of the table whose header row starts with `header`."""
    rows, inside = [], False
    for line in section.splitlines():
        if line.startswith(f"| {header} |"):
            inside = True
        elif inside and line.startswith("|"):
            rows += re.findall(r"^\| `([^`]+)`", line)
        elif inside:
            inside = False
    return rows


def resolve(config: dict, path: str) -> bool:
    head, _, rest = path.partition(".")
    return head in config and (not rest or resolve(config[head], rest))


def documented(sections: list[str], num_layers: int) -> tuple[list[str], list[str]]:
    keys, tensors = [], []
    for title in sections:
        section = doc_section(title)
        keys += doc_table(section, "key")
        tensors += doc_table(section, "tensor")
    expanded = sorted(t.replace("{i}", str(i)) for t in tensors for i in range(num_layers if "{i}" in t else 1))
    return keys, expanded


def dflash2_trained(cfg):
    torch.manual_seed(0)
    return randomise(DFlash2Drafter(cfg), seed=0).eval()


def dspark_trained(cfg):
    return dspark_drafter(cfg, seed=0).float().eval()


CASES = {
    "dflash": (lambda: small_config(), lambda cfg: drafter(cfg).float(), ["DFlash ("]),
    "dflash2": (lambda: dflash2_config(sliding_window=8), dflash2_trained, ["DFlash (", "DFlash 2"]),
    "dspark": (lambda: dspark_config(num_anchors=5), dspark_trained, ["DFlash (", "DSpark"]),
}


@pytest.mark.parametrize("method", sorted(CASES))
def test_export_has_exactly_the_documented_keys_and_tensors(method, tmp_path):
    from safetensors import safe_open

    make_config, make_model, sections = CASES[method]
    cfg = make_config()
    folder = export_drafter(make_model(cfg), cfg, tmp_path / "d", dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    keys, tensors = documented(sections, cfg.num_layers)
    assert keys and tensors
    assert [k for k in keys if not resolve(config, k)] == []
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == tensors
    assert config["architectures"] == [cfg.architecture]


@pytest.mark.parametrize("method", sorted(CASES))
def test_every_method_exports_sliding_layers_as_not_causal(method, tmp_path):
    """z-lab's class, vLLM and SGLang make `sliding_attention` layers causal unless config.json says `is_causal:
    false`: without it every engine would load a windowed drafter with a causal block."""
    make_config, make_model, _ = CASES[method]
    cfg = dataclasses.replace(make_config(), sliding_window=8)
    folder = export_drafter(make_model(cfg), cfg, tmp_path / "d", dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] * cfg.num_layers and config["is_causal"] is False


@pytest.mark.parametrize("window", [None, 8])
def test_a_dflash_window_is_in_the_keys_the_engines_read_and_reloads(window, tmp_path):
    """--method dflash --drafter-option sliding_window=N: the layer types, the window and transformers' switch."""
    cfg = small_config(sliding_window=window)
    folder = export_drafter(drafter(cfg).float(), cfg, tmp_path / "d", dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    kind = "full_attention" if window is None else "sliding_attention"
    assert config["layer_types"] == [kind] * cfg.num_layers
    assert config["sliding_window"] == window and config["use_sliding_window"] is (window is not None)
    assert load_drafter(folder)[1] == cfg


def test_dflash2_export_reloads_to_the_trained_outputs(tmp_path):
    """AutoModel (trust_remote_code) and load_drafter both give the trained drafter's block states, unary logits
    and edge scores within 1e-5 in float32."""
    from transformers import AutoModel

    cfg = dflash2_config(sliding_window=8, input_embedding_scale=1.25, output_multiplier=0.8)
    ours = dflash2_trained(cfg).float()
    folder = export_drafter(ours, cfg, tmp_path / "d", dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlash2DraftModel"}
    assert config["layer_types"] == ["sliding_attention"] * cfg.num_layers and config["sliding_window"] == 8
    model, info = AutoModel.from_pretrained(
        folder, trust_remote_code=True, output_loading_info=True, dtype=torch.float32
    )
    assert type(model).__name__ == "DFlash2DraftModel"
    assert {k: v for k, v in info.items() if v} == {}, info
    loaded, loaded_cfg = load_drafter(folder)
    assert loaded_cfg == cfg and type(loaded) is DFlash2Drafter
    embeds, features, q_pos, ctx_pos, visible = inputs(cfg)
    g = torch.Generator().manual_seed(3)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    previous = torch.randint(0, cfg.vocab_size, (embeds.shape[0] * cfg.block_size,), generator=g)
    with torch.no_grad():
        for mask in (None, visible):
            want = ours(embeds, features, q_pos, ctx_pos, mask)
            for other in (model, loaded):
                got = other(embeds, features, q_pos, ctx_pos, mask)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            flat = want.flatten(0, 1)
            unary = (flat * cfg.output_multiplier) @ head.T
            torch.testing.assert_close(model.unary_logits(flat, head), unary, rtol=1e-5, atol=1e-5)
            top = unary.topk(cfg.selector_top_k)
            scores = ours.candidate_selector.edge_scores(flat, top.values, previous, top.indices)
            for other in (model, loaded):
                got = other.candidate_selector.edge_scores(flat, top.values, previous, top.indices)
                torch.testing.assert_close(got, scores, rtol=1e-5, atol=1e-5)


def test_dspark_export_reloads_to_the_trained_logits(tmp_path):
    """AutoModel (trust_remote_code) and load_drafter both give the trained DSpark drafter's block states, Markov
    logits and confidence logits within 1e-5 in float32."""
    from transformers import AutoModel

    cfg = dspark_config(num_anchors=5)
    ours = dspark_trained(cfg)
    folder = export_drafter(ours, cfg, tmp_path / "d", dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.Qwen3DSparkModel"}
    model, info = AutoModel.from_pretrained(
        folder, trust_remote_code=True, output_loading_info=True, dtype=torch.float32
    )
    assert type(model).__name__ == "Qwen3DSparkModel"
    assert {k: v for k, v in info.items() if v} == {}, info
    loaded, loaded_cfg = load_drafter(folder)
    assert loaded_cfg == cfg and type(loaded) is DSparkDrafter
    embeds, features, q_pos, ctx_pos, visible = inputs(cfg)
    g = torch.Generator().manual_seed(3)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    with torch.no_grad():
        for mask in (None, visible):
            want = ours(embeds, features, q_pos, ctx_pos, mask)
            flat = want.flatten(0, 1)
            previous = torch.randint(0, cfg.vocab_size, (flat.shape[0],), generator=g)
            e = ours.markov_head.markov_w1(previous)
            logits = flat @ head.T + ours.markov_head.markov_w2(e)
            confidence = ours.confidence_head(flat, e)
            for other in (model, loaded):
                torch.testing.assert_close(other(embeds, features, q_pos, ctx_pos, mask), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.markov_logits(flat, previous, head), logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.confidence_logits(flat, previous), confidence, rtol=1e-5, atol=1e-5)
            loaded_e = loaded.markov_head.markov_w1(previous)
            torch.testing.assert_close(loaded.confidence_head(flat, loaded_e), confidence, rtol=1e-5, atol=1e-5)


def test_dspark_export_with_the_target_embeddings_holds_them_under_deepspecs_names(tmp_path):
    """DeepSpec's evaluator loads `Qwen3DSparkModel.from_pretrained(drafter)`, whose own `embed_tokens` and
    `lm_head` stay random unless the file holds them: `target_embeddings` writes the target's under those names.
    Our loaders take such a folder and leave them out (dflash applies the target's own)."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    from dflash.errors import DflashError

    cfg = dspark_config(num_anchors=5)
    ours = dspark_trained(cfg)
    g = torch.Generator().manual_seed(0)
    embed, head = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) for _ in range(2))
    plain = export_drafter(ours, cfg, tmp_path / "plain", dtype=torch.float32)
    folder = export_drafter(ours, cfg, tmp_path / "d", dtype=torch.float32, target_embeddings=(embed, head))
    saved, without = load_file(folder / "model.safetensors"), load_file(plain / "model.safetensors")
    assert sorted(set(saved) - set(without)) == ["embed_tokens.weight", "lm_head.weight"]
    assert torch.equal(saved["embed_tokens.weight"], embed) and torch.equal(saved["lm_head.weight"], head)
    model, info = AutoModel.from_pretrained(
        folder, trust_remote_code=True, output_loading_info=True, dtype=torch.float32
    )
    assert {k: v for k, v in info.items() if v} == {}, info
    loaded, loaded_cfg = load_drafter(folder)
    assert loaded_cfg == cfg and sorted(loaded.state_dict()) == cfg.checkpoint_keys()
    with pytest.raises(DflashError, match=r"embedding is \(11, 32\), the drafter.s target has \(12, 32\)"):
        export_drafter(ours, cfg, tmp_path / "bad", target_embeddings=(embed[:11], head))
