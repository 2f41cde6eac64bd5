"""The variants of the stability ledger as worlds: the reference's model changed one way (its
dtype, its packed weights, its attention kernel, its batch, its threads, compiled, another file
of the same model), each able to teacher-force a sequence and to decode a prompt.

A World is built once per variant and can serve many prompts (bench/stability_calibration.py);
`close` frees what it copied. Teacher forcing is one plain uncached forward of prompt + tokens
under the variant (lmtrace.scoring.teacher.score.forward_windows), so that its numbers are those of the
variant's model and nothing else (compile: its compiled decode step, see CompiledWorld);
decoding is lmtrace's engine under the variant, which is transformers' generate step for step."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from lmtrace.errors import InvalidParameter
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams
from lmtrace.scoring.teacher.score import forward_windows, resolve_window
from lmtrace.scoring.variants import spec as variant_spec
from lmtrace.scoring.variants.spec import VariantSpec

# the other rows of batch:N are this text's tokens, cut to other lengths than the prompt's
FILLER = (
    "The committee met on Tuesday to review the budget. 很久很久以前，有一座山。 Les enfants jouent dans le "
    "jardin pendant que le soleil se couche. def add(a, b): return a + b  # a small function. "
) * 8


class World:
    """The reference's model as it is: forced (steps, vocab) log-probs, decoded token ids.
    Subclasses change the model (`lm`), the settings around each call (`scope`), or the way a
    computation is batched."""

    about = "the reference's own model and settings"

    def __init__(self, lm: LM, spec: VariantSpec | None = None):
        self.lm, self.spec = lm, spec

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        yield

    def forced(self, ids: Sequence[int], first: int) -> torch.Tensor:
        """Raw log-probs (len(ids) - first, vocab), float32: row j predicts ids[first + j]."""
        model, rows = self.lm.model, []
        with torch.inference_mode(), self.scope():
            for _, logits in forward_windows(model, list(ids), first, *resolve_window(model, None, None)):
                rows.append(torch.log_softmax(logits.float(), dim=-1))
        return torch.cat(rows)

    def decode(self, prompt: str, ids: list[int], params: SamplingParams, chat: bool = False) -> list[int]:
        """The token ids lmtrace's engine chooses under the variant (greedy, or the same seed)."""
        from lmtrace.decode.tracing import generate_ids

        with self.scope():
            return list(generate_ids(self.lm, [ids], params, prompt_texts=[prompt], chat=chat)[0].token_ids)

    def close(self) -> None:
        """Frees what the variant copied (the reference's own model is never touched)."""


class CopyWorld(World):
    """A copy of the reference's model: cast to another dtype, or with packed weights."""

    def __init__(self, lm: LM, spec: VariantSpec, model: Any, about: str):
        super().__init__(LM.from_objects(model, lm.tokenizer, f"{lm.source} [{spec.spec}]"), spec)
        self.about = about

    def close(self) -> None:
        self.lm.model = None


class SettingWorld(World):
    """The reference's model under another setting, entered around every call and put back."""

    def __init__(self, lm: LM, spec: VariantSpec):
        super().__init__(lm, spec)
        if spec.kind == "attention":
            self.about = f"attention computed by transformers' {spec.value!r} implementation"
            with self.scope():  # an implementation this machine lacks fails here, not half-way
                pass
        else:
            self.about = f"torch.set_num_threads({spec.value}) (the reference ran with {torch.get_num_threads()})"

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        model = self.lm.model
        if self.spec.kind == "threads":
            before = torch.get_num_threads()
            torch.set_num_threads(self.spec.value)
            try:
                yield
            finally:
                torch.set_num_threads(before)
            return
        before = model.config._attn_implementation
        try:
            model.set_attn_implementation(self.spec.value)
        except (ValueError, ImportError, RuntimeError) as e:
            raise InvalidParameter(f"{self.spec.spec} cannot run here ({' '.join(str(e).split())[:200]})") from e
        try:
            yield
        finally:
            model.set_attn_implementation(before)


class CompiledWorld(World):
    """torch.compile: lmtrace's compiled decode step (a static cache, generate(compile=True)).
    Teacher forcing feeds the reference's tokens through that same compiled step after the
    prefill, one at a time through the compiled forward on a static cache of the same bucketed
    length (decode/static.py): the numbers compile's decoding computes."""

    about = "torch.compile: lmtrace's compiled decode step over a static cache (forcing and decoding)"

    def forced(self, ids: Sequence[int], first: int) -> torch.Tensor:
        from lmtrace.decode.engine import prefill
        from lmtrace.decode.static import capacity, compiled_forward
        from lmtrace.kv import ledger

        model, ids = self.lm.model, list(ids)
        decode, cache = compiled_forward(model), ledger.new_cache(model, capacity(len(ids)))
        device = model.device
        with torch.inference_mode():
            rows = [prefill(model, torch.tensor([ids[:first]], device=device), None, cache)]  # (1, vocab)
            for j in range(first, len(ids) - 1):
                token, position = torch.tensor([ids[j]], device=device), torch.tensor([[j]], device=device)
                rows.append(decode(model, token, position, None, cache))
            return torch.log_softmax(torch.cat(rows), dim=-1)  # (len - first, vocab)

    def decode(self, prompt: str, ids: list[int], params: SamplingParams, chat: bool = False) -> list[int]:
        from lmtrace.decode.tracing import encode_prompt, generate

        if encode_prompt(self.lm, prompt, chat) != list(ids):  # generate(compile=True) encodes the text itself
            raise ValueError("compile: the prompt ids must be the prompt's own encoding (with `chat` as given)")
        return list(generate(self.lm, prompt, params, chat=chat, compile=True).token_ids)


class BatchWorld(World):
    """The prompt as row 0 of N, beside N - 1 other texts of other lengths (at least one longer,
    so that the prompt is padded too), left-padded: what a server's batch does to a request."""

    def __init__(self, lm: LM, spec: VariantSpec):
        super().__init__(lm, spec)
        self.about = f"the prompt as one row of a left-padded batch of {spec.value} of other lengths"
        self.filler = list(lm.tokenizer(FILLER, add_special_tokens=False)["input_ids"])

    def others(self, length: int) -> list[list[int]]:
        """N - 1 sequences of lengths length + 5, length - 3, length + 11, length - 9, ... (at
        least 1 token each): the first is longer than the prompt, so the prompt's row is padded."""
        out = []
        for j in range(1, self.spec.value):
            offset = 6 * ((j + 1) // 2) - 1 if j % 2 else 3 - 6 * (j // 2)
            n = max(1, min(length + offset, len(self.filler) - j))
            out.append(self.filler[j : j + n])
        return out

    def forced(self, ids: Sequence[int], first: int) -> torch.Tensor:
        from lmtrace.decode.engine import left_pad, positions

        model = self.lm.model
        rows = [list(ids), *self.others(len(ids))]
        input_ids, mask = left_pad(rows, self.lm.pad_token_id, model.device)  # (N, width)
        with torch.inference_mode():
            out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions(mask), use_cache=False)
            pad = input_ids.shape[1] - len(ids)  # row 0 is right-aligned after its padding
            logits = out.logits[0, pad + first - 1 : -1]  # (len - first, vocab)
            return torch.log_softmax(logits.float(), dim=-1)

    def decode(self, prompt: str, ids: list[int], params: SamplingParams, chat: bool = False) -> list[int]:
        from lmtrace.decode.tracing import generate_each

        rows = [ids, *self.others(len(ids))]
        texts = [prompt] + [self.lm.tokenizer.decode(r) for r in rows[1:]]
        traces = generate_each(self.lm, texts, rows, [params] * len(rows), chat=chat)
        return list(traces[0].token_ids)


def gguf_of(lm: LM) -> Path | None:
    """The .gguf file the model was loaded from, where it was."""
    if lm.source.startswith("bundled:"):
        from lmtrace.model.load import bundled_gguf

        return bundled_gguf()
    path = Path(lm.source).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def cast(model: Any, dtype: torch.dtype) -> Any:
    """A copy of `model` with its parameters in `dtype`, as load(dtype=...) gives it: the
    buffers stay as they are (the rotary frequencies stay float32; a cast of them would move
    every position's angle)."""
    model = copy.deepcopy(model)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    model.config.dtype = dtype
    return model


class Float32Head(torch.nn.Module):
    """An lm_head in float32 over a lower-precision model: its input upcast, float32 logits."""

    def __init__(self, head: torch.nn.Module):
        super().__init__()
        self.head = copy.deepcopy(head).float()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden.float())  # (..., hidden) bfloat16 -> (..., vocab) float32


def _float32_head(lm: LM, spec: VariantSpec) -> World:
    model = cast(lm.model, torch.bfloat16)
    model.set_output_embeddings(Float32Head(lm.model.get_output_embeddings()))
    return CopyWorld(lm, spec, model, "weights and activations in bfloat16, the lm_head in float32")


def _packed(lm: LM, spec: VariantSpec) -> World:
    from lmtrace.model.gguf.packed import pack_gguf, report_of

    path = gguf_of(lm)
    if path is None:
        raise InvalidParameter(f"{spec.spec} runs a .gguf file's own quantized weights; {lm.source} is not a .gguf")
    if report_of(lm.model) is not None:
        raise InvalidParameter(f"{spec.spec}: the reference runs packed weights already")
    model = copy.deepcopy(lm.model)
    report = pack_gguf(model, path)
    return CopyWorld(lm, spec, model, f"the GGUF's own 4-bit weights, packed ({report.short()})")


def _other_model(lm: LM, spec: VariantSpec) -> World:
    from lmtrace.model.load import load

    other = load(spec.value, device=str(lm.model.device.type), dtype=lm.summary.dtype or "auto")
    if other.tokenizer.get_vocab() != lm.tokenizer.get_vocab():
        raise InvalidParameter(
            f"{spec.spec}: its tokenizer differs from the reference's, so the reference's "
            "tokens cannot be teacher-forced through it"
        )
    world = World(other, spec)
    world.about = f"another file of the model: {other.source} ({other.summary.dtype})"
    return world


def build(lm: LM, spec: VariantSpec) -> World:
    """The World of one variant on the reference's model. InvalidParameter (and the errors of
    loading or compiling) mean: this variant cannot run here; the ledger reports it skipped."""
    if spec.kind == "dtype":
        model = cast(lm.model, getattr(torch, spec.value))
        return CopyWorld(lm, spec, model, f"weights and activations in {spec.value}")
    if spec.kind == "weights":
        return _packed(lm, spec)
    if spec.kind == "lm_head":
        return _float32_head(lm, spec)
    if spec.kind in ("attention", "threads"):
        return SettingWorld(lm, spec)
    if spec.kind == "batch":
        return BatchWorld(lm, spec)
    if spec.kind == "compile":
        return CompiledWorld(lm, spec)
    if spec.kind == "model":
        return _other_model(lm, spec)
    make = variant_spec.engine(spec.value)
    if make is None:
        raise InvalidParameter(f"{spec.spec}: no engine {spec.value!r} is registered in this process")
    return make(lm, spec)
