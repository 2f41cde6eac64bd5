"""Where a row's text ends and why: the stop strings over a growing text (`StopStrings`, the one
scan, shared by the decoding rows, the server's streams and the vLLM conversion) and the one rule
of the finish reason (`finish_reason`, a step's and a trace's)."""

from __future__ import annotations

from collections.abc import Iterable


class StopStrings:
    """Stop strings over a text fed piece by piece (`feed`). The first one to complete cuts the
    text: `cut` is where it starts and `stop` which it is (the earliest; at one position, the
    smaller string). `release` gives the text that is final: up to the cut, and short of any tail
    that could still grow into a stop string (held until the next pieces show it does not)."""

    def __init__(self, stops: Iterable[str]):
        self.stops = list(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # every piece fed
        self.released = 0  # how much of the text `release` has given
        self.cut: int | None = None
        self.stop: str | None = None

    def feed(self, piece: str) -> bool:
        """Adds `piece` to the text; True when a stop string is complete (`cut`, `stop`). Only an
        occurrence that ends in `piece` can be new: the scan starts a stop string's length back."""
        start = max(0, len(self.text) - self.longest)
        self.text += piece
        if self.cut is None and self.stops:
            hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.cut, self.stop = min(hits)
        return self.cut is not None

    def final(self) -> int:
        """How much of the text is final: up to the complete stop string, else short of the
        longest tail that begins a stop string (never less than was released)."""
        if self.cut is not None:
            return max(self.released, self.cut)
        text = self.text
        for k in range(min(len(text) - self.released, self.longest - 1), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stops):
                return len(text) - k
        return len(text)

    def release(self) -> str:
        """The text that became final since the last call."""
        end = self.final()
        out, self.released = self.text[self.released : end], end
        return out


def finish_reason(is_eos: bool, hit_stop: bool, last: bool, *, openai: bool = False) -> str | None:
    """Why a row ends: at a step, its end token ("eos"), a completed stop string ("stop") or its
    last allowed token ("length", `last`); None: it goes on. `openai=True`: the reason of a row that
    has ended (a trace's `finish_reason`), in OpenAI's vocabulary: "stop" for an end token, a stop
    string or any other end short of its length, "length" where it ran to its limit (`last`)."""
    if is_eos:
        return "stop" if openai else "eos"
    if hit_stop:
        return "stop"
    if last:
        return "length"
    return "stop" if openai else None
