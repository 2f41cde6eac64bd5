"""The GGUF → safetensors cache: a tiny GGUF written here converts once, later loads come from
the converted folder, and both give the direct GGUF load's logits bit for bit."""

from __future__ import annotations

import json
import os

import pytest
import torch

import lmtrace
from lmtrace.model.gguf import converted as gguf_cache
from tests.tiny_gguf import write_tiny_gguf

TEXT = "Hello world, 很久很久以前 🙂 naïve"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("LMTRACE_CACHE", str(root))
    monkeypatch.delenv("LMTRACE_GGUF_CACHE", raising=False)
    return root


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_tok):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_tok)


def logits(lm, text=TEXT):
    ids = lm.tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return ids, lm.model(ids).logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_load_equals_the_direct_load_bit_for_bit(cache, tiny_gguf, dtype):
    direct = lmtrace.load(tiny_gguf, dtype=dtype, gguf_cache=False)
    said: list[str] = []
    first = lmtrace.load(tiny_gguf, dtype=dtype, status=said.append)
    second = lmtrace.load(tiny_gguf, dtype=dtype, status=said.append)
    assert said[0].startswith("Converting tiny.gguf") and "converted to safetensors in" in said[1]
    assert said[2].startswith("tiny.gguf: from its converted copy in") and len(said) == 3
    ids, expected = logits(direct)
    for lm in (first, second):
        got_ids, got = logits(lm)
        assert torch.equal(got_ids, ids) and torch.equal(got, expected)  # bit for bit
        assert got.dtype == expected.dtype == getattr(torch, dtype)
        assert (lm.eos_token_ids, lm.pad_token_id, lm.summary) == (direct.eos_token_ids, direct.pad_token_id,
                                                                   direct.summary)  # fmt: skip
        assert lm.tokenizer.chat_template == direct.tokenizer.chat_template
        assert lm.tokenizer.decode(ids[0]) == direct.tokenizer.decode(ids[0])
        assert lm.source == str(tiny_gguf)  # traces name the file the user gave
    folders = [p for p in (cache / "gguf").iterdir() if p.is_dir()]
    assert [p.name for p in folders] == [gguf_cache.file_hash(tiny_gguf)]  # no temporary folder left
    record = json.loads((folders[0] / gguf_cache.RECORD).read_text())
    assert record["sha256"] == folders[0].name and record["source"] == "tiny.gguf"


def test_greedy_trace_is_the_same_from_the_cache(cache, tiny_gguf):
    params = lmtrace.SamplingParams(temperature=0, max_new_tokens=6, top_logprobs=3)
    direct = lmtrace.generate(lmtrace.load(tiny_gguf, gguf_cache=False), "Hello", params)
    cached = lmtrace.generate(lmtrace.load(tiny_gguf), "Hello", params)
    assert [s.token_id for s in cached.steps] == [s.token_id for s in direct.steps]
    assert [s.logprob for s in cached.steps] == [s.logprob for s in direct.steps]


def test_the_hash_is_remembered_by_path_size_and_mtime(cache, tiny_gguf, tmp_path, monkeypatch):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    reads: list[str] = []
    real = gguf_cache._sha256
    monkeypatch.setattr(gguf_cache, "_sha256", lambda p: reads.append(p.name) or real(p))
    digest = gguf_cache.file_hash(copy)
    assert gguf_cache.file_hash(copy) == digest and reads == ["copy.gguf"]  # the second call reads nothing
    with open(copy, "r+b") as f:  # a changed file: other bytes at the end, a new mtime
        f.seek(-4, os.SEEK_END)
        f.write(b"\x01\x02\x03\x04")
    os.utime(copy, ns=(1, 1))
    assert gguf_cache.file_hash(copy) != digest and reads == ["copy.gguf", "copy.gguf"]
    index = json.loads((cache / "gguf" / gguf_cache.HASHES).read_text())
    assert len([k for k in index if "copy.gguf" in k]) == 1  # the old version's entry is gone


def test_a_folder_from_other_versions_is_made_again(cache, tiny_gguf):
    lmtrace.load(tiny_gguf)
    folder = gguf_cache.folder_for(tiny_gguf)
    record = json.loads((folder / gguf_cache.RECORD).read_text())
    (folder / gguf_cache.RECORD).write_text(json.dumps({**record, "transformers": "0.0.1"}))
    assert gguf_cache.ready_folder(tiny_gguf) is None
    said: list[str] = []
    lm = lmtrace.load(tiny_gguf, status=said.append)
    assert said[0].startswith("Converting") and gguf_cache.ready_folder(tiny_gguf) == folder
    assert torch.equal(logits(lm)[1], logits(lmtrace.load(tiny_gguf, gguf_cache=False))[1])


def test_a_failed_conversion_leaves_nothing_behind(cache, tiny_gguf):
    def broken_load():
        raise RuntimeError("killed halfway")

    with pytest.raises(RuntimeError, match="killed halfway"):
        gguf_cache.converted(tiny_gguf, broken_load)
    assert [p.name for p in (cache / "gguf").iterdir()] == [gguf_cache.HASHES]


def test_an_unwritable_cache_falls_back_to_the_file(tmp_path, monkeypatch, tiny_gguf):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("LMTRACE_CACHE", str(blocker))
    said: list[str] = []
    lm = lmtrace.load(tiny_gguf, status=said.append)
    assert len(said) == 1 and "Cannot keep a converted copy of tiny.gguf" in said[0]
    assert torch.equal(logits(lm)[1], logits(lmtrace.load(tiny_gguf, gguf_cache=False))[1])


def test_the_cache_can_be_turned_off(cache, tiny_gguf, monkeypatch):
    monkeypatch.setenv("LMTRACE_GGUF_CACHE", "0")
    said: list[str] = []
    lmtrace.load(tiny_gguf, status=said.append)
    assert said == [] and not (cache / "gguf").exists()


def test_the_default_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("LMTRACE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert gguf_cache.cache_root() == tmp_path / "lmtrace"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert gguf_cache.cache_root() == tmp_path / "home" / ".cache" / "lmtrace"


# transformers' own read of the bundled GGUF (~45 s on 2 cores, shared with no other test): `make test-slow`;
# `make test` keeps the same check on a tiny GGUF (test_cached_load_equals_the_direct_load_bit_for_bit)
@pytest.mark.integration
@pytest.mark.slow
def test_the_bundled_model_from_the_cache_equals_the_gguf_bit_for_bit(bundled_lm):
    """bundled_lm comes through the converted copy (the user's cache, shared by the suite's runs
    and its subprocesses); the GGUF read by transformers itself is the oracle."""
    assert gguf_cache.ready_folder(lmtrace.model.load.bundled_gguf()) is not None
    direct = lmtrace.load(gguf_cache=False)
    for text in (TEXT, "The capital of France is"):
        ids, expected = logits(direct, text)
        got_ids, got = logits(bundled_lm, text)
        assert torch.equal(got_ids, ids) and torch.equal(got, expected)
    assert bundled_lm.tokenizer.chat_template == direct.tokenizer.chat_template
    assert (bundled_lm.eos_token_ids, bundled_lm.pad_token_id) == (direct.eos_token_ids, direct.pad_token_id)
    assert bundled_lm.source == direct.source == f"bundled:{lmtrace.model.load.bundled_gguf().name}"


def test_load_config_reads_the_converted_copy_when_there_is_one(cache, tiny_gguf):
    from lmtrace.model.load import load_config

    before = load_config(tiny_gguf).to_dict()
    lmtrace.load(tiny_gguf)
    after = load_config(tiny_gguf).to_dict()
    skip = {"_name_or_path", "quantization_config", "architectures", "transformers_version", "dtype"}
    assert {k: v for k, v in after.items() if k not in skip} == {k: v for k, v in before.items() if k not in skip}


def test_two_conversions_at_once_leave_one_good_folder(cache, tiny_gguf):
    """While one conversion runs, another (another process, in life) finishes first: the first
    keeps the finished folder, which a reader may already be loading, and drops its own."""

    def load_gguf():
        return lmtrace.load(tiny_gguf, dtype="float32", gguf_cache=False)

    def load_while_another_finishes():
        done = gguf_cache.converted(tiny_gguf, load_gguf)
        inode = (done / "model.safetensors").stat().st_ino
        finished.append(inode)
        return load_gguf()

    finished: list[int] = []
    folder = gguf_cache.converted(tiny_gguf, load_while_another_finishes)
    assert (folder / "model.safetensors").stat().st_ino == finished[0]  # the first finished folder stayed
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == sorted([folder.name, gguf_cache.HASHES])
    assert gguf_cache.ready_folder(tiny_gguf) == folder
