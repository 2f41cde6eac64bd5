"""--compile (issue 54): the static, compiled decode step (decode/static.py) gives the default
path's ids and its numbers within 5e-5 in float32 (the opt-in kernel rule), greedy and seeded
sampling, alone and in a padded batch; the trace's model.config names what ran compiled; what
cannot be compiled is refused in one line naming both options. One compile per case, on the
tiny model (torch.compile on a CPU takes tens of seconds)."""

from __future__ import annotations

import pytest

import lmtrace
from lmtrace.decode import static
from tests.tiny_gguf import write_tiny_gguf

TOL = 5e-5
PROMPTS = ["Once upon a time", "Hello world, the quick"]


def assert_close(plain, compiled) -> None:
    assert compiled.token_ids == plain.token_ids
    for a, b in zip(plain.steps, compiled.steps):
        assert b.rank == a.rank and [t.token_id for t in b.top] == [t.token_id for t in a.top]
        for x, y in [(a.logprob, b.logprob), (a.entropy, b.entropy), (a.sampled_logprob, b.sampled_logprob),
                     (a.sampled_entropy, b.sampled_entropy)] + [(s.logprob, t.logprob) for s, t in zip(a.top, b.top)]:
            assert abs(x - y) <= TOL, (x, y)
        # the KV record is the static cache's own: positions and bytes in use exact, its allocation larger
        assert b.kv["seq_len"] == a.kv["seq_len"] and b.kv.get("bytes_used") == a.kv["bytes"]
        assert b.kv["bytes"] == a.kv["bytes"] * static.capacity(a.kv["seq_len"]) // a.kv["seq_len"]


@pytest.mark.parametrize("kw", [{"temperature": 0, "top_logprobs": 3},
                                {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 3, "top_logprobs": 2}],
                         ids=["greedy", "seeded"])
def test_compiled_step_equals_the_default_path_in_a_batch(tiny_lm, kw):
    plain = lmtrace.generate(tiny_lm, PROMPTS, max_new_tokens=8, stop_on_eos=False, **kw)
    compiled = lmtrace.generate(tiny_lm, PROMPTS, max_new_tokens=8, stop_on_eos=False, compile=True, **kw)
    for a, b in zip(plain, compiled):
        assert_close(a, b)
        assert b.params["compile"] is True and b.kv_anatomy["mismatches"] == []
        assert b.model["config"]["compile"] == static.described(static.STEP, "cpu")
        assert "compile" not in a.model["config"]


def test_stream_compiled_stops_where_the_default_path_stops(tiny_lm):
    """stream takes compile; a stop string ends the row at the step the default path ends it
    (the step already in flight beyond it is dropped)."""
    kw = {"temperature": 0, "max_new_tokens": 8, "top_logprobs": 3}
    plain = list(lmtrace.stream(tiny_lm, PROMPTS[0], **kw))
    stop = {"stop": [plain[3].text]} if plain[3].text.strip() else {}
    plain = list(lmtrace.stream(tiny_lm, PROMPTS[0], **kw, **stop))
    compiled = list(lmtrace.stream(tiny_lm, PROMPTS[0], compile=True, **kw, **stop))
    assert [s.token_id for s in compiled] == [s.token_id for s in plain]
    assert [s.text for s in compiled] == [s.text for s in plain]
    assert all(abs(a.logprob - b.logprob) <= TOL for a, b in zip(plain, compiled))


def test_a_grammar_keeps_the_compiled_forward_and_says_so(tiny_lm):
    """What needs the host at every step runs the step eagerly beside the compiled forward."""
    kw = {"temperature": 0, "max_new_tokens": 6, "regex": "[a-c]{2,4}"}
    plain = lmtrace.generate(tiny_lm, PROMPTS[0], **kw)
    compiled = lmtrace.generate(tiny_lm, PROMPTS[0], compile=True, **kw)
    assert compiled.token_ids == plain.token_ids and compiled.text == plain.text
    assert compiled.model["config"]["compile"] == static.described(static.FORWARD, "cpu")


def test_compile_with_onednn_matmul_is_refused_in_one_line(tiny_dir):
    """The target's kernels cannot compile; nor can a `layers:N` draft's (the target's own layers)."""
    lm = lmtrace.load(str(tiny_dir), device="cpu", dtype="float32", matmul="onednn")
    for kw, option in (({}, "compile"), ({"draft": "layers:1"}, "draft")):
        refused = rf"^{option}: compile cannot be combined with matmul onednn"
        with pytest.raises(lmtrace.InvalidParameter, match=refused):
            lmtrace.generate(lm, "Hi", max_new_tokens=2, temperature=0, compile=True, **kw)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_tok):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMTRACE_GGUF_CACHE", "0")
        yield write_tiny_gguf(tmp_path_factory.mktemp("static") / "tiny.gguf", tiny_tok, qtype="Q4_1")


def test_a_packed_load_compiles_on_lmtraces_kernel(tiny_gguf, capsys):
    """`weights="packed"` on lmtrace's own kernel (float32 inputs; a C compiler here) compiles, the
    kernel one opaque operation in the graph: the eager packed path's ids, its numbers within 5e-5;
    the CLI no longer refuses it before loading."""
    from lmtrace.cli import main

    lm = lmtrace.load(str(tiny_gguf), device="cpu", dtype="float32", weights="packed")
    assert lm.model.lmtrace_packed.compute_dtype == "float32"
    kw = {"max_new_tokens": 8, "stop_on_eos": False, "temperature": 0, "top_logprobs": 3}
    plain = lmtrace.generate(lm, PROMPTS, **kw)
    compiled = lmtrace.generate(lm, PROMPTS, compile=True, **kw)
    for a, b in zip(plain, compiled):
        assert_close(a, b)
        assert b.model["config"]["compile"] == static.described(static.STEP, "cpu")
    assert main(["generate", "x", "--model", "/nonexistent", "--weights", "packed", "--compile"]) == 2
    assert "compile" not in capsys.readouterr().err  # the missing model is the one line, not the pair


def test_a_load_packed_for_torchs_kernel_does_not_compile(tiny_gguf, capsys, monkeypatch, tmp_path):
    """Without a C compiler the packed layers run torch's int4 kernel on bfloat16 inputs, and
    compile is refused in one line naming both (before loading in the CLI): the compiled graph's
    float32 rounding moved the bundled model's packed logprobs by up to 0.09 there; a packed draft
    still compiles (below)."""
    from lmtrace.cli import main
    from lmtrace.model.fused import build

    monkeypatch.setenv("LMTRACE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    build.library.cache_clear()
    try:
        lm = lmtrace.load(str(tiny_gguf), device="cpu", dtype="float32", weights="packed")
        with pytest.raises(lmtrace.InvalidParameter, match="compile: not with weights packed on torch's int4"):
            lmtrace.generate(lm, PROMPTS[0], max_new_tokens=2, compile=True)
        assert main(["generate", "x", "--model", "/nonexistent", "--weights", "packed", "--compile"]) == 2
    finally:
        build.library.cache_clear()
    err = capsys.readouterr().err
    assert "compile: not with --weights packed on torch's int4 kernel" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def onednn_lm(tiny_gguf):
    return lmtrace.load(str(tiny_gguf), device="cpu", dtype="float32", matmul="onednn")


DRAFTED = {"max_new_tokens": 8, "stop_on_eos": False, "temperature": 0, "top_logprobs": 3, "draft": "packed"}


@pytest.fixture(scope="module")
def drafted_eager(onednn_lm):
    return lmtrace.generate(onednn_lm, PROMPTS[0], **DRAFTED, draft_tokens="auto")


def test_onednn_target_with_a_compiled_packed_draft(onednn_lm, drafted_eager):
    """`--matmul onednn --draft packed --compile`: the draft's step compiles (its own packed
    model), the target verifies on oneDNN; the tokens and numbers of the eager drafted run."""
    compiled = lmtrace.generate(onednn_lm, PROMPTS[0], **DRAFTED, draft_tokens="auto", compile=True)
    assert compiled.token_ids == drafted_eager.token_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(drafted_eager.steps, compiled.steps)) <= TOL
    assert compiled.model["config"]["compile"] == static.described(static.DRAFT, "cpu")
    assert compiled.speculative["draft_tokens"] == "auto"


def test_a_server_on_onednn_compiles_its_packed_draft(onednn_lm, drafted_eager):
    """`lmtrace serve --matmul onednn --draft packed --compile`: a request's `compile` decodes as
    generate(compile=True) does, the draft's step compiled and the target on oneDNN; with
    draft_tokens 0 nothing could compile (the target's kernel), a 400 naming compile."""
    from fastapi.testclient import TestClient

    from lmtrace.server import create_app

    app = create_app(onednn_lm, name="tiny", draft="packed", draft_tokens="auto", compile=True)
    body = {"prompt": PROMPTS[0], "compile": True, "max_tokens": 8, "temperature": 0, "top_logprobs": 3}
    with TestClient(app) as client:
        answer = client.post("/v1/traces", json={**body, "ignore_eos": True})
        refused = client.post("/v1/traces", json={**body, "draft_tokens": 0})
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert [s["token_id"] for s in got["steps"]] == drafted_eager.token_ids
    assert max(abs(s["logprob"] - a.logprob) for s, a in zip(got["steps"], drafted_eager.steps)) <= TOL
    assert got["model"]["config"]["compile"] == static.described(static.DRAFT, "cpu")
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "compile" and "draft_tokens 0" in error["message"]


def test_capacity_is_whole_buckets():
    assert [static.capacity(n) for n in (1, 256, 257)] == [256, 256, 512]


def test_grouped_attention_is_sdpa_without_repeating_heads(tiny_lm):
    """A one-token query in a compiled graph attends with SDPA's own grouped-query path (no copy
    of each key/value head per query head); its output is transformers' sdpa's within 1e-6, and
    eager calls and the model's attention name are left as they were."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lmtrace.model import grouped_attention

    attn = tiny_lm.model.model.layers[0].self_attn  # 4 query heads over 2 key/value heads
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, h, n, 16, generator=g) for h, n in ((4, 1), (2, 40), (2, 40)))
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    mask[0, ..., 30:] = False  # the unfilled end of a static cache
    want, _ = sdpa_attention_forward(attn, query, key, value, mask, scaling=0.25)
    compiled = torch.compile(lambda *a: grouped_attention.grouped_sdpa(attn, *a, scaling=0.25)[0], dynamic=False)
    assert (compiled(query, key, value, mask) - want).abs().max() <= 1e-6
    eager, _ = grouped_attention.grouped_sdpa(attn, query, key, value, mask, scaling=0.25)
    assert torch.equal(eager, want)
    with grouped_attention.grouped(tiny_lm.model):
        assert tiny_lm.model.config._attn_implementation == grouped_attention.NAME
    assert tiny_lm.model.config._attn_implementation == "sdpa"


def test_a_sliding_window_model_compiles_once_not_every_step(tiny_tok):
    """Gemma 3's sliding layers keep their length in a Python int (transformers'
    StaticSlidingWindowLayer): compiled with static shapes, every step recompiled until
    torch.compile's limit, then ran eager (the 270M file: 110 s for its first 24 tokens). With
    that int left dynamic, two graphs serve the whole run, past the window too; the numbers
    stay the default path's within 5e-5."""
    import torch._dynamo

    from tests.tiny_archs import tiny_gemma3

    lm = tiny_gemma3(tiny_tok, ["sliding_attention"] * 2 + ["full_attention"], window=8)
    kw = {"max_new_tokens": 14, "stop_on_eos": False, "temperature": 0, "top_logprobs": 3}
    plain = lmtrace.generate(lm, PROMPTS[1], **kw)
    torch._dynamo.utils.counters.clear()
    compiled = lmtrace.generate(lm, PROMPTS[1], compile=True, **kw)
    assert compiled.token_ids == plain.token_ids
    for a, b in zip(plain.steps, compiled.steps):
        assert abs(a.logprob - b.logprob) <= TOL and abs(a.entropy - b.entropy) <= TOL
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs <= 4, graphs  # 2 here; 8 (the limit) with static shapes
