"""The terminal at 80 columns: `generate`, `cache` and `render --lens` fit, and no line wraps back
to column 0 (every line that starts there at 80 columns starts a line at 200 columns too); the
cache chart's label sits on its axis and `cache` prints the generated text; a character split
over byte tokens shows as that character; the templated prompt behind --show-prompt; --step
alone shows that step."""

from __future__ import annotations

import json

import pytest
from rich.cells import cell_len

from lmtrace.cli import main
from tests import handmade
from tests.server.conftest import CHATML


def run(capsys, monkeypatch, width: int, *args) -> tuple[int, list[str]]:
    monkeypatch.setenv("COLUMNS", str(width))
    code = main([str(a) for a in args])
    return code, [line.rstrip() for line in capsys.readouterr().out.splitlines()]


def starts(lines: list[str]) -> set[str]:
    return {line[:12] for line in lines if line and not line[0].isspace()}


def check_80(capsys, monkeypatch, *args) -> list[str]:
    """The command's view at 80 columns, checked against the same view at 200."""
    code, narrow = run(capsys, monkeypatch, 80, *args)
    assert code == 0
    _, wide = run(capsys, monkeypatch, 200, *args)
    assert all(cell_len(line) <= 80 for line in narrow), [line for line in narrow if cell_len(line) > 80]
    wrapped = starts(narrow) - starts(wide)
    assert not wrapped, f"lines wrapped back to column 0: {wrapped}"
    return narrow


def test_generate_at_80_columns(capsys, monkeypatch, tiny_dir):
    lines = check_80(capsys, monkeypatch, "generate", "Hello world", "--model", tiny_dir, "--max-new-tokens", "6",
                     "--temperature", "0", "--no-color")  # fmt: skip
    assert lines[0] == str(tiny_dir) and lines[1].startswith("  LlamaForCausalLM")


def test_cache_at_80_columns_prints_the_text_and_a_chart_on_its_axis(capsys, monkeypatch, tiny_dir):
    lines = check_80(capsys, monkeypatch, "cache", "Hello world, the quick brown fox jumps over the lazy dog again",
                     "--model", tiny_dir, "--max-new-tokens", "5", "--temperature", "0", "--no-color")  # fmt: skip
    assert "generated" in lines
    text = lines[lines.index("generated") + 1]
    assert text.startswith("Hello world, the quick brown fox")
    top = next(i for i, line in enumerate(lines) if line.endswith("┤") or "┤" in line)
    axis = lines[top].index("┤")
    assert all(lines[k].index("│") == axis for k in range(top + 1, top + 6))
    assert lines[top + 6].index("└") == axis and lines[top + 6].strip().startswith("0 └")


def test_render_lens_at_80_columns_and_step_alone(capsys, monkeypatch, tiny_dir, tmp_path):
    saved = tmp_path / "t.json"
    code, _ = run(capsys, monkeypatch, 200, "generate", "Hello world", "--model", tiny_dir, "--max-new-tokens", "4",
                  "--temperature", "0", "--lens", "--attention", "--json", saved)  # fmt: skip
    assert code == 0
    lens = check_80(capsys, monkeypatch, "render", saved, "--lens", "--step", "2", "--no-color")
    assert lens[0].startswith("logit lens: settled at layer") and any(line.startswith("step 2:") for line in lens)
    code, alone = run(capsys, monkeypatch, 80, "render", saved, "--step", "2", "--no-color")
    assert code == 0 and alone == lens  # --step without --lens shows that step's layers
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(handmade.trace_dict()))
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["render", str(plain), "--step", "1"]) == 2
    assert capsys.readouterr().err.startswith("lmtrace: error: step: this trace has no lens or attention records")


def test_a_character_over_byte_tokens_shows_as_that_character(capsys, monkeypatch, tmp_path):
    saved = tmp_path / "zh.json"
    saved.write_text(json.dumps(handmade.trace_dict()))  # 美 (E7 BE 8E) over steps 4, 5, 6
    lines = check_80(capsys, monkeypatch, "render", saved, "--no-color")
    rows = {line.split()[0]: line for line in lines if line[:3].strip().isdigit()}
    assert rows["4"].split()[1] == "美…" and rows["5"].split()[1] == "…美…" and rows["6"].split()[1] == "…美"
    assert not any("<0x" in rows[k] for k in ("4", "5", "6"))


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tiny_lm):
    """The tiny model saved with a chat template that adds a system prompt of its own."""
    import copy

    path = tmp_path_factory.mktemp("tiny-chat")
    tok = copy.deepcopy(tiny_lm.tokenizer)
    tok.chat_template = "<|system|>Be brief.\n" + CHATML
    tiny_lm.model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_the_templated_prompt_in_the_json_report_and_behind_show_prompt(capsys, monkeypatch, chat_dir, tmp_path):
    saved, report = tmp_path / "chat.json", tmp_path / "chat.html"
    args = ["generate", "Hi", "--model", chat_dir, "--chat", "--max-new-tokens", "3", "--temperature", "0",
            "--no-color", "--json", saved, "--html", report]  # fmt: skip
    code, plain = run(capsys, monkeypatch, 80, *args)
    assert code == 0 and not any("Be brief." in line for line in plain)
    assert any("--show-prompt shows it whole" in line for line in plain)
    templated = json.loads(saved.read_text())["prompt"]["templated"]
    assert templated.startswith("<|system|>Be brief.\n<|user|>Hi\n<|assistant|>")
    assert "Be brief." in report.read_text()  # the report shows the whole prompt
    code, shown = run(capsys, monkeypatch, 80, *args, "--show-prompt")
    assert code == 0 and "<|system|>Be brief." in shown
