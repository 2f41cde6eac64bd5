"""kv-size from a config alone: known published configs and the CLI."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from lmtrace.cli import main
from lmtrace.kv import size as kvsize

LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
             "num_hidden_layers": 32, "intermediate_size": 14336, "max_position_embeddings": 8192,
             "vocab_size": 128256, "dtype": "bfloat16"}  # fmt: skip
# Qwen2.5-7B-Instruct: sets sliding_window but use_sliding_window false, so nothing is windowed
QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
             "num_hidden_layers": 28, "intermediate_size": 18944, "max_position_embeddings": 32768,
             "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28, "vocab_size": 152064,
             "dtype": "bfloat16"}  # fmt: skip
# Gemma-2-2B: explicit head_dim 256 (hidden 2304 / 8 heads would be 288); layers alternate sliding 4096 / full
GEMMA2_2B = {"model_type": "gemma2", "hidden_size": 2304, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 256, "num_hidden_layers": 26, "intermediate_size": 9216, "max_position_embeddings": 8192,
             "sliding_window": 4096, "vocab_size": 256000, "dtype": "bfloat16"}  # fmt: skip
FALCON_MQA = {"model_type": "llama", "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 1,
              "num_hidden_layers": 12, "intermediate_size": 2048, "max_position_embeddings": 4096,
              "vocab_size": 1000}  # fmt: skip


def config(d):
    d = dict(d)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def test_llama3_8b_is_128_kib_per_token_in_bf16():
    an = kvsize.anatomy(config(LLAMA3_8B), "bfloat16")
    assert an.attention == "GQA (group size 4)"
    assert an.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert an.bytes_at(8192) == 1 << 30  # 1 GiB at 8k context


def test_qwen2_use_sliding_window_false_is_not_windowed():
    an = kvsize.anatomy(config(QWEN25_7B), "bfloat16")
    assert an.sliding_layers == []
    assert an.bytes_at(32768) == 2 * 28 * 4 * 128 * 32768 * 2


def test_gemma2_alternating_layers_and_explicit_head_dim():
    an = kvsize.anatomy(config(GEMMA2_2B), "bfloat16")
    assert an.head_dim == 256 and "explicit" in an.sources["head_dim"]
    assert an.sliding_layers == list(range(0, 26, 2))
    full = 13 * 2 * 4 * 256 * 8192 * 2
    sliding = 13 * 2 * 4 * 256 * 4095 * 2
    assert an.bytes_at(8192) == full + sliding
    assert an.bytes_at(1000) == 26 * 2 * 4 * 256 * 1000 * 2  # below the window every layer holds everything


def test_mqa():
    an = kvsize.anatomy(config(FALCON_MQA), "float16", batch=4)
    assert an.attention == "MQA"
    assert an.bytes_at(100) == 2 * 12 * 1 * 64 * 100 * 4 * 2


def test_latent_attention_is_refused_rather_than_guessed():
    cfg = AutoConfig.for_model("deepseek_v3", num_hidden_layers=2)
    with pytest.raises(kvsize.UnsupportedCacheLayout, match="multi-head latent attention"):
        kvsize.anatomy(cfg)


def test_cli_on_a_config_file(tmp_path, capsys):
    f = tmp_path / "config.json"
    f.write_text(json.dumps(LLAMA3_8B))
    out = tmp_path / "size.json"
    assert main(["kv-size", str(f), "--context", "8192", "--batch", "2", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["bytes_per_token"] == 131072 and d["total_bytes"] == 2 << 30 and d["dtype"] == "bfloat16"
    assert [r["context"] for r in d["table"]] == [1024, 2048, 4096, 8192]
    assert "128.00 KiB per token" in capsys.readouterr().out


def test_cli_matches_the_measured_ledger_of_the_tiny_model(tiny_dir, tiny_lm, capsys):
    import lmtrace

    trace = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=5, temperature=0)
    last = trace.steps[-1].kv
    assert main(["kv-size", str(tiny_dir), "--context", str(last["seq_len"]), "--dtype", "float32",
                 "--json", "-"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["total_bytes"] == last["bytes"]


@pytest.mark.parametrize("args,message", [
    (["--context", "0"], "context must be >= 1, got 0"),
    (["--context", "10", "--batch", "0"], "batch must be >= 1, got 0"),
    (["--context", "10", "--dtype", "int3"], "dtype must be one of float32, float16, bfloat16, float8, got 'int3'"),
])  # fmt: skip
def test_cli_bad_values(tiny_dir, capsys, args, message):
    assert main(["kv-size", str(tiny_dir), *args]) == 2
    assert capsys.readouterr().err == f"lmtrace: error: {message}\n"


def test_cli_folder_without_config(tmp_path, capsys):
    assert main(["kv-size", str(tmp_path), "--context", "10"]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.integration
def test_cli_matches_the_bundled_ledger(bundled_lm, capsys):
    import lmtrace

    trace = lmtrace.generate(bundled_lm, "Hello", max_new_tokens=3, temperature=0)
    last = trace.steps[-1].kv
    assert main(["kv-size", "--context", str(last["seq_len"]), "--json", "-"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["total_bytes"] == last["bytes"] and d["bytes_per_token"] == 46080
