"""Each audit probe against a server that reproduces one known engine bug (tests/audit/buggy.py,
a proxy in front of the real lmtrace app on the tiny model): the probe meant for that bug fails,
with evidence to paste upstream, and every other probe passes. Without a bug, all pass."""

from __future__ import annotations

import pytest

from lmtrace.comparison.audit import PROBE_NAMES, audit
from lmtrace.server import create_app
from tests.audit.buggy import BUGS, buggy_app
from tests.server.conftest import RunningServer


@pytest.fixture(scope="module")
def inner(chat_lm):
    app = create_app(chat_lm, name="tiny")
    yield app
    app.state.lmtrace.worker.shutdown()


# what the failing probe's detail says, per bug
SAYS = {
    "processed": "logprobs are those of the processed distribution (temperature 0.7)",
    "zero_logprobs": "every greedy token logprob is 0.0",
    "echo_generation_only": "only the generated token's (llama.cpp #27174",
    "bos_offsets": "text_offset goes backwards at token",
    "duplicate_top": "appears twice among the alternatives",
    "stream_misaligned": "the streamed logprobs are not the streamed text's",
    "prompts_order": "choice indices come back as [3, 2, 1, 0]",
    "stale_repeat": "the second of two identical requests",
    "batch_dependent": "alone vs among 8 concurrent requests",
    "wrong_usage": "usage.completion_tokens is 13, the tokenizer counts 12",
    "stop_logprobs": "the logprobs go on past the stop string",
    "chat_off_by_one": "under the chat template",
    "lossy_bytes": "name no token of this tokenizer",
    "tokenize_no_generation_prompt": "/tokenize of the chat messages gives",
}


def outcome(report) -> str:
    return "\n".join(f"{p.status} {p.name}: {p.detail}" for p in report.probes)


@pytest.mark.parametrize("bug", [None, *BUGS])
def test_each_probe_catches_its_bug_and_only_its_bug(bug, chat_lm, inner):
    with RunningServer(buggy_app(inner, bug)) as server:
        report = audit(chat_lm, server.url)
    assert [p.name for p in report.probes] == list(PROBE_NAMES)
    failed = {p.name for p in report.probes if p.status == "fail"}
    assert failed == (set() if bug is None else {BUGS[bug]}), outcome(report)
    assert all(p.status == "pass" for p in report.probes if p.name not in failed), outcome(report)
    assert report.exit_code == (0 if bug is None else 1)
    if bug is not None:
        (probe,) = [p for p in report.probes if p.status == "fail"]
        assert SAYS[bug] in probe.detail, probe.detail
    if bug == "processed":
        sampled = report.probes[0].figures["sampled"]
        assert sampled["distribution"] == "processed" and abs(sampled["best_temperature"]["temperature"] - 0.7) < 0.02
    for p in report.probes:
        if p.status == "fail":  # what a user pastes upstream: the request, its curl line, the answer
            assert p.evidence["request"]["body"]["model"] == "tiny"
            assert p.evidence["curl"].startswith(f"curl -s {server.url}/")
            assert "response" in p.evidence or "streamed_chunks" in p.evidence


def test_what_the_server_does_not_offer_is_a_skip_or_a_note(chat_lm, inner):
    with RunningServer(buggy_app(inner, None, refuse={"tokenize", "echo", "n"})) as server:
        report = audit(chat_lm, server.url)
    status = {p.name: p for p in report.probes}
    assert {n for n, p in status.items() if p.status != "pass"} == {"echo", "tokenize"}, outcome(report)
    assert status["echo"].status == status["tokenize"].status == "skip"
    assert "HTTP 400: echo is not supported" in status["echo"].detail
    assert "no /tokenize (HTTP 404" in status["tokenize"].detail
    assert "n=2 with greedy decoding refused" in status["prompts"].detail
    assert "echo refused" in status["repeat"].detail
    assert report.preflight["tokenization"] == "matches (usage.prompt_tokens)"
    assert report.exit_code == 0
