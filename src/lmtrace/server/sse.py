"""Streaming without saying anything that will be taken back. Text goes out only when it is
final: a character split over byte-level tokens is held until complete (the Step's own piece
is empty until then), and text that could be the start of a stop string is held until the
next tokens show it is not. Each token goes out with the chunk that releases its text, so the
chunks of a stream add up to exactly the non-streamed answer, logprobs included."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from lmtrace.records import Step
from lmtrace.stops import StopStrings

DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


def answer_pieces(steps: Sequence[Step], text: str) -> list[str]:
    """The part of the answer `text` each step added: its own piece, cut where the answer ends
    (before a stop string, before the end-of-sequence token's text)."""
    out, at, end = [], 0, len(text)
    for s in steps:
        out.append(text[min(at, end) : min(at + len(s.text), end)])
        at += len(s.text)
    if out and at < end:  # characters completed only by the final flush
        out[-1] += text[at:]
    return out


class ChoiceStream:
    """One streamed choice: `add` each step as it comes, `finish` with the final answer text.
    Both return (text to send now, [(step, its piece)] whose text that releases). What is final
    is the stop strings' rule (lmtrace.stops.StopStrings), as the row's own record applies it."""

    def __init__(self, stops: Sequence[str]):
        self.held = StopStrings(stops)  # its text: the pieces so far, without the end token's
        self.raw_end = 0  # where the pieces end, the end token's included (answer_pieces' count)
        self.pending: list[tuple[Step, int, int]] = []

    def add(self, step: Step, is_eos: bool) -> tuple[str, list[tuple[Step, str]]]:
        start = self.raw_end
        self.raw_end += len(step.text)
        if not is_eos:
            self.held.feed(step.text)
        self.pending.append((step, start, self.raw_end))
        delta, text = self.held.release(), self.held.text
        ready = []
        while self.pending and self.pending[0][2] <= self.held.released:
            s, a, b = self.pending.pop(0)
            ready.append((s, text[a:b]))
        return delta, ready

    def finish(self, text: str) -> tuple[str, list[tuple[Step, str]]]:
        sent = self.held.released
        delta = text[sent:] if text.startswith(self.held.text[:sent]) else ""
        end = len(text)
        ready = [(s, text[min(a, end) : min(b, end)]) for s, a, b in self.pending]
        if ready and self.raw_end < end:
            ready[-1] = (ready[-1][0], ready[-1][1] + text[self.raw_end :])
        self.pending = []
        return delta, ready


class SSEResponse(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends (done, error, or the
    client went away), so the generation behind it is always cancelled or finished."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
