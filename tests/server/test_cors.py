"""CORS (lmtrace serve --allowed-origins, vLLM's options, Starlette's CORSMiddleware), with the
requests of llama.cpp's test_security.py::test_cors_options (OPTIONS /v1/completions with Origin,
Access-Control-Request-Method: POST and Access-Control-Request-Headers: Authorization): a page of
an allowed origin gets its preflight and its POST answered with vLLM's headers, another origin
gets no Access-Control-Allow-Origin; the preflight is answered before the key check (a POST
without the key is still 401) and after the Host check; none allowed by default."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from lmtrace.server import create_app

PAGE = "http://localhost:3000"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}
BODY = {"prompt": "I believe the meaning of life is", "max_tokens": 2}


def served(lm, **kw) -> TestClient:
    return TestClient(create_app(lm, name="tiny", **kw), base_url="http://127.0.0.1:8000")


@pytest.fixture(scope="module")
def keyed(chat_lm):
    with served(chat_lm, api_key="s3cret", allowed_origins=[PAGE, "https://web.mydomain.fr"]) as c:
        yield c


@pytest.mark.parametrize(
    ("origin", "header", "value"),
    [
        (PAGE, "Access-Control-Allow-Origin", PAGE),
        ("https://web.mydomain.fr", "Access-Control-Allow-Origin", "https://web.mydomain.fr"),
        (PAGE, "Access-Control-Allow-Methods", "POST"),  # "*": every method
        (PAGE, "Access-Control-Allow-Headers", "Authorization"),  # "*": the asked headers, mirrored
        (PAGE, "Access-Control-Max-Age", "600"),
    ],
)
def test_a_preflight_from_an_allowed_origin_needs_no_key(keyed, origin, header, value):
    r = keyed.options("/v1/completions", headers={**PREFLIGHT, "Origin": origin})
    assert r.status_code == 200 and value in [v.strip() for v in r.headers[header].split(",")]
    assert "access-control-allow-credentials" not in r.headers


def test_the_post_that_follows(keyed):
    ok = keyed.post("/v1/completions", json=BODY, headers={"Origin": PAGE, "Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.headers["Access-Control-Allow-Origin"] == PAGE
    # without the key: 401, which the page can read (the header is on the error too)
    refused = keyed.post("/v1/completions", json=BODY, headers={"Origin": PAGE})
    assert refused.status_code == 401 and refused.headers["Access-Control-Allow-Origin"] == PAGE
    assert refused.json()["error"]["code"] == "invalid_api_key"


def test_another_origin_gets_no_allow_origin(keyed):
    other = {**PREFLIGHT, "Origin": "https://evil.example"}
    r = keyed.options("/v1/completions", headers=other)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    keyed_other = {"Origin": other["Origin"], "Authorization": "Bearer s3cret"}
    post = keyed.post("/v1/completions", json=BODY, headers=keyed_other)
    assert "access-control-allow-origin" not in post.headers  # the browser keeps the answer from the page


def test_none_allowed_by_default_and_the_host_check_first(chat_lm):
    with served(chat_lm) as c:
        r = c.options("/v1/completions", headers=PREFLIGHT)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    with served(chat_lm, allowed_origins=["*"]) as c:
        r = c.options("/v1/completions", headers=PREFLIGHT)
        assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "*"
        rebound = c.options("/v1/completions", headers={**PREFLIGHT, "Host": "evil.example"})
        assert rebound.status_code == 421 and "access-control-allow-origin" not in rebound.headers


def test_credentials_and_narrower_methods(chat_lm):
    with served(chat_lm, allowed_origins=[PAGE], allowed_methods=["POST"], allowed_headers=["Authorization"],
                allow_credentials=True) as c:  # fmt: skip
        r = c.options("/v1/completions", headers=PREFLIGHT)
        assert r.status_code == 200 and r.headers["Access-Control-Allow-Credentials"] == "true"
        assert r.headers["Access-Control-Allow-Methods"] == "POST"
        assert c.options("/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Method": "DELETE"}
                         ).status_code == 400  # fmt: skip
    with pytest.raises(ValueError, match="allow_credentials cannot be combined with the origin '\\*'"):
        create_app(chat_lm, allowed_origins=["*"], allow_credentials=True)


def test_serve_passes_the_cors_options(tiny_dir, monkeypatch, capsys):
    from lmtrace.cli import main

    apps = []
    monkeypatch.setattr("lmtrace.server.run.Runner.run", lambda runner: apps.append(runner.server.config.app))
    # several values after one flag (DESIGN's ORIGIN...), vLLM's JSON list, a comma-separated one
    args = ["serve", "--model", str(tiny_dir), "--allowed-origins", PAGE, '["https://b.example"]',
            "--allowed-methods", "GET", "POST", "--allow-credentials",
            "--allowed-headers", "Authorization,X-Id"]  # fmt: skip
    assert main(args) == 0
    with TestClient(apps[0], base_url="http://127.0.0.1:8000") as c:
        for origin in (PAGE, "https://b.example"):
            r = c.options("/v1/completions", headers={**PREFLIGHT, "Origin": origin})
            assert r.headers["Access-Control-Allow-Origin"] == origin
            assert r.headers["Access-Control-Allow-Methods"] == "GET, POST"
            assert r.headers["Access-Control-Allow-Credentials"] == "true"
            allowed = {h.strip() for h in r.headers["Access-Control-Allow-Headers"].split(",")}
            assert {"Authorization", "X-Id"} <= allowed
    capsys.readouterr()
    assert main(["serve", "--model", str(tiny_dir), "--allowed-origins", "*", "--allow-credentials"]) == 2
    assert capsys.readouterr().err.strip() == (
        "lmtrace: error: allow_credentials cannot be combined with --allowed-origins '*': name the origins"
    )
