"""lmtrace.sample: N seeded samples as one batch, each token-identical to its seed decoded alone;
votes recomputed by hand; DeepConf's online early stop keeps only traces identical to the lone
runs and its vote equals the offline vote over the kept traces."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

import lmtrace
from lmtrace.cli import main
from lmtrace.errors import InvalidParameter
from lmtrace.samples import votes

SETTINGS = {"max_new_tokens": 10, "temperature": 1.0, "confidence_window": 4}


@pytest.fixture(scope="module")
def alone(tiny_lm):
    """Each seed decoded alone with lmtrace.generate (the oracle of the batch's rows)."""
    return [lmtrace.generate(tiny_lm, "Hello", max_new_tokens=10, temperature=1.0, seed=s) for s in range(8)]


def test_every_sample_is_its_seed_alone(tiny_lm, alone):
    r = lmtrace.sample(tiny_lm, "Hello", n=8, answer_regex=r"(\w+)", **SETTINGS)
    assert [t.token_ids for t in r.traces] == [a.token_ids for a in alone]
    for t, a in zip(r.traces, alone):
        assert [s.logprob for s in t.steps] == pytest.approx([s.logprob for s in a.steps], abs=1e-5)
    found = [e["answer"] for e in r.samples]
    count = Counter(a for a in found if a is not None)
    assert r.votes["majority"]["count"] == max(count.values())
    lp = [sum(s.logprob for s in t.steps) for t in r.traces]
    assert r.scores["mc_sequence_entropy"] == pytest.approx(-sum(lp) / len(lp), abs=1e-9)
    assert r.scores["num_sets"] == len(count)
    clusters = {a: math.log(sum(math.exp(x) for x, b in zip(lp, found) if b == a)) for a in count}
    assert r.scores["semantic_entropy"] == pytest.approx(-sum(clusters[a] for a in found) / len(found), abs=1e-9)
    weights = Counter()
    for e in r.samples:
        weights[e["answer"]] += r.traces[e["index"]].uncertainty["deepconf"]["lowest_group"]
    assert r.votes["weighted"]["answer"] == max(weights, key=lambda a: weights[a])


def test_online_early_stop_keeps_lone_traces_and_the_offline_vote(tiny_lm, alone):
    r = lmtrace.sample(tiny_lm, "Hello", n=8, answer_regex=r"(\w+)", deepconf="low", warmup=3, **SETTINGS)
    stop = r.early_stop
    lowest = [alone[i].token_ids for i in range(3)]
    assert [t.token_ids for t in r.traces[:3]] == lowest  # the warm-up decoded in full
    warm = [t.uncertainty["deepconf"]["lowest_group"] for t in r.traces[:3]]
    ordered = sorted(warm)  # numpy's linear percentile by hand: position 2 * 0.9 = 1.8
    assert stop["threshold"] == pytest.approx(ordered[1] + 0.8 * (ordered[2] - ordered[1]))
    by_index = {e["index"]: t for e, t in zip([e for e in r.samples if e["decoded"]], r.traces)}
    kept = [e for e in r.samples if e["kept"]]
    for e in r.samples:
        t, a = by_index.get(e["index"]), alone[e["index"]]
        if e["kept"]:
            assert t.token_ids == a.token_ids and t.uncertainty["deepconf"]["lowest_group"] >= stop["threshold"]
        elif t is not None:  # a stopped row is its lone run cut short
            assert t.token_ids == a.token_ids[: len(t.token_ids)]
        if e["stopped"] == "deepconf":
            assert len(t.token_ids) >= stop["group"] and t.finish_reason in ("deepconf", "length", "stop")
    offline = votes.weighted([e["answer"] for e in kept],
                             [by_index[e["index"]].uncertainty["deepconf"]["lowest_group"] for e in kept])  # fmt: skip
    assert r.votes["deepconf"]["answer"] == offline["answer"] and r.votes["deepconf"]["weights"] == offline["weights"]
    assert r.scores["tokens"] == sum(len(t.steps) for t in r.traces)
    assert any(e["stopped"] == "deepconf" for e in r.samples)


def test_a_regex_that_never_matches_is_per_sample(tiny_lm):
    r = lmtrace.sample(tiny_lm, "Hello", n=2, answer_regex=r"NEVER\d{9}", **SETTINGS)
    assert [e["matched"] for e in r.samples] == [False, False] and r.scores["unmatched"] == [0, 1]
    assert r.votes["majority"]["answer"] is None and r.scores["semantic_entropy"] is None


def test_choice_gives_the_exact_choice_entropy(tiny_lm):
    r = lmtrace.sample(tiny_lm, "Hello", n=3, choice=["yes", "no"], max_new_tokens=8, temperature=1.0)
    p = [math.exp(c["logprob"]) for c in r.traces[0].choices]
    assert sum(p) == pytest.approx(1.0, abs=1e-6)
    assert r.scores["choice_entropy"] == pytest.approx(-sum(x * math.log(x) for x in p), abs=1e-9)
    assert {e["answer"] for e in r.samples} <= {"yes", "no"}


@pytest.mark.parametrize("kw, name", [({"n": 0}, "n must"), ({"deepconf": "mid"}, "deepconf"),
                                      ({"deepconf": "low", "warmup": 9}, "warmup"), ({"warmup": 2}, "warmup"),
                                      ({"answer_regex": "(", "n": 1}, "answer_regex"),
                                      ({"answer_regex": "x", "choice": ["a"]}, "choice")])  # fmt: skip
def test_bad_input_names_the_parameter(tiny_lm, kw, name):
    with pytest.raises(InvalidParameter, match=name):
        lmtrace.sample(tiny_lm, "Hello", **{"n": 4, **kw})


def test_cli_writes_json_and_html(tiny_dir, tmp_path, capsys):
    out, page = tmp_path / "s.json", tmp_path / "s.html"
    code = main(["sample", "Hello", "--model", str(tiny_dir), "-n", "3", "--answer-regex", r"(\w+)",
                 "--max-new-tokens", "6", "--seed", "5", "--json", str(out), "--html", str(page)])  # fmt: skip
    assert code == 0
    d = json.loads(out.read_text())
    assert [e["seed"] for e in d["samples"]] == [5, 6, 7] and len(d["traces"]) == 3
    html = page.read_text()
    assert "How sure was the model?" in html and "<script" not in html
    assert main(["sample", "Hello", "--model", str(tiny_dir), "-n", "0"]) == 2
    assert "n must be >= 1, got 0" in capsys.readouterr().err
