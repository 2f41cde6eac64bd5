"""What a watched loop really feeds, round by round: the loop's own token sequence per row (as a
right loop's cache would hold it), the tokens each round appends to it (one, several, the whole
sequence again), and the problems that change the logits, each with the fix for that loop.

A round's input is read, on row 0 (a batch's rows are fed as one rectangle), as one of:
- the first round, or a new prompt (a multi-token input into an empty cache): the sequence starts;
- the loop's whole sequence again, then the new tokens: a cache-free loop when the cache is empty
  (right), the re-feeding mistake when it is not;
- the argmax of every position of the previous round (`logits.argmax(-1)` on (batch, seq, vocab)
  logits): the choice is read at every position instead of the last one;
- new tokens only (any number): right when the cache holds the whole sequence so far, a cache from
  an earlier round (or a new one) when it holds less; another prompt when it restarts the sequence."""

from __future__ import annotations

from dataclasses import dataclass, field

SAME_OBJECT = "pass the cache the previous call filled (the same object every round)"


@dataclass
class Finding:
    """A problem found in one round: its kind, the cache length a right loop would have now, and
    the message (what the loop did, then the fix)."""

    kind: str  # refed_tokens, all_positions, stale_cache, positions, different_prompt
    expected: int
    message: str


@dataclass
class Fed:
    """How one round's input reads: per row the tokens it appends to the loop's sequence, how many
    leading tokens it fed again, and the problems."""

    new: list[list[int]]
    refed: int = 0
    starts: bool = False  # the round starts a sequence (the first round, or a new prompt)
    findings: list[Finding] = field(default_factory=list)


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


class Loop:
    """The loop's sequence per row, and the previous round's argmax at each position (row 0)."""

    def __init__(self) -> None:
        self.seqs: list[list[int]] = []
        self.argmax: list[int] | None = None
        self.after: list[int] = []  # each round's cache length after it (which round a stale cache is from)

    def feed(self, index: int, rows: list[list[int]], before: int, after: int, has_cache: bool) -> Fed:
        """Reads round `index`'s input `rows` (a token list per row) given the cache's length
        `before` and `after` the call; updates the loop's sequence."""
        ids, seq = rows[0], self.seqs[0] if self.seqs else []
        fed = self._read(index, rows, ids, seq, before, after, has_cache)
        self.after.append(after)
        return fed

    def _read(self, index: int, rows: list[list[int]], ids: list[int], seq: list[int], before: int, after: int,
              has_cache: bool) -> Fed:  # fmt: skip
        if not seq or len(rows) != len(self.seqs) or (before == 0 and len(ids) > 1 and ids[: len(seq)] != seq):
            self.seqs = [list(r) for r in rows]  # the first round, or a new prompt into an empty cache
            return Fed([list(r) for r in rows], starts=True)
        if len(ids) > len(seq) and ids[: len(seq)] == seq:  # the whole sequence again, then the new tokens
            n = len(seq)
            fed = Fed([list(r[n:]) for r in rows], refed=n)
            self.seqs = [list(r) for r in rows]
            if before and has_cache:
                fed.findings.append(self._refed(index, len(ids), n, after))
            return fed
        fed = Fed([list(r) for r in rows])
        if self.argmax is not None and len(ids) > 1 and ids == self.argmax:
            fed.findings.append(self._all_positions(index, len(ids), len(seq), after))
        elif before < len(seq):
            fed.findings.append(self._stale(index, len(ids), len(seq), before, after, has_cache))
        elif has_cache and before and len(ids) > 1 and ids[0] == seq[0]:
            fed.findings.append(Finding("different_prompt", len(ids),
                f"round {index}: a cache holding {before} positions of another sequence was reused for a new "
                f"prompt; it now holds {after} positions where {len(ids)} were expected. Fix: start from a new "
                f"cache for a new prompt"))  # fmt: skip
            self.seqs = [list(r) for r in rows]
            fed.starts = True
            return fed
        self.seqs = [s + list(r) for s, r in zip(self.seqs, rows)]
        return fed

    def _refed(self, index: int, fed: int, held: int, after: int) -> Finding:
        new = fed - held
        expected = held + new
        return Finding("refed_tokens", expected,
            f"round {index}: fed {fed} tokens, the loop's whole sequence, but the cache already holds the first "
            f"{held} of them, so only {new} {'is' if new == 1 else 'are'} new; it now holds {after} positions "
            f"where {expected} were expected. Fix: feed only the new {_tokens(new)}: "
            f"model(input_ids[:, -{new}:], cache=cache) after the first call")  # fmt: skip

    def _all_positions(self, index: int, fed: int, held: int, after: int) -> Finding:
        return Finding("all_positions", held + 1,
            f"round {index}: fed {fed} tokens, the model's argmax at each of the {fed} positions of round "
            f"{index - 1} (logits.argmax(-1) over (batch, seq, vocab) logits), but only the last position "
            f"predicts the next token; the cache now holds {after} positions where {held + 1} were expected. "
            f"Fix: next_token = logits[:, -1, :].argmax(-1, keepdim=True)")  # fmt: skip

    def _stale(self, index: int, fed: int, held: int, before: int, after: int, has_cache: bool) -> Finding:
        rounds = [k for k, n in enumerate(self.after) if n == before]
        if not has_cache:
            what = "no cache"
        elif before == 0:
            what = "a new, empty cache"
        else:
            what = f"the cache as it was after round {rounds[-1]}" if rounds else "a cache from an earlier round"
        return Finding("stale_cache", held + fed,
            f"round {index}: fed {_tokens(fed)} with {what} ({before} positions) while the loop's sequence "
            f"already holds {held} tokens, so the model sees {before + fed} of {held + fed} tokens; the cache "
            f"now holds {after} positions where {held + fed} were expected. Fix: {SAME_OBJECT}, or "
            f"out.past_key_values")  # fmt: skip


def positions(index: int, start: int, expected: int, before: int, after: int) -> Finding:
    """Position ids that do not continue the cache."""
    return Finding("positions", after,
        f"round {index}: position ids start at {start} but the cache holds {before} positions, so the next "
        f"position is {expected}. Fix: position_ids = {expected} + torch.arange(new tokens), or leave "
        f"position_ids out (the model counts from the cache)")  # fmt: skip
