"""Corrupted model files and broken folders: each gives one line naming the file, without a
crash, a hang (a timeout) or a large allocation (an address-space limit), all cases in one
child process so that torch is imported once."""

from __future__ import annotations

import json
import resource
import struct
import subprocess
import sys

import pytest

from tests.cli_errors import one_error
from tests.test_loading import small_gguf

MEMORY_LIMIT = 3 * 1024**3  # bytes of address space for the child, torch included
CHILD = """
import json, sys
import lmtrace
from lmtrace import ModelLoadError
from tests.cli_errors import one_error
out = {}
for name, path in json.loads(sys.argv[1]).items():
    try:
        lmtrace.load(path)
        out[name] = "LOADED"
    except ModelLoadError as e:
        out[name] = str(e)
    except Exception as e:
        out[name] = "UNEXPECTED " + type(e).__name__ + ": " + str(e)
print(json.dumps(out))
"""


def first_kv_end(data: bytes) -> int:
    """End offset of the first metadata entry (a string value) after the 24-byte header."""
    klen = struct.unpack_from("<Q", data, 24)[0]
    vtype = struct.unpack_from("<I", data, 32 + klen)[0]
    assert vtype == 8  # a string, as GGUFWriter writes general.architecture first
    vlen = struct.unpack_from("<Q", data, 36 + klen)[0]
    return 44 + klen + vlen


def gguf_cases(tmp_path) -> dict[str, tuple[bytes, str]]:
    data = small_gguf(tmp_path / "good.gguf").read_bytes()
    tensors, keys = struct.unpack_from("<QQ", data, 8)
    name = data.find(b"token_embd.weight")
    offset_at = name + len(b"token_embd.weight") + 4 + 8 * 2 + 4
    return {
        "wrong magic": (b"GGML" + data[4:], "not a GGUF file"),
        "empty file": (b"", "truncated GGUF header"),
        "unsupported version": (data[:4] + struct.pack("<I", 99) + data[8:], "unsupported GGUF version 99"),
        "truncated header": (data[:10], "truncated GGUF header"),
        "truncated tensor data": (data[:-100], "past the end of the file"),
        "absurd tensor count": (data[:8] + struct.pack("<Q", 2**40) + data[16:], "more than a file of"),
        "absurd key count": (data[:16] + struct.pack("<Q", 2**62) + data[24:], "more than a file of"),
        "absurd key length": (data[:24] + struct.pack("<Q", 2**60) + data[32:], "corrupt or truncated GGUF file"),
        "tensor offset beyond the end": (
            data[:offset_at] + struct.pack("<Q", 10**12) + data[offset_at + 8 :],
            "past the end of the file",
        ),  # fmt: skip
        "duplicate key": (
            data[:16] + struct.pack("<Q", keys + 1) + data[24 : first_kv_end(data)] + data[24:],
            "duplicate metadata key",
        ),  # fmt: skip
    }


def folder_cases(tmp_path, tiny_dir) -> dict[str, tuple[object, str]]:
    config = (tiny_dir / "config.json").read_text()
    custom = json.loads(config) | {"auto_map": {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}}
    return {
        "config missing": ({"model.safetensors": b""}, "no config.json"),
        "invalid JSON": ({"config.json": b"{not json", "model.safetensors": b""}, "not valid JSON"),
        "config not an object": ({"config.json": b"[1, 2]", "model.safetensors": b""}, "expected a JSON object"),
        "weights missing": ({"config.json": config.encode()}, "no weights"),
        "pickle only": ({"config.json": config.encode(), "pytorch_model.bin": b"\x80\x04K\x01."}, "allow_pickle"),
        "custom code": (
            {"config.json": json.dumps(custom).encode(), "modeling_evil.py": b"import os\n"},
            "trust_remote_code",
        ),  # fmt: skip
    }


def test_every_corrupted_file_and_broken_folder_fails_cleanly(tmp_path, tiny_dir):
    paths, expected = {}, {}
    for name, (blob, reason) in gguf_cases(tmp_path).items():
        path = tmp_path / (name.replace(" ", "-") + ".gguf")
        path.write_bytes(blob)
        paths[name], expected[name] = str(path), reason
    for name, (files, reason) in folder_cases(tmp_path, tiny_dir).items():
        folder = tmp_path / name.replace(" ", "-")
        folder.mkdir()
        for fname, blob in files.items():
            (folder / fname).write_bytes(blob)
        paths[name], expected[name] = str(folder), reason

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(paths)], capture_output=True, text=True,
                         timeout=180, preexec_fn=limit)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results) == 16
    for name, message in results.items():
        assert "\n" not in message, name
        assert paths[name] in message, (name, message)
        assert expected[name] in message, (name, message)


@pytest.mark.parametrize("command", ["generate", "kv-size"])
def test_cli_on_a_corrupt_gguf_is_exit_2(tmp_path, capsys, command):
    from lmtrace.cli import main

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\x00" * 4)
    args = ["generate", "x", "--model", str(bad)] if command == "generate" else ["kv-size", str(bad), "--context", "8"]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and str(bad) in one_error(err) and "truncated GGUF header" in one_error(err)
