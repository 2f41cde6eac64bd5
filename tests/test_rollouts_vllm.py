"""lmtrace.rollouts on rollouts decoded by vLLM (CPU, float32) from the bundled model, with
`logprobs` returned (processed mode: those of the distribution the sampler drew from): each
RequestOutput written as JSON the way docs/rollouts.md says (`--format vllm`), GRPO groups of n
samples sharing their prompt. The raw and processed logprobs equal transformers' own
teacher-forced log-softmax and warpers within 5e-5 (batched, float32), engine − raw =
processing + residual within 1e-6 on every token, and the clean float32 rollouts get no cause
and no token with a ratio outside [0.9, 1.1]. The engine is the session's (tests/conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest

import lmtrace
from tests.test_rollouts import oracle
from tests.vllm_world import needs_vllm

pytestmark = [*needs_vllm, pytest.mark.integration]
# (prompt, sampling, n): two GRPO groups under temperature and top-p, one under top-k at T = 1
REQUESTS = [
    ("The capital of France is", {"temperature": 0.7, "top_p": 0.9}, 3),
    ("Once upon a time", {"temperature": 0.7, "top_p": 0.9}, 3),
    ("def add(a, b):", {"temperature": 1.0, "top_k": 40}, 2),
]
TOKENS = 10


def request_output(out: Any, sampling: Any) -> dict[str, Any]:
    """A vLLM RequestOutput (and the SamplingParams it was asked with) as one JSON line."""
    outputs = [{"index": c.index, "token_ids": list(c.token_ids),
                "logprobs": [{str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                              for t, lp in step.items()} for step in c.logprobs]}
               for c in out.outputs]  # fmt: skip
    params = {k: getattr(sampling, k) for k in ("temperature", "top_p", "top_k", "min_p")}
    return {"request_id": out.request_id, "prompt_token_ids": list(out.prompt_token_ids), "outputs": outputs,
            "sampling_params": params}  # fmt: skip


@pytest.fixture(scope="module")
def decoded(bundled_lm, bundled_vllm):
    """(lines of the vllm format, [(prompt ids, completion ids, sampling settings)] per rollout)."""
    from vllm import SamplingParams as VllmParams

    prompts, params = [], []
    for seed, (text, sampling, n) in enumerate(REQUESTS):
        prompts.append({"prompt_token_ids": list(bundled_lm.tokenizer(text)["input_ids"])})
        params.append(VllmParams(n=n, max_tokens=TOKENS, logprobs=0, seed=seed, **sampling))
    outs = bundled_vllm.llm.generate(prompts, params, use_tqdm=False)
    lines = [request_output(o, p) for o, p in zip(outs, params)]
    flat = [(list(o.prompt_token_ids), list(c.token_ids), s) for o, (_, s, _) in zip(outs, REQUESTS) for c in o.outputs]
    return lines, flat


@pytest.fixture(scope="module")
def report(bundled_lm, decoded):
    return lmtrace.rollouts(bundled_lm, decoded[0], fmt="vllm", caps=[2])


def test_numbers_equal_transformers_and_the_split_adds_up(bundled_lm, decoded, report):
    lines, flat = decoded
    assert [r["id"] for r in report["rollouts"]] == [
        f"{x['request_id']}/{o['index']}" for x in lines for o in x["outputs"]
    ]
    worst, residual = 0.0, 0.0
    for (prompt, completion, sampling), out in zip(flat, report["rollouts"]):
        raw, processed = oracle(bundled_lm.model, prompt, completion, sampling)
        assert [t["token_id"] for t in out["tokens"]] == completion
        for t, a, p in zip(out["tokens"], raw, processed):
            worst = max(worst, abs(t["raw_logprob"] - a), abs(t["processed_logprob"] - p))
            split = t["processing"] + t["residual"] - (t["engine_logprob"] - t["raw_logprob"])
            assert abs(split) <= 1e-6, (out["id"], t["index"], split)
            residual = max(residual, abs(t["residual"]))
    assert worst < 5e-5, worst
    assert residual < 1e-3, residual  # vLLM's float32 kernels against transformers': noise, not a cause


def test_clean_float32_rollouts_have_no_cause(report):
    s = report["summary"]
    assert s["causes"] == [] and all(r["causes"] == [] for r in report["rollouts"])
    assert s["outside_0_9_1_1"] == 0.0 and s["flagged"] == 0
    assert s["caps"][0]["tokens_masked"] == 0.0 and s["caps"][0]["sequences_masked"] == 0.0
    assert s["sequences"] == sum(n for _, _, n in REQUESTS) and s["mean_abs_delta"] < 1e-4
