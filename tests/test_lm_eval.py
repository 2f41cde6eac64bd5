"""lm-evaluation-harness end to end: lm-eval's `local-completions` model in its default mode
(`tokenized_requests=True`: prompts sent as lists of token-id lists), batch size 4 and 4
concurrent requests, against a real `lmtrace serve` process, on three small local tasks
(tests/lmeval/): multiple choice, loglikelihood_rolling and generate_until. Every per-sample
log-likelihood equals lmtrace.score's on the same (context, continuation), with the server's
prefix cache on and off, and the greedy generations equal lmtrace.generate's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import lmtrace
from tests.server.process import free_port, start_serve

lm_eval = pytest.importorskip("lm_eval")
HERE = Path(__file__).parent / "lmeval"
TASKS = ["lmtrace_mc", "lmtrace_rolling", "lmtrace_gen"]


@pytest.fixture(scope="module", params=["prefix cache on", "prefix cache off"])
def evaluated(request, tiny_dir, tmp_path_factory):
    """lm-eval's samples of the three tasks (the scoring ones without the prefix cache), run
    through `lmtrace serve` on the tiny model."""
    from lm_eval.tasks import TaskManager

    cache_on = request.param == "prefix cache on"
    tasks_run = TASKS if cache_on else TASKS[:2]

    tasks = tmp_path_factory.mktemp("lmeval-tasks")
    for name in TASKS:  # the task files name their data relative to the repository: made absolute
        text = (HERE / f"{name}.yaml").read_text(encoding="utf-8").replace("tests/lmeval/", f"{HERE}/")
        (tasks / f"{name}.yaml").write_text(text, encoding="utf-8")
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets-cache")))
    extra = [] if cache_on else ["--prefix-cache-mb", "0"]
    proc, url = start_serve(tiny_dir, free_port(), "--served-model-name", "tiny", *extra)
    try:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={
                "model": "tiny",
                "base_url": f"{url}/v1/completions",
                "tokenizer": str(tiny_dir),
                "tokenizer_backend": "huggingface",
                "tokenized_requests": True,  # lm-eval's default, said out loud
                "num_concurrent": 4,
                "max_retries": 1,
                "max_length": 256,  # the tiny model's context
            },
            tasks=tasks_run,
            batch_size=4,
            log_samples=True,
            task_manager=TaskManager(include_path=str(tasks)),
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        mp.undo()
    return results


def _args(sample: dict) -> list[tuple]:
    """Each request's arguments, in lm-eval's older list shape or its newer dict shape."""
    args = sample["arguments"]
    if isinstance(args, dict):
        return [tuple(a[f"arg_{i}"] for i in range(len(a))) for a in args.values()]
    return [tuple(a) for a in args]


def test_multiple_choice_loglikelihoods_equal_lmtrace_score(evaluated, tiny_lm):
    samples = evaluated["samples"]["lmtrace_mc"]
    assert len(samples) == 6
    for sample in samples:
        pairs = _args(sample)
        assert len(pairs) == len(sample["doc"]["choices"])
        for (context, continuation), resp in zip(pairs, sample["resps"]):
            expected = lmtrace.score(tiny_lm, prompt=context, continuation=continuation).total_logprob
            assert abs(resp[0][0] - expected) <= 1e-4, (context, continuation)
    assert 0.0 <= evaluated["results"]["lmtrace_mc"]["acc,none"] <= 1.0


def test_rolling_loglikelihoods_equal_lmtrace_score(evaluated, tiny_lm):
    samples = evaluated["samples"]["lmtrace_rolling"]
    assert len(samples) == 5
    eos = tiny_lm.tokenizer.eos_token  # lm-eval conditions a text's first token on the end token
    for sample in samples:
        (text,) = _args(sample)[0]
        expected = lmtrace.score(tiny_lm, prompt=eos, continuation=text).total_logprob
        assert abs(sample["resps"][0][0] - expected) <= 1e-4, text
    assert math.isfinite(evaluated["results"]["lmtrace_rolling"]["word_perplexity,none"])


def test_greedy_generations_equal_lmtrace_generate(evaluated, tiny_lm):
    if "lmtrace_gen" not in evaluated["samples"]:
        pytest.skip("generations are run once, with the prefix cache on")
    samples = evaluated["samples"]["lmtrace_gen"]
    assert len(samples) == 5
    for sample in samples:
        context, kwargs = _args(sample)[0]
        stop = [*kwargs["until"], tiny_lm.tokenizer.eos_token]  # lm-eval adds the end token's text
        trace = lmtrace.generate(tiny_lm, context, max_new_tokens=12, temperature=0, stop=stop)
        assert sample["resps"][0][0] == trace.text, context
