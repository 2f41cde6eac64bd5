"""The audit's tests use the server tests' tiny chat model and their real uvicorn server; the
model also as a folder (with its chat template) for the command line."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lmtrace.model.lm import LM
from tests.server.conftest import chat_lm  # noqa: F401  (a fixture)
from tests.tiny import tiny_model


@pytest.fixture(scope="session")
def chat_dir(tmp_path_factory, chat_lm):  # noqa: F811
    path = tmp_path_factory.mktemp("tiny-chat")
    chat_lm.model.save_pretrained(path)
    chat_lm.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def other_lm() -> LM:
    """A tiny model with another tokenizer (trained on other text): a server that serves it
    serves another model than the audit's."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<eos>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog, quickly and quietly."] * 8, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    return LM.from_objects(tiny_model(fast), fast, source="other")
