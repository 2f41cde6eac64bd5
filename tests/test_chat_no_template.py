"""--chat on a model whose tokenizer has no chat template: one line naming --chat and the model,
exit 2, from every command that takes it (and InvalidParameter in the library)."""

from __future__ import annotations

import pytest

import lmtrace
from lmtrace.cli import main
from lmtrace.errors import InvalidParameter
from tests.cli_errors import one_error

COMMANDS = [
    ["generate", "Hello"],
    ["cache", "Hello"],
    ["branch", "Hello", "--at", "1"],
    ["verify", "Hello"],
    ["stability", "Hello", "--variant", "dtype:bfloat16"],
    ["kv-lab", "Hello", "--policy", "window:size=4"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_chat_without_a_template_is_one_line_exit_2(capsys, tiny_dir, command):
    code = main([*command, "--model", str(tiny_dir), "--chat", "--max-new-tokens", "2", "--no-color"])
    line = one_error(capsys.readouterr().err)
    assert code == 2, line
    assert "--chat" in line and str(tiny_dir) in line and "no chat template" in line


def test_the_library_raises_invalid_parameter(tiny_lm):
    assert not tiny_lm.tokenizer.chat_template
    with pytest.raises(InvalidParameter, match="chat"):
        lmtrace.generate(tiny_lm, "Hello", max_new_tokens=2, chat=True)
