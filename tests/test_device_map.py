"""--device-map auto: the model is placed by accelerate (here, with no GPU, all on the CPU)
and decodes as a model put on one device does."""

from __future__ import annotations

import json

import pytest

import lmtrace
from lmtrace.cli import main


def test_load_with_device_map_auto_decodes_the_same_tokens(tiny_dir):
    placed = lmtrace.load(tiny_dir, device_map="auto")
    plain = lmtrace.load(tiny_dir, device="cpu")
    assert placed.model.device.type == "cpu"  # the only device here
    a = lmtrace.generate(placed, "Hello world", temperature=0, max_new_tokens=6)
    b = lmtrace.generate(plain, "Hello world", temperature=0, max_new_tokens=6)
    assert a.token_ids == b.token_ids


def test_a_device_and_a_device_map_together_are_refused(tiny_dir):
    with pytest.raises(lmtrace.InvalidParameter, match="device_map: give a device or a device_map, not both"):
        lmtrace.load(tiny_dir, device="cpu", device_map="auto")


@pytest.mark.parametrize("command", ["generate", "batch"])
def test_cli_device_map_auto(command, tiny_dir, tmp_path, capsys):
    settings = ["--model", str(tiny_dir), "--device-map", "auto", "--temperature", "0", "--max-new-tokens", "3"]
    if command == "generate":
        assert main(["generate", "Hello", *settings, "--json", "-"]) == 0
        assert len(json.loads(capsys.readouterr().out)["steps"]) == 3
    else:
        src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        src.write_text('{"id": 1, "prompt": "Hello"}\n')
        assert main(["batch", str(src), str(out), *settings]) == 0
        assert len(json.loads(out.read_text())["trace"]["steps"]) == 3


def test_score_device_map_auto(tiny_dir, capsys):
    assert main(["score", "Hello world", "--model", str(tiny_dir), "--device-map", "auto", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"] > 0
