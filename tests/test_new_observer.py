"""A new observer reaches every entry point with no edit outside its own module (issue 49): the
one below is defined here and nowhere else, and runs through each entry point of the
composability table — as an instance where the call is Python's (generate, a batch, stream,
branch, kv-lab), by name where a request cannot carry an object (a batch line, the server's
/v1/traces, completions and chat: the operator registers its class, `--observer
NAME=module:Class`). Each entry equals generate's, alone, with a draft and with a grammar."""

from __future__ import annotations

import json

import pytest
import torch

import lmtrace
from lmtrace import InvalidParameter
from lmtrace.decode import named_observers
from tests import composability as world
from tests.same_record import one_thread  # noqa: F401
from tests.test_composability import check_row, gguf_lm  # noqa: F401  (the table's model)

pytestmark = pytest.mark.usefixtures("one_thread")


class Runner(lmtrace.Observer):
    """The gap between the chosen token's raw logprob and the best one (0 where it is the best),
    and the trace's largest gap."""

    name = "runner_up_gap"

    def observe(self, step, logits, tokens, how):
        logprobs = torch.log_softmax(logits.float(), -1)
        best = logprobs.max(-1).values
        return (best - logprobs.gather(-1, tokens[:, None].to(logprobs.device))[:, 0]).tolist()

    def summarize(self, steps):
        return {"largest": max(s.entries[self.name] for s in steps)}


@pytest.fixture
def with_runner(monkeypatch):
    monkeypatch.setitem(world.FEATURES, "runner", {"observers": [Runner()]})


@pytest.mark.parametrize("cell", [("runner",), ("runner", "draft:packed"), ("runner", "regex")], ids="+".join)
def test_a_new_observer_in_every_entry_point(gguf_lm, with_runner, cell):  # noqa: F811
    table = check_row(gguf_lm, cell)
    refused = {entry for entry, got in table.items() if got == "refused"}
    assert not refused, f"{cell} refused by {sorted(refused)}"
    trace = lmtrace.generate(gguf_lm, world.PROMPT, **world.merged(*cell))
    assert all(s.entries["runner_up_gap"] >= 0 for s in trace.steps)
    assert trace.entries["runner_up_gap"] == {"largest": max(s.entries["runner_up_gap"] for s in trace.steps)}


def test_registered_by_module_and_class():
    known = named_observers.registry(["gap=tests.test_new_observer:Runner"])
    first, second = (named_observers.resolve(["gap"], known)[0] for _ in range(2))
    assert isinstance(first, Runner) and first is not second  # each row its own


@pytest.mark.parametrize(
    ("specs", "needle"),
    [
        (["gap"], "observer: expected NAME=module:Class, got 'gap'"),
        (["gap=tests.nowhere:Runner"], "observer: cannot import 'tests.nowhere:Runner'"),
        (["gap=tests.composability:no_top_token"], "observer: gap must make an lmtrace.Observer with no arguments"),
        (["gap=tests.composability:Refused"], "observer: gap must make an lmtrace.Observer, got Refused"),
        (["a=tests.test_new_observer:Runner", "a=tests.test_new_observer:Runner"], "each name must be given once"),
    ],
)
def test_bad_registrations_refused_in_one_line(specs, needle):
    with pytest.raises(InvalidParameter) as e:
        named_observers.registry(specs)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_name_not_registered_refused_naming_observers():
    with pytest.raises(InvalidParameter, match=r"observers: no observer is registered as 'nope' \(registered: gap;"):
        named_observers.resolve(["nope"], {"gap": Runner})


def test_the_batch_command_registers_an_observer(tmp_path, tiny_dir):
    from lmtrace.cli import main

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"id": 1, "prompt": "Hello", "observers": ["gap"]}\n{"id": 2, "prompt": "Hi"}\n')
    args = ["--max-new-tokens", "3", "--temperature", "0", "--observer", "gap=tests.test_new_observer:Runner"]
    assert main(["batch", str(src), str(out), "--model", str(tiny_dir), *args, "--no-color"]) == 0
    got = {r["id"]: r["trace"] for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    assert all("runner_up_gap" in s for s in got[1]["steps"]) and "runner_up_gap" in got[1]
    assert not any("runner_up_gap" in s for s in got[2]["steps"])


def test_the_batch_command_refuses_a_bad_observer_before_loading(tmp_path, capsys):
    from lmtrace.cli import main

    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "Hello"}\n')
    assert main(["batch", str(src), str(tmp_path / "out.jsonl"), "--observer", "gap"]) == 2
    assert "observer: expected NAME=module:Class, got 'gap'" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_serve_registers_an_observer_that_requests_name(tiny_dir, monkeypatch):
    from fastapi.testclient import TestClient

    from lmtrace.cli import main

    apps = []
    monkeypatch.setattr("lmtrace.server.run.Runner.run", lambda runner: apps.append(runner.server.config.app))
    assert main(["serve", "--model", str(tiny_dir), "--observer", "gap=tests.test_new_observer:Runner"]) == 0
    with TestClient(apps[0], base_url="http://127.0.0.1:8000") as c:
        body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 1, "observers": ["gap"]}
        got = c.post("/v1/completions", json=body).json()["choices"][0]
        assert [set(o) for o in got["logprobs"]["observed"]] == [{"runner_up_gap"}] * 3
        missing = c.post("/v1/traces", json={"prompt": "Hello", "observers": ["nope"]})
        assert missing.status_code == 400 and "observers: no observer is registered as 'nope'" in missing.text
