"""`fields` of a JSON output (lmtrace.decode.fields): JSONPaths and character spans found by a
scanner, checked against json.loads of the same text; the boundary rule on hand-made steps."""

from __future__ import annotations

import json
import math

import pytest

from lmtrace.decode.fields import fields, leaves, token_spans
from lmtrace.records import Step


def value_at(doc, path: str):
    """The value a JSONPath of the scanner's form names, read with plain Python."""
    import re

    for name, quoted, index in re.findall(r"\.([A-Za-z_][A-Za-z0-9_]*)|\['((?:[^'\\]|\\.)*)'\]|\[(\d+)\]", path[1:]):
        key = quoted.replace("\\'", "'").replace("\\\\", "\\")
        doc = doc[name] if name else doc[key] if quoted else doc[int(index)]
    return doc


DOCS = [
    '{"city":"Paris","population":2161000,"tags":["a","b c"],"geo":{"lat":48.85,"lon":-2.35e0}}',
    '{"items":[{"name":"x"},{"name":"y","ok":true},{"name":"z\\"q","n":null}],"empty":[],"none":{}}',
    '{"first name":"Ada","it\'s":1,"a.b":[1,[2,3]]}',
    '  { "spaced" : [ 1 , 2 ] }  ',
    '"just a string"',
    "42",
]


@pytest.mark.parametrize("text", DOCS)
def test_every_leaf_with_its_path_and_characters(text):
    doc = json.loads(text)
    found = leaves(text)
    for path, start, end in found:
        assert json.loads(text[start:end]) == value_at(doc, path), path

    def count(v):
        if isinstance(v, dict):
            return sum(count(x) for x in v.values()) if v else 1
        if isinstance(v, list):
            return sum(count(x) for x in v) if v else 1
        return 1

    assert len(found) == count(doc)


def test_paths_read_as_jsonpath():
    paths = [p for p, _, _ in leaves(DOCS[1]) + leaves(DOCS[2])]
    assert "$.items[2].name" in paths and "$.items[1].ok" in paths and "$.empty" in paths
    assert "$['first name']" in paths and "$['it\\'s']" in paths and "$['a.b'][1][0]" in paths


def test_a_cut_text_gives_its_complete_values_only():
    assert [p for p, _, _ in leaves('{"a":"x","b":12')] == ["$.a"]  # 12 may go on
    assert [p for p, _, _ in leaves('{"a":"x","b":"unfinished')] == ["$.a"]
    assert leaves("") == [] and leaves("not json") == []


def step(i: int, text: str, lp: float, raw: float) -> Step:
    return Step(i, i, text, list(text.encode()), raw, lp, 1, 0.0, 0.0, [], {}, None,
                grammar={"allowed": 2, "removed_mass": 0.5, "logprob": lp})  # fmt: skip


def test_a_token_counts_for_every_value_it_carries_characters_of():
    # '{"a":"Par' / 'is","b":' / '1' / '2}'  : the second token carries the end of $.a and nothing of $.b
    pieces = ['{"a":"Par', 'is","b', '":', "1", "2}"]
    lps = [-0.1, -0.2, -0.3, -0.4, -0.5]
    steps = [step(i, t, lp, 2 * lp) for i, (t, lp) in enumerate(zip(pieces, lps))]
    text = "".join(pieces)
    by_path = {f["path"]: f for f in fields(text, steps)}
    a, b = by_path["$.a"], by_path["$.b"]
    assert (a["text"], a["start_step"], a["end_step"]) == ('"Paris"', 0, 1)
    assert (b["text"], b["start_step"], b["end_step"]) == ("12", 3, 4)
    assert math.isclose(a["logprob"], -0.3) and math.isclose(a["raw_logprob"], -0.6)
    assert math.isclose(b["min_prob"], math.exp(-0.5)) and b["chars"] == [text.index("12"), text.index("12") + 2]


def test_an_empty_piece_belongs_with_the_character_it_starts():
    # "é" in two byte tokens: the first piece is empty, the second carries the character
    steps = [step(0, '{"a":"', -0.1, -0.1), step(1, "", -0.7, -0.7), step(2, 'é"}', -0.2, -0.2)]
    assert token_spans(steps) == [(0, 6), (6, 7), (6, 9)]
    (f,) = fields('{"a":"é"}', steps)
    assert (f["start_step"], f["end_step"]) == (0, 2) and math.isclose(f["logprob"], -1.0)
