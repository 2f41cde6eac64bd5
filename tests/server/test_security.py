"""The server's security: the Host header checked against DNS rebinding on loopback, the API
key on every route but /health, no way for a web page's form to run the model, and model
text that stays text in the viewer page (a script-injection payload through /v1/traces)."""

from __future__ import annotations

import base64
import re
import socket

import httpx
import pytest
from fastapi.testclient import TestClient

from lmtrace.model.lm import LM
from lmtrace.server import create_app
from lmtrace.server.security import split_host
from tests.server.conftest import RunningServer, sse_events
from tests.tiny import tiny_model

PAYLOAD = "</script><img src=x onerror=alert(1)>"


def envelope(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                  "param": None, "code": code}}  # fmt: skip


def test_split_host():
    assert split_host("LocalHost:8000") == ("localhost", 8000)
    assert split_host("[::1]:81") == ("[::1]", 81) and split_host("[::1]") == ("[::1]", None)
    assert split_host("127.0.0.1") == ("127.0.0.1", None)
    for bad in ("", ":80", "[::1", "[::1]x", "localhost:", "localhost:8o", "localhost:123456"):
        assert split_host(bad) is None, bad


def raw_get(port: int, head: str) -> bytes:
    """A GET /health written by hand, for Host headers an HTTP client would not send."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"GET /health {head}\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_the_host_header_on_loopback(chat_lm):
    app = create_app(chat_lm, name="tiny", allowed_hosts=["proxy.example"])
    with RunningServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        port = server.port
        good = [f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}", "proxy.example"]
        for host in good:
            assert c.get("/health", headers={"Host": host}).json() == {"status": "ok"}, host
        bad = [
            f"evil.example:{port}",  # a rebinding page's own name
            "evil.example",
            f"127.0.0.1:{port + 1}",  # another port: another server's origin
            "localhost",  # no port: port 80
            f"localhost.:{port}",
            f"127.0.0.2:{port}",
            f"localhost:{port}@evil.example",
        ]
        for host in bad:
            for method, path in (("GET", "/health"), ("GET", "/"), ("GET", "/v1/models"), ("POST", "/v1/completions")):
                r = c.request(method, path, headers={"Host": host}, json={"prompt": "Hi", "max_tokens": 1})
                envelope(r, 421, "invalid_host")
        assert app.state.lmtrace.worker.finished == 0  # none of them reached the model
        assert raw_get(port, "HTTP/1.0").startswith(b"HTTP/1.1 421 ")  # no Host header at all
        assert raw_get(port, f"HTTP/1.1\r\nHost: localhost:{port}\r\nConnection: close").startswith(b"HTTP/1.1 200 ")


def test_the_host_is_not_checked_off_loopback(chat_lm):
    """A request that arrived on another address (a server bound to 0.0.0.0 reached from the
    network) is not a rebinding attack on this machine's loopback: no check."""
    app = create_app(chat_lm, name="tiny")
    with TestClient(app, base_url="http://192.168.1.5:8000") as c:
        assert c.get("/health", headers={"Host": "lmtrace.example"}).status_code == 200
    with TestClient(app, base_url="http://127.0.0.1:8000") as c:
        envelope(c.get("/health", headers={"Host": "lmtrace.example"}), 421, "invalid_host")


def paths(routes) -> list[tuple[str, str]]:
    """(method, path) of every route served, path parameters filled in (routers included
    without a prefix, as create_app includes them)."""
    out = []
    for route in routes:
        if hasattr(route, "original_router"):  # FastAPI's wrapper of an included router
            out += paths(route.original_router.routes)
            continue
        path = re.sub(r"\{[^}]*\}", "x", route.path)
        out += [(m, path) for m in sorted(set(route.methods) - {"HEAD"})]
    return out


def test_the_key_on_every_route_but_health(chat_lm):
    app = create_app(chat_lm, name="tiny", api_key="s3cret")
    routes = paths(app.routes)
    assert {("GET", "/"), ("GET", "/health"), ("POST", "/v1/traces"), ("GET", "/v1/models/x")} <= set(routes)
    basic = "Basic " + base64.b64encode(b"anyone:s3cret").decode()
    wrong_basic = "Basic " + base64.b64encode(b"s3cret:wrong").decode()
    with TestClient(app) as c:
        for method, path in [*routes, ("GET", "/v1/nothing"), ("GET", "/nothing")]:
            if path == "/health":
                assert c.get(path).status_code == 200
                continue
            for auth in (None, "Bearer wrong", wrong_basic, "Basic !!!", "s3cret"):
                r = c.request(method, path, headers={"Authorization": auth} if auth else {})
                envelope(r, 401, "invalid_api_key")
                assert "s3cret" not in r.text
        # a browser opening the page is asked for the key (as a password); API clients are not
        assert c.get("/").headers["WWW-Authenticate"].startswith("Basic ")
        assert c.get("/v1/models").headers["WWW-Authenticate"] == "Bearer"
        for auth in ("Bearer s3cret", basic):
            assert c.get("/", headers={"Authorization": auth}).status_code == 200
            assert c.get("/v1/models", headers={"Authorization": auth}).status_code == 200
            r = c.post("/v1/traces", json={"prompt": "Hi", "max_tokens": 1}, headers={"Authorization": auth})
            assert r.status_code == 200


def test_a_web_form_cannot_run_the_model(chat_lm):
    """A page on another site can post a form (text/plain, no preflight) whose body looks like
    JSON, or fetch() a Blob without a type (no Content-Type at all); the server reads JSON only
    from a JSON content type, so nothing runs."""
    app = create_app(chat_lm, name="tiny")
    with TestClient(app) as c:
        form = '{"prompt": "Hi", "max_tokens": 1, "x": "="}'
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            r = c.post("/v1/completions", content=form, headers={"content-type": kind} if kind else {})
            assert ("content-type" in r.request.headers) == (kind is not None)
            assert r.status_code == 400 and r.json()["error"]["message"] == "the request body must be a JSON object"
        assert app.state.lmtrace.worker.finished == 0


@pytest.fixture(scope="module")
def payload_lm(tiny_tok):
    """A tiny model that, after any prompt of two tokens or more, writes PAYLOAD token by token."""
    ids = tiny_tok(PAYLOAD, add_special_tokens=False)["input_ids"]
    model, state = tiny_model(tiny_tok), {"k": 0}

    def force(module, args, kwargs, output):
        state["k"] = 0 if kwargs["input_ids"].shape[1] > 1 else state["k"] + 1  # prefill starts over
        logits = output.logits[:, -1, :]
        logits.fill_(-10.0)
        logits[:, ids[min(state["k"], len(ids) - 1)]] = 10.0

    model.register_forward_hook(force, with_kwargs=True)
    return LM.from_objects(model, tiny_tok, source="tiny-payload"), len(ids)


def test_model_text_stays_text_in_the_viewer(payload_lm):
    lm, n = payload_lm
    with TestClient(create_app(lm, name="tiny")) as c:
        page = c.get("/")
        body = {"prompt": "Hello world", "max_tokens": n, "temperature": 0, "top_logprobs": 3}
        r = c.post("/v1/traces", json=body)
        assert r.headers["content-type"] == "application/json" and r.json()["text"] == PAYLOAD
        assert "".join(s["text"] for s in r.json()["steps"]) == PAYLOAD
        streamed = c.post("/v1/traces", json={**body, "stream": True})
        assert streamed.headers["content-type"].startswith("text/event-stream")
        steps = [e["step"]["text"] for e in sse_events(streamed.text) if e["object"] == "trace.step"]
        assert "".join(steps) == PAYLOAD  # as JSON strings, for the page's JSON.parse
        assert c.get("/").text == page.text  # the page is static: no model text is ever put into it

    html = page.text
    csp = page.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src 'unsafe-inline'" in csp and "http" not in csp
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    script = html[html.index("<script>") : html.index("</script>")]
    # no way in the page's script to turn a string into markup or code
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "Function(",
                 "setAttribute", ".src", ".href", "srcdoc", "DOMParser", "createContextualFragment"):  # fmt: skip
        assert sink not in script, sink
    # the model's text and the alternatives' tooltip go in by textContent
    assert re.search(r"span\.textContent = step\.text\b", script)
    assert "span.dataset.tip = tipText(step)" in script and "tip.textContent = t.dataset.tip" in script
    assert '$("status").textContent = text' in script


def test_serve_passes_allowed_hosts(tiny_dir, monkeypatch):
    from lmtrace.cli import main

    apps = []
    monkeypatch.setattr("lmtrace.server.run.Runner.run", lambda runner: apps.append(runner.server.config.app))
    assert main(["serve", "--model", str(tiny_dir), "--allow-host", "Proxy.example", "--allow-host", "b.example"]) == 0
    with TestClient(apps[0], base_url="http://127.0.0.1:8000") as c:
        assert c.get("/health", headers={"Host": "proxy.example"}).status_code == 200
        assert c.get("/health", headers={"Host": "b.example:443"}).status_code == 200
        assert c.get("/health", headers={"Host": "c.example"}).status_code == 421
