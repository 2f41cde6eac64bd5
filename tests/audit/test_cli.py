"""`lmtrace audit` on the command line: exit 0 when every probe passes, 1 when one fails, and 2
with one line on stderr naming the parameter for bad input, an unreachable server, a refused
key, or a server that serves another model; the JSON and HTML reports."""

from __future__ import annotations

import json

import pytest

from lmtrace.cli import main
from lmtrace.server import create_app
from tests.audit.buggy import buggy_app
from tests.server.conftest import RunningServer
from tests.server.process import free_port


@pytest.fixture(scope="module")
def served(chat_lm):
    with RunningServer(create_app(chat_lm, name="tiny", api_key="sesame")) as server:
        yield server


def bad_input(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    # the status lines of a model load may come first (the loading line, "ready in"); the error is one line
    errors = [line for line in err.splitlines() if line.startswith("lmtrace: error: ")]
    assert len(errors) == 1 and err.endswith(errors[0] + "\n") and "Traceback" not in err, err
    return errors[0]


def test_bad_input_is_one_line_and_exit_2(capsys, served, chat_dir, tmp_path):
    url = served.url
    model = ["--model", str(chat_dir), "--api-key", "sesame"]
    assert "url: cannot reach" in bad_input(capsys, ["audit", f"http://127.0.0.1:{free_port()}"])
    assert "url must start with http" in bad_input(capsys, ["audit", "localhost:8000"])
    assert "refused the key (HTTP 401" in bad_input(capsys, ["audit", url, "--api-key", "wrong"])
    assert "needs an API key" in bad_input(capsys, ["audit", url, "--model", str(chat_dir)])
    assert "served-model: " in bad_input(capsys, ["audit", url, *model, "--served-model", "gpt-5"])
    assert "probe: unknown 'logprob'" in bad_input(capsys, ["audit", url, *model, "--probe", "logprob"])
    assert "tolerance must be" in bad_input(capsys, ["audit", url, *model, "--tolerance", "-1"])
    assert "html: no such folder" in bad_input(capsys, ["audit", url, *model, "--html", str(tmp_path / "no/a.html")])


def test_a_server_that_serves_another_model_is_bad_input(capsys, other_lm, chat_dir):
    with RunningServer(create_app(other_lm, name="other")) as server:
        err = bad_input(capsys, ["audit", server.url, "--model", str(chat_dir)])
    assert "model: the server ('other'" in err and "it serves another model" in err, err


def test_report_and_exit_codes(capsys, served, chat_dir, chat_lm, tmp_path):
    args = ["--model", str(chat_dir), "--api-key", "sesame", "--probe", "usage", "--probe", "logprobs"]
    html = tmp_path / "audit.html"
    assert main(["audit", served.url + "/v1/", *args, "--json", "-", "--html", str(html), "--no-color"]) == 0
    out = capsys.readouterr()
    d = json.loads(out.out)
    assert (d["server"], d["served_model"], d["model"]) == (served.url, "tiny", str(chat_dir))
    assert [(p["name"], p["status"]) for p in d["probes"]] == [("usage", "pass"), ("logprobs", "pass")]
    assert all(set(p) >= {"name", "status", "detail", "figures"} for p in d["probes"])
    assert d["summary"] == {"pass": 2, "fail": 0, "skip": 0}
    page = html.read_text(encoding="utf-8")
    assert 'id="usage"' in page and 'id="logprobs"' in page and "sesame" not in page + out.out + out.err
    assert "2 pass, 0 fail, 0 skip" in out.err
    inner = create_app(chat_lm, name="tiny")
    with RunningServer(buggy_app(inner, "wrong_usage")) as server:
        assert main(["audit", server.url, "--model", str(chat_dir), "--probe", "usage", "--json", "-"]) == 1
    d = json.loads(capsys.readouterr().out)
    (probe,) = d["probes"]
    assert probe["status"] == "fail" and "usage.completion_tokens is 13, the tokenizer counts 12" in probe["detail"]
    assert probe["evidence"]["request"]["body"]["prompt"] and probe["evidence"]["curl"].startswith("curl -s ")
    inner.state.lmtrace.worker.shutdown()
