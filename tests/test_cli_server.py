"""`--server URL` on generate, score, branch and cache: the work runs on a live `lmtrace serve`
(a real uvicorn server in a thread, the tiny model) and the answer equals the local command's;
the client imports no torch; an unreachable server or another model is one clear line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lmtrace.cli import main
from lmtrace.server import create_app
from tests.server.conftest import RunningServer


@pytest.fixture(scope="module")
def server(tiny_lm, tiny_dir):
    with RunningServer(create_app(tiny_lm, name=tiny_dir.name)) as running:
        yield running


def run(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _same_steps(got: list[dict], want: list[dict]) -> None:
    assert [s["token_id"] for s in got] == [s["token_id"] for s in want]
    for g, w in zip(got, want):
        assert (g["text"], g["rank"]) == (w["text"], w["rank"])
        assert abs(g["logprob"] - w["logprob"]) < 1e-5
        assert [a["token_id"] for a in g["top"]] == [a["token_id"] for a in w["top"]]
        assert (g["kv"]["seq_len"], g["kv"]["bytes"]) == (w["kv"]["seq_len"], w["kv"]["bytes"])
        assert bool(g.get("attention")) == bool(w.get("attention")) and bool(g.get("lens")) == bool(w.get("lens"))


@pytest.mark.parametrize("extra", [["--temperature", "0"], ["--temperature", "0.8", "--seed", "3", "--top-k", "20"],
                                   ["--temperature", "0", "--lens", "--attention"]])  # fmt: skip
def test_generate_through_the_server_equals_the_local_trace(capsys, server, tiny_dir, tmp_path, extra):
    args = ["generate", "Hello world", "--max-new-tokens", "6", "--no-color", *extra]
    assert run(capsys, *args, "--model", tiny_dir, "--json", tmp_path / "local.json")[0] == 0
    code, out, err = run(capsys, *args, "--server", server.url, "--json", tmp_path / "remote.json")
    assert code == 0, err
    local, remote = (json.loads((tmp_path / f"{k}.json").read_text()) for k in ("local", "remote"))
    assert remote["text"] == local["text"] and remote["prompt"] == local["prompt"]
    assert remote["params"]["seed"] == local["params"]["seed"]
    _same_steps(remote["steps"], local["steps"])
    assert "finish:" in out and "ready in" not in err  # the same view; no model loaded here


def test_score_branch_and_cache_through_the_server(capsys, server, tiny_dir, tmp_path):
    for command in (["score", "Hello world, the quick"],
                    ["branch", "Hello world", "--at", "1", "--max-new-tokens", "4", "--temperature", "0"],
                    ["cache", "Hello world", "--max-new-tokens", "3", "--temperature", "0"]):  # fmt: skip
        assert run(capsys, *command, "--model", tiny_dir, "--json", tmp_path / "local.json")[0] == 0
        code, out, err = run(capsys, *command, "--server", server.url, "--json", tmp_path / "remote.json")
        assert code == 0, (command, err)
        local, remote = (json.loads((tmp_path / f"{k}.json").read_text()) for k in ("local", "remote"))
        if command[0] == "score":
            assert remote["token_ids"] == local["token_ids"]
            assert abs(remote["total_logprob"] - local["total_logprob"]) < 1e-4
        elif command[0] == "branch":
            for r, want in zip(remote["branches"], local["branches"], strict=True):
                _same_steps(r["steps"], want["steps"])
        else:
            assert remote["anatomy"] == local["anatomy"]
            assert [s["bytes"] for s in remote["steps"]] == [s["bytes"] for s in local["steps"]]


def test_the_server_from_the_environment_and_the_client_imports_no_torch(server, tmp_path):
    child = ("import json, sys; from lmtrace.cli import main; code = main(sys.argv[1:]); "
             "print(json.dumps([code, [m for m in ('torch', 'transformers') if m in sys.modules]]), file=sys.stderr)")
    out = tmp_path / "t.json"
    env = {"LMTRACE_SERVER": server.url, "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", child, "generate", "Hi", "--max-new-tokens", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, env={**env, "PYTHONPATH": ":".join(sys.path)})
    assert json.loads(done.stderr.strip().splitlines()[-1]) == [0, []], done.stderr
    assert len(json.loads(out.read_text())["steps"]) == 3


def test_unreachable_server_and_another_model_are_one_line(capsys, server, tiny_dir):
    from tests.server.process import free_port

    code, _, err = run(capsys, "generate", "Hi", "--server", f"http://127.0.0.1:{free_port()}")
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("lmtrace: error: server: cannot reach http://127.0.0.1:") and "lmtrace serve" in err
    code, _, err = run(capsys, "score", "Hi there", "--server", server.url, "--model", "other-model")
    assert code == 2 and err.count("\n") == 1
    assert "model: The model `other-model` does not exist; this server serves" in err
    code, _, err = run(capsys, "generate", "Hi", "--server", server.url, "--dtype", "bfloat16")
    assert (code, err) == (2, f"lmtrace: error: dtype: --dtype applies to a model loaded here; drop it with "
                              f"--server {server.url}\n")  # fmt: skip
    code, _, err = run(capsys, "generate", "Hi", "--server", "localhost:8000")
    assert (code, err) == (2, "lmtrace: error: server: expected an http:// or https:// URL, got 'localhost:8000'\n")
