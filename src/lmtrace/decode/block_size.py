"""How many tokens a speculative block proposes: a fixed K, or with `draft_tokens="auto"` the K
that makes the most tokens per second, chosen before each block from what the run has measured.

A block of K proposals emits the accepted ones and then the target's own token: with each
proposal accepted with probability a (given the ones before it), K + 1 tokens at most and
(1 - a^(K+1)) / (1 - a) expected. It costs K draft steps and one verify forward of K + 1 rows.
The run measures all three as it goes: the acceptance (counted per proposal, the newest blocks
weighing most), the seconds of a draft step, and the seconds of a verify forward by its row count
(a straight line through the row counts measured; oneDNN's packed kernel costs about the same
for 1 to 8 rows, torch's default kernel about twice as much for 8 rows as for one). K is the one
that maximizes expected tokens / expected seconds, in [1, MAX_AUTO].

The choice changes how many proposals a block makes, never what a step emits: a greedy run gives
the same tokens with any K, a sampled run the same distribution (speculative sampling is exact
at every K). With a seed, a sampled run draws its random numbers per proposal, so two `auto` runs
whose measured times chose other K can sample other tokens; a fixed K replays exactly."""

from __future__ import annotations

from dataclasses import dataclass, field

AUTO = "auto"
MAX_AUTO = 8  # the largest block `auto` proposes
FIRST = 4  # its first block's K, before anything is measured
DECAY = 0.9  # the weight each earlier observation keeps at every new one


@dataclass
class BlockSize:
    """K for the next block (`next`); `measured` after each block with what it cost."""

    fixed: int | None  # None: auto
    accepted: float = 4.0  # the acceptance's weighted counts, a prior of 4 in 5
    proposed: float = 5.0
    draft_s: float | None = None  # seconds of one draft step
    verify_s: dict[int, float] = field(default_factory=dict)  # rows -> seconds of a verify forward

    @classmethod
    def of(cls, k: int | str) -> BlockSize:
        return cls(None if k == AUTO else int(k))

    @property
    def largest(self) -> int:
        """The most proposals a block of this run can make (room in a static cache)."""
        return MAX_AUTO if self.fixed is None else self.fixed

    def next(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.draft_s is None or not self.verify_s:
            return FIRST
        return max(range(1, MAX_AUTO + 1), key=lambda k: expected_tokens(self.rate, k) / self.cost(k))

    @property
    def rate(self) -> float:
        """The acceptance of one proposal (given the ones before it were accepted)."""
        return self.accepted / self.proposed

    def cost(self, k: int) -> float:
        """Expected seconds of a block of k proposals."""
        return k * (self.draft_s or 0.0) + self.verify(k + 1)

    def verify(self, rows: int) -> float:
        """A verify forward's seconds for `rows` rows: measured, else on the line through the
        row counts measured (flat where only one was)."""
        if rows in self.verify_s:
            return self.verify_s[rows]
        xs = sorted(self.verify_s)
        if len(xs) == 1:
            return self.verify_s[xs[0]]
        lo, hi = xs[0], xs[-1]
        slope = max(0.0, (self.verify_s[hi] - self.verify_s[lo]) / (hi - lo))
        return max(self.verify_s[lo] + slope * (rows - lo), 0.0)

    def measured(self, verdicts: list[bool], draft_s: float, draft_steps: int, verify_s: float, rows: int) -> None:
        """A block's outcome: its proposals' verdicts (up to the first rejection), the seconds of
        its draft steps and of its verify forward of `rows` rows."""
        if self.fixed is not None:
            return
        kept = next((i for i, v in enumerate(verdicts) if not v), len(verdicts))
        rejected = 1 if kept < len(verdicts) else 0
        self.accepted = self.accepted * DECAY ** (kept + rejected) + kept
        self.proposed = self.proposed * DECAY ** (kept + rejected) + kept + rejected
        if draft_steps:
            step = draft_s / draft_steps
            self.draft_s = step if self.draft_s is None else DECAY * self.draft_s + (1 - DECAY) * step
        if rows:  # a block of no proposals after the prefill runs no verify forward
            old = self.verify_s.get(rows)
            self.verify_s[rows] = verify_s if old is None else DECAY * old + (1 - DECAY) * verify_s


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a block of k proposals emits on average: 1 + a + ... + a^k."""
    return sum(rate**i for i in range(k + 1))
