"""`lmtrace export` / lmtrace.model.folder.save_folder: a safetensors folder that transformers loads back to the
same logits, bit for bit: from a tiny GGUF written here, a tiny folder, a tied model, and the
bundled model (integration)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import lmtrace
from lmtrace.cli import main
from lmtrace.model.folder import save_folder
from tests.tiny import tiny_model
from tests.tiny_gguf import write_tiny_gguf

TEXT = "Hello world, 很久很久以前 🙂"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LMTRACE_CACHE", str(tmp_path / "cache"))


def same_logits(lm, folder) -> None:
    """transformers itself (not lmtrace.load) reads the folder; tokens and logits are identical."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()  # dtype from the folder's config
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = lm.tokenizer(TEXT, return_tensors="pt").input_ids
    assert torch.equal(tokenizer(TEXT, return_tensors="pt").input_ids, ids)
    assert tokenizer.chat_template == lm.tokenizer.chat_template
    with torch.no_grad():
        expected = lm.model(ids.to(lm.model.device)).logits.cpu()
        got = model(ids).logits
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert model.generation_config.eos_token_id == lm.model.generation_config.eos_token_id


def test_a_gguf_exports_to_its_own_logits(tmp_path, tiny_tok):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_tok)
    direct = lmtrace.load(gguf, dtype="float32", gguf_cache=False)
    out = save_folder(lmtrace.load(gguf, dtype="float32", gguf_cache=False), tmp_path / "out")
    assert out == tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float32"
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    same_logits(direct, out)


def test_save_folder_writes_a_bfloat16_model_as_it_runs(tmp_path, tiny_dir):
    lm = lmtrace.load(tiny_dir, dtype="bfloat16")
    out = save_folder(lm, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    same_logits(lm, out)


def test_tied_embeddings_are_stored_once_and_tied_again(tmp_path, tiny_tok):
    model = tiny_model(tiny_tok)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    lm = lmtrace.LM.from_objects(model, tiny_tok)
    out = save_folder(lm, tmp_path / "tied")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    same_logits(lm, out)


def test_an_existing_folder_is_refused_and_nothing_is_written(tmp_path, tiny_dir, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("the user's file")
    with pytest.raises(lmtrace.InvalidParameter, match="out_dir: .* is not empty"):
        save_folder(lmtrace.load(tiny_dir), out)
    assert main(["export", "--model", str(tiny_dir), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmtrace: error: out_dir:") and "is not empty" in err and len(err.splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]  # no temporary folder left either


def test_the_cli_exports_into_an_empty_folder(tmp_path, tiny_tok, capsys):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_tok)
    out = tmp_path / "empty"
    out.mkdir()
    assert main(["export", "--model", str(gguf), str(out), "--no-color"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"wrote {out} (") and "model.safetensors" in captured.out
    assert "tiny.gguf ready in" in captured.err and "(converted to safetensors once" in captured.err
    assert "Converting and de-quantizing" not in captured.err
    same_logits(lmtrace.load(gguf, dtype="float32", gguf_cache=False), out)


@pytest.mark.integration
def test_the_bundled_model_exports_to_its_own_logits(tmp_path, bundled_lm):
    out = save_folder(bundled_lm, tmp_path / "smollm2")
    same_logits(bundled_lm, out)
