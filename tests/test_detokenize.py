from __future__ import annotations

import pytest

from lmtrace.detokenize import IncrementalDetokenizer, TokenBytes

TEXTS = ["很久很久以前，", "🙂 wörld", "Hello world, naïve café!", "a\n\tb  c"]


def pieces(tokenizer, ids):
    d = IncrementalDetokenizer(tokenizer)
    out = [d.add(i) for i in ids]
    out[-1] += d.flush()
    return out


def check(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    got = pieces(tokenizer, ids)
    assert "".join(got) == tokenizer.decode(ids) == text
    # no piece ever carries half a character
    assert all("\ufffd" not in p for p in got)
    tb = TokenBytes(tokenizer)
    assert b"".join(tb(i) for i in ids) == text.encode("utf-8")
    return ids, got


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_decode_tiny(tiny_tok, text):
    check(tiny_tok, text)


def test_split_character_piece_is_empty_until_complete(tiny_tok):
    ids, got = check(tiny_tok, "🙂")
    assert len(ids) > 1, "the emoji must be split over byte tokens for this test to mean anything"
    assert got[:-1] == [""] * (len(ids) - 1) and got[-1] == "🙂"


def test_incomplete_tail_is_flushed_at_the_end(tiny_tok):
    ids = tiny_tok("🙂", add_special_tokens=False)["input_ids"][:-1]
    got = pieces(tiny_tok, ids)
    assert "".join(got) == tiny_tok.decode(ids)
    assert got[-1].endswith("\ufffd")


@pytest.mark.integration
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_decode_bundled(bundled_lm, text):
    check(bundled_lm.tokenizer, text)


@pytest.mark.integration
def test_special_token_bytes(bundled_lm):
    tb = TokenBytes(bundled_lm.tokenizer)
    assert tb.byte_level
    assert tb(bundled_lm.eos_token_ids[0]) == b"<|im_end|>"


def _fast(decoder) -> object:
    """A word-level fast tokenizer whose decoder is `decoder`."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    if decoder is not None:
        backend.decoder = decoder
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.integration
def test_byte_level_is_read_off_the_decoder_alone(bundled_lm):
    """ByteLevel alone or inside a Sequence is byte-level; Metaspace, WordPiece or no decoder are not."""
    from tokenizers import decoders

    assert TokenBytes(bundled_lm.tokenizer).byte_level
    assert TokenBytes(_fast(decoders.ByteLevel())).byte_level
    assert TokenBytes(_fast(decoders.Sequence([decoders.Strip(), decoders.ByteLevel()]))).byte_level
    assert not TokenBytes(_fast(decoders.Metaspace())).byte_level
    assert not TokenBytes(_fast(decoders.WordPiece())).byte_level
    assert not TokenBytes(_fast(None)).byte_level
