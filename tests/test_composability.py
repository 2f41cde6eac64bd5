"""The composability table (issue 33): every feature in every entry point, and each feature
paired with a draft and with a grammar. Each cell equals the same work done alone (greedy: the
same token ids and numbers within 1e-6, or the batched bound 1e-5 where rows decode together;
sampled with a seed: the same draws), or is refused in one line that names the option. No cell
drops a feature silently: a dropped feature is a missing field, which the comparison reports.

    python -m tests.test_composability      prints the whole table (the closing note's)"""

from __future__ import annotations

import pytest

import lmtrace
from tests import composability as world
from tests.same_record import one_thread  # noqa: F401
from tests.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_thread")

SINGLE = [(f,) for f in world.FEATURES]
WITH_DRAFT = [(f, d) for f in world.FEATURES if f not in world.DRAFTS for d in world.DRAFTS]
WITH_GRAMMAR = [(f, g) for f in world.FEATURES if f not in world.GRAMMARS for g in world.GRAMMARS]


def compiled_slow(cells: list[tuple[str, ...]]) -> list:
    """`compile` paired with a draft or a grammar compiles again (minutes on a CPU): slow."""
    return [pytest.param(c, marks=pytest.mark.slow) if "compile" in c else c for c in cells]


@pytest.fixture(scope="module")
def gguf_lm(tmp_path_factory, tiny_tok):
    """The tiny model as a GGUF file loaded in float32: every feature works on it (`packed` too)."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("compose") / "tiny.gguf", tiny_tok)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMTRACE_GGUF_CACHE", "0")
        return lmtrace.load(str(path), device="cpu", dtype="float32")


def reference(lm, features: tuple[str, ...]) -> dict | str:
    """generate's own record of the cell, or its refusal; with `compile`, the default path's
    (the compiled one is held to it)."""
    try:
        return world.via_generate(lm, world.merged(*(f for f in features if f != "compile")))
    except lmtrace.InvalidParameter as e:
        return f"refused: {e}"


def check_row(lm, features: tuple[str, ...]) -> dict[str, str]:
    ref = reference(lm, features)
    table = {}
    for entry in world.ENTRIES:
        refused = world.refused_by(entry, features)
        if isinstance(ref, str):  # generate refuses the pair: so does every entry point
            assert refused, f"generate refused {features} unexpectedly: {ref}"
            table[entry] = "refused"
            continue
        tol = world.BATCHED_TOL if entry in world.BATCHED else world.ALONE_TOL
        got = world.outcome(lm, entry, features, ref, tol)
        if refused:
            assert got.startswith("refused: "), f"{entry} should refuse {features}, got {got}"
            line = got.removeprefix("refused: ")
            assert "\n" not in line
            names = [n for f in refused for n in world.option_names(f)]
            assert any(n in line for n in names), f"{entry}: the refusal names none of {names}: {line}"
            table[entry] = "refused"
        else:
            assert got == "ok", f"{entry} with {features}: {got}"
            table[entry] = "ok"
    return table


@pytest.mark.parametrize("features", SINGLE, ids="+".join)
def test_every_feature_in_every_entry_point(gguf_lm, features):
    check_row(gguf_lm, features)


@pytest.mark.parametrize("features", compiled_slow(WITH_DRAFT), ids="+".join)
def test_every_feature_with_a_draft(gguf_lm, features):
    """Besides the entry points: the feature with a draft gives what it gives without one (ids
    identical, numbers within the speculative bound: the verify forward runs K + 1 positions)."""
    table = check_row(gguf_lm, features)
    # sampled, a draft draws otherwise (accept or resample) from the same distribution: lossless,
    # which test_speculative's chi-square test checks; the same seed gives the same draws again
    if table["generate"] == "ok" and features[0] != "seed":
        drafted = world.via_generate(gguf_lm, world.merged(*features))
        alone = world.via_generate(gguf_lm, world.merged(features[0]))
        assert drafted["token_ids"] == alone["token_ids"]
        assert drafted["speculative"]["blocks"] >= 1
        if "compile" in features:
            drafted, alone = (world.uncompiled(d) for d in (drafted, alone))
        assert not world.differences(world.comparable(drafted), world.comparable(alone), 1e-4)


@pytest.mark.parametrize("features", compiled_slow(WITH_GRAMMAR), ids="+".join)
def test_every_feature_with_a_grammar(gguf_lm, features):
    table = check_row(gguf_lm, features)
    if table["generate"] == "ok":
        trace = world.via_generate(gguf_lm, world.merged(*features))
        assert all(s["grammar"] is not None for s in trace["steps"])


def test_draft_and_regex_decode_constrained(gguf_lm):
    """The pair that decoded unconstrained while the trace said constrained (issue 33)."""
    kw = world.merged("regex", "draft:packed")
    drafted = lmtrace.generate(gguf_lm, world.PROMPT, **kw)
    alone = lmtrace.generate(gguf_lm, world.PROMPT, **world.merged("regex"))
    assert drafted.token_ids == alone.token_ids and drafted.text == alone.text
    assert all(s.grammar is not None for s in drafted.steps)
    assert any(s.draft is not None for s in drafted.steps)


if __name__ == "__main__":  # the whole table, as the closing note prints it
    import os
    import tempfile

    from tests.tiny import tiny_tokenizer

    os.environ["LMTRACE_GGUF_CACHE"] = "0"
    lm = lmtrace.load(str(write_tiny_gguf(tempfile.mkdtemp() + "/tiny.gguf", tiny_tokenizer())),
                      device="cpu", dtype="float32")  # fmt: skip
    print("| cell | " + " | ".join(world.ENTRIES) + " |")
    print("|---" * (len(world.ENTRIES) + 1) + "|")
    for features in SINGLE + WITH_DRAFT + WITH_GRAMMAR:
        row = check_row(lm, features)
        print(f"| {' + '.join(features)} | " + " | ".join(row[e] for e in world.ENTRIES) + " |")
