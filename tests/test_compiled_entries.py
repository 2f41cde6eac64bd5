"""`compile` in the entry points beside generate: a batch line, a server request (on a server whose
operator lets requests compile: lmtrace serve --compile) and `branch` decode with the compiled
step exactly as generate(compile=True) does; without the operator's opt-in a request's compile is
a 400 naming it and how to allow it. One setting (greedy, batch 1) throughout, so the tiny model's
compiled step is built once for the whole file (torch.compile on a CPU takes tens of seconds)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

import lmtrace
from lmtrace.batch.job import run_job
from lmtrace.batch.local import local_engine
from lmtrace.cli import main
from lmtrace.decode import static
from lmtrace.server import create_app
from tests.composability import ALONE_TOL, comparable, differences, uncompiled
from tests.same_record import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")
BASE = {"max_new_tokens": 4, "temperature": 0, "top_logprobs": 2, "stop_on_eos": False}
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def compiled_reference(tiny_lm) -> dict:
    return lmtrace.generate(tiny_lm, PROMPT, compile=True, **BASE).to_dict()


def same(got: dict, want: dict, tol: float = ALONE_TOL) -> None:
    found = differences(comparable(got), comparable(want), tol)
    assert not found, found[:4]


def test_a_batch_line_with_compile_decodes_alone_as_generate(tmp_path, tiny_lm, compiled_reference):
    lines = [{"id": "c", "prompt": PROMPT, "compile": True, **BASE}, {"id": "p", "prompt": "Hello world", **BASE}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    run_job(src, out, local_engine(lambda: tiny_lm, {}, 4))
    got = {r["id"]: r["trace"] for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    same(got["c"], compiled_reference)
    assert got["c"]["model"]["config"]["compile"] == static.described(static.STEP, "cpu")
    assert "compile" not in got["p"]["model"]["config"]  # the batch's own rows are not compiled
    same(got["p"], lmtrace.generate(tiny_lm, "Hello world", **BASE).to_dict(), 5e-5)


def test_a_request_decodes_compiled_on_a_server_that_allows_it(tiny_lm, compiled_reference):
    with TestClient(create_app(tiny_lm, name="tiny", compile=True)) as client:
        body = {"prompt": PROMPT, "compile": True, "max_tokens": 4, "temperature": 0, "top_logprobs": 2}
        body["ignore_eos"] = True
        answer = client.post("/v1/traces", json=body)
        assert answer.status_code == 200, answer.text
        got = answer.json()
        assert got["model"]["config"]["compile"] == compiled_reference["model"]["config"]["compile"]
        same(
            {k: v for k, v in got.items() if k != "model"},
            {k: v for k, v in compiled_reference.items() if k != "model"},
        )
        # the options the compiled forward cannot carry are refused in one line naming both
        refused = client.post("/v1/traces", json={**body, "lens": True})
        assert refused.status_code == 400 and {"compile", "lens"} <= set(refused.json()["error"]["message"].split())


def test_a_servers_requests_may_not_compile_without_the_operators_opt_in(tiny_lm):
    with TestClient(create_app(tiny_lm, name="tiny")) as client:
        answer = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "compile": True})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "compile" and "lmtrace serve --compile" in error["message"]


def test_branch_compiled_equals_branch_within_the_compiled_bound(tiny_lm):
    """The original and each branch on the compiled forward over one static cache, cut back at the fork."""
    plain = lmtrace.branch(tiny_lm, PROMPT, at=1, fan=2, **BASE)
    fast = lmtrace.branch(tiny_lm, PROMPT, at=1, fan=2, compile=True, **BASE)
    assert [t.token_ids for t in fast.traces] == [t.token_ids for t in plain.traces]
    for a, b in zip(plain.traces, fast.traces):
        same(uncompiled(b.to_dict()), uncompiled(a.to_dict()), 5e-5)
        assert b.model["config"]["compile"] == static.described(static.FORWARD, "cpu")


@pytest.mark.parametrize("extra", [["--batch-invariant"], ["--matmul", "onednn"]])
def test_serve_compile_refuses_what_chooses_other_kernels_before_loading(capsys, extra):
    assert main(["serve", "--model", "/nonexistent/model", "--compile", *extra]) == 2
    err = capsys.readouterr().err
    assert "compile: --compile chooses its own kernels" in err and "Traceback" not in err


def test_serve_compile_on_onednn_needs_a_draft_of_its_own(capsys, monkeypatch, tmp_path, tiny_tok):
    """`serve --matmul onednn --compile` is refused before loading without a draft and with
    `layers:N` (the target's own layers); with `--draft packed` the server starts, letting
    requests compile (the draft's step)."""
    from tests.tiny_gguf import write_tiny_gguf

    for draft in ([], ["--draft", "layers:1"]):
        assert main(["serve", "--model", "/nonexistent", "--matmul", "onednn", "--compile", *draft]) == 2
        err = capsys.readouterr().err
        assert "compile: --compile chooses its own kernels; not with --matmul onednn" in err and "Traceback" not in err
    monkeypatch.setenv("LMTRACE_GGUF_CACHE", "0")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_tok, qtype="Q4_1")
    apps = []
    monkeypatch.setattr("lmtrace.server.run.Runner.run", lambda runner: apps.append(runner.server.config.app))
    assert main(["serve", "--model", str(path), "--matmul", "onednn", "--compile", "--draft", "packed"]) == 0
    assert apps[0].state.lmtrace.compile is True


def test_serve_compile_lets_requests_compile(monkeypatch, tiny_dir):
    apps = []
    monkeypatch.setattr("lmtrace.server.run.Runner.run", lambda runner: apps.append(runner.server.config.app))
    assert main(["serve", "--model", str(tiny_dir), "--compile"]) == 0
    assert main(["serve", "--model", str(tiny_dir)]) == 0
    assert [app.state.lmtrace.compile for app in apps] == [True, False]
    # the schema says so: a server without --compile takes `compile: false` only
    schema = apps[1].openapi()["components"]["schemas"]["TraceRequest"]["properties"]["compile"]
    assert schema["const"] is False
    assert apps[0].openapi()["components"]["schemas"]["TraceRequest"]["properties"]["compile"]["type"] == "boolean"


def test_generate_compile_with_onednn_compiles_a_packed_draft_only(capsys, monkeypatch, tmp_path, tiny_tok):
    """`lmtrace generate --matmul onednn --compile` is refused before loading (the target's
    kernels), `layers:N` too (the target's layers); with `--draft packed` the draft's own step
    compiles and the target verifies on oneDNN (the trace names it)."""
    from tests.tiny_gguf import write_tiny_gguf

    monkeypatch.setenv("LMTRACE_GGUF_CACHE", "0")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_tok, qtype="Q4_1")
    for draft in ([], ["--draft", "layers:1"]):
        assert main(["generate", "x", "--model", "/nonexistent", "--matmul", "onednn", "--compile", *draft]) == 2
        err = capsys.readouterr().err
        assert "compile: --compile chooses its own kernels; not with --matmul onednn" in err and "Traceback" not in err
    out = tmp_path / "t.json"
    fast = "--matmul onednn --compile --draft packed --draft-tokens auto --max-new-tokens 4 --temperature 0".split()
    args = ["generate", "Hello", "--model", str(path), *fast, "--json", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    config = json.loads(out.read_text())["model"]["config"]
    assert config["compile"] == static.described(static.DRAFT, "cpu") and config["matmul"].startswith("onednn")
