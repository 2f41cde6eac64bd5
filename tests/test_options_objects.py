"""The public functions that take their settings as one options object (load, sample, kvlab,
intervene, stability, audit, create_app, ray_engine): the object passed whole gives what the
same keywords give, keywords are laid over a given object, and a keyword that is no setting is
refused in one line naming it and the function, before any work starts."""

from __future__ import annotations

import pytest
import torch

import lmtrace
from lmtrace.batch.ray_engine import RayOptions, ray_engine
from lmtrace.comparison.audit.runner import audit
from lmtrace.interventions import InterveneOptions
from lmtrace.kvlab import LabOptions
from lmtrace.samples.settings import SampleOptions
from lmtrace.scoring.stability.ledger import StabilityOptions
from lmtrace.server import ServerOptions, create_app


def test_load_options_whole_equal_the_keywords(tiny_dir):
    by_keywords = lmtrace.load(str(tiny_dir), device="cpu", dtype="float32")
    whole = lmtrace.load(str(tiny_dir), lmtrace.LoadOptions(device="cpu", dtype="float32"))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(by_keywords.model(ids).logits, whole.model(ids).logits)
    assert by_keywords.summary.to_dict() == whole.summary.to_dict()


def test_sample_options_whole_equal_the_keywords(tiny_lm):
    settings = {"answer_regex": r"(\w+)", "confidence_window": 4}
    by_keywords = lmtrace.sample(tiny_lm, "Hello", 3, max_new_tokens=5, temperature=1.0, seed=2, **settings)
    whole = lmtrace.sample(
        tiny_lm, "Hello", 3, None, SampleOptions(**settings), max_new_tokens=5, temperature=1.0, seed=2
    )
    assert whole.settings == by_keywords.settings
    assert [t.token_ids for t in whole.traces] == [t.token_ids for t in by_keywords.traces]
    assert whole.samples == by_keywords.samples


def test_keywords_are_laid_over_a_given_object(tiny_lm):
    app = create_app(tiny_lm, ServerOptions(name="first", max_batch=1), name="second")
    assert app.state.lmtrace.name == "second"
    lab = lmtrace.kvlab(tiny_lm, "Hello", ["full"], LabOptions(map_step=0), max_new_tokens=3, temperature=0)
    assert lab.map_step == 0


@pytest.mark.parametrize(
    "call, entry",
    [
        (lambda lm: lmtrace.load("unused", colour=1), "load"),
        (lambda lm: lmtrace.sample(lm, "Hello", colour=1), "sample"),
        (lambda lm: lmtrace.kvlab(lm, "Hello", ["full"], colour=1), "kv-lab"),
        (lambda lm: lmtrace.intervene(lm, "Hello", ["0.mlp"], colour=1), "intervene"),
        (lambda lm: lmtrace.stability(lm, "Hello", ["threads:1"], colour=1), "stability"),
        (lambda lm: audit(lm, "http://127.0.0.1:9", colour=1), "audit"),
        (lambda lm: create_app(lm, colour=1), "create_app"),
        (lambda lm: ray_engine({}, {}, 1, colour=1), "ray_engine"),
    ],
)
def test_an_unknown_keyword_is_one_line_naming_it(tiny_lm, call, entry):
    with pytest.raises(lmtrace.InvalidParameter, match=f"^colour: {entry} does not take colour$"):
        call(tiny_lm)


def test_the_objects_hold_the_defaults_the_keywords_had():
    assert InterveneOptions().free is True and InterveneOptions().chat is False
    assert StabilityOptions().runs == 1 and RayOptions().num_workers == 1
    assert lmtrace.LoadOptions().device == "auto" and ServerOptions().max_batch == 16
