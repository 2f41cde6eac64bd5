"""The answer of one sample: what `--answer-regex` captures (its first group, else the whole
match), the option a `--choice` constraint produced, or the whole text; normalised so that
answers equal up to case, spacing and trailing punctuation fall in one cluster."""

from __future__ import annotations

import re
import unicodedata

from lmtrace.errors import InvalidParameter

_TRAILING = ".,;:!?。，；：！？\"'`)]}>*"


def compile_regex(pattern: str | None) -> re.Pattern | None:
    """The answer regex compiled (None: none given); a pattern that does not compile is bad input."""
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as e:
        raise InvalidParameter(f"answer_regex does not compile ({e}), got {pattern!r}") from None


def extract(text: str, regex: re.Pattern | None) -> str | None:
    """The raw answer in `text`: the regex's first group (or whole match) at its first match;
    None where it never matches. Without a regex, the whole text."""
    if regex is None:
        return text
    found = regex.search(text)
    if found is None:
        return None
    return found.group(1) if regex.groups and found.group(1) is not None else found.group(0)


def normalise(answer: str) -> str:
    """NFKC, case folded, whitespace collapsed, surrounding punctuation stripped: the cluster key."""
    s = " ".join(unicodedata.normalize("NFKC", answer).casefold().split())
    return s.strip(_TRAILING + " ").lstrip("([{<\"'`* ")
