"""With --chat, the prompt is the user's turn and the steps are the assistant's answer: the
terminal view and the report mark the boundary instead of running the two together, and the
report's text stays exactly prompt + answer (the labels are CSS content, not text)."""

from __future__ import annotations

import copy
import json

import pytest
from rich.text import Text

import lmtrace
from lmtrace.render.html.trace import write_html
from lmtrace.render.terminal.trace import coloured_text
from tests.server.cdp import find_browser

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def chat_lm(tiny_lm):
    tokenizer = copy.deepcopy(tiny_lm.tokenizer)
    tokenizer.chat_template = TEMPLATE
    return lmtrace.LM.from_objects(tiny_lm.model, tokenizer, "tiny-chat")


def traces(lm):
    chat = lmtrace.generate(lm, "Answer briefly.", max_new_tokens=6, temperature=0, chat=True)
    plain = lmtrace.generate(lm, "Answer briefly.", max_new_tokens=6, temperature=0)
    return chat, plain


def test_the_terminal_shows_the_turns_only_with_chat(chat_lm):
    chat, plain = traces(chat_lm)
    shown = lambda trace: Text("".join(s.text for s in trace.steps)).plain  # noqa: E731 (rich drops control codes)
    assert coloured_text(chat).plain == f"user ▸ Answer briefly.\nassistant ▸ {shown(chat)}"
    assert coloured_text(plain).plain == "Answer briefly." + shown(plain)


def test_the_cli_prints_the_boundary(tmp_path, chat_lm, capsys):
    from lmtrace.cli import main

    folder = tmp_path / "chat-model"
    chat_lm.model.save_pretrained(folder)
    chat_lm.tokenizer.save_pretrained(folder)
    code = main(["generate", "Answer briefly.", "--model", str(folder), "--chat", "--max-new-tokens", "3",
                 "--temperature", "0", "--no-color"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "user ▸ Answer briefly.\nassistant ▸ " in out


def test_the_report_marks_the_turns(chat_lm, tmp_path):
    chat, plain = traces(chat_lm)
    write_html(tmp_path / "chat.html", chat)
    write_html(tmp_path / "plain.html", plain)
    page = (tmp_path / "chat.html").read_text()
    assert page.count('class="turn"') == 2 and 'data-role="user"' in page and 'data-role="assistant"' in page
    assert 'class="turn"' not in (tmp_path / "plain.html").read_text()


@pytest.mark.skipif(find_browser() is None, reason="no Chromium on this machine")
def test_the_turns_are_laid_out_on_their_own_lines_in_chromium(chat_lm, tmp_path):
    from tests.test_report_browser import open_report, problems

    chat, _ = traces(chat_lm)
    write_html(tmp_path / "chat.html", chat)
    browser = open_report(tmp_path / "chat.html", tmp_path / "profile")
    try:
        found = json.loads(browser.js("""JSON.stringify((() => {
          const text = document.querySelector('section#text .text');
          const box = e => e.getBoundingClientRect();
          const [user, assistant] = text.querySelectorAll('.turn');
          const prompt = text.querySelector('.prompt'), first = text.querySelector('.tok');
          const label = e => getComputedStyle(e, '::before').content;
          const toks = [...text.querySelectorAll('.tok')].map(t => t.textContent).join('');
          return {text: text.textContent, parts: prompt.textContent + toks,
                  turns: user.textContent + assistant.textContent,
                  labels: [label(user), label(assistant)],
                  order: [box(user).bottom <= box(prompt).top + 1, box(prompt).bottom <= box(assistant).top + 1,
                          box(assistant).bottom <= box(first).top + 1]};
        })())"""))
        assert found["text"] == found["parts"] and found["turns"] == ""  # the labels add no text
        assert found["text"].startswith("Answer briefly.")
        assert found["labels"] == ['"user"', '"assistant"'] and found["order"] == [True, True, True]
        assert problems(browser) == []
    finally:
        browser.close()
