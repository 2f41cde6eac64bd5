"""Running a GGUF model on its own quantized weights (`lmtrace.load(..., weights="packed")`):
every `nn.Linear` whose GGUF tensor is of a packed type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K, IQ4_NL, IQ4_XS: model/gguf/quants.py) is replaced by a `PackedLinear` that keeps the
tensor's own blocks as 4-bit codes, in 1, 2 or 4 pieces (model/gguf/blocks.py), and multiplies
with lmtrace's C kernel or torch's CPU weight-only kernel (`aten._weight_int4pack_mm_for_cpu`;
below). A tensor of another
type (F16, Q2_K, …) keeps its dequantized float weights, and the report says which and why; a
file none of whose linear layers packs is refused, never run in float under the packed name.

Two kernels, by `compute_dtype`: with float32 (what `lmtrace.load(weights="packed")` picks where a
C compiler is at hand, `default_compute()`) lmtrace's own C kernel (model/fused/int4.c, on the form
of model/gguf/nibbles.py) multiplies float32 inputs by the exact weights: the float32 model's
products within float32 rounding (torch's scalar path where the C kernel cannot be built). With
bfloat16 torch's vectorized (AVX2/AVX-512) path rounds each input, scale and zero to bfloat16 and
accumulates in float32; its lm_head recomputes each step's best logits in float32 (PackedHead)."""

from __future__ import annotations

import contextlib
import copy
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lmtrace.errors import InvalidParameter
from lmtrace.model.gguf.blocks import GROUP, Int4Form, int4_form, permute_rows
from lmtrace.model.gguf.embedding import PackedEmbedding
from lmtrace.model.gguf.names import Found, linear_tensors
from lmtrace.model.gguf.nibbles import kernel_available, nibble_chunks
from lmtrace.model.gguf.report import PackReport, report_of
from lmtrace.model.gguf.tensors import GGUFTensors, release, trim_heap


def _padded(form: Int4Form, rows: int = 32) -> Int4Form:
    """The form with rows of code 8, scale 0 and zero 0 (weight 0) up to a multiple of `rows`."""
    extra = -form.codes.shape[0] % rows
    if extra == 0:
        return form
    codes = torch.cat([form.codes, torch.full((extra, form.codes.shape[1]), 8, dtype=form.codes.dtype)])
    pad = torch.zeros(form.scales.shape[0], extra)
    return Int4Form(codes, torch.cat([form.scales, pad], 1), torch.cat([form.zeros, pad], 1), form.pieces)


CHUNK_ROWS = 2048  # rows converted at a time: a multiple of 64 (the kernel packs 64-row blocks, then a 32-row tail)


SERIAL_WORK = 1 << 24  # multiply-adds under which a packed matmul runs on one thread


def int4_mm(flat: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor) -> torch.Tensor:
    """torch's int4 kernel, on one thread when the product is small: the kernel splits its output
    columns over all threads, and a decode step's small layers (Gemma 3's q_proj: 2 x 640 x 1024)
    then cost a thread wake-up each (measured on a shared 2-core machine: 20 ms a call on 2
    threads, 0.05 ms on one). Each output is one thread's dot product either way, so the result
    is the same bit for bit."""
    if flat.shape[0] * flat.shape[1] * packed.shape[0] >= SERIAL_WORK:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, GROUP, scale_zeros)
    with one_thread():
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, GROUP, scale_zeros)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to one inside (not while torch.compile traces: it would break
    the graph)."""
    if torch.compiler.is_compiling():  # before get_num_threads: dynamo cannot trace an int-returning torch call
        yield
        return
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _packed_chunks(
    forms: Iterable[Int4Form], pieces: int, dtype: torch.dtype, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes (padded rows, pieces * in / 2) uint8, scales and zeros (groups, padded rows,
    2)) of `rows` rows given in chunks (64-row multiples but the last), converted one at a time
    and copied into buffers made once for all rows (no second copy from a final concatenation)."""
    padded, done = rows + -rows % 32, 0
    packed = scale_zeros = None
    for part in forms:  # each chunk's int32 codes freed once packed
        if part.pieces != pieces:
            raise ValueError("row chunks of different pieces")
        n = part.codes.shape[0]
        part = _padded(part)  # the kernel takes a multiple of 16 rows: rows of weight 0 fill up
        codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(part.codes, 1)  # (rows, pieces * in / 2)
        sz = torch.stack([part.scales, part.zeros], -1).to(dtype)  # (groups, rows, 2)
        if packed is None or scale_zeros is None:
            packed = codes.new_empty((padded, codes.shape[1]))
            scale_zeros = sz.new_empty((sz.shape[0], padded, 2))
        if done % 64:
            raise ValueError(f"a row chunk after {done} rows: chunks but the last must be a multiple of 64 rows")
        if done + len(codes) > padded:
            raise ValueError(f"row chunks of more than the layer's {rows} rows")
        packed[done : done + len(codes)] = codes
        scale_zeros[:, done : done + len(codes)] = sz
        done += n
    if done != rows or packed is None or scale_zeros is None:
        raise ValueError(f"row chunks of {done} rows for a layer of {rows}")
    return packed, scale_zeros


class PackedLinear(nn.Module):
    """y = x W^T (+ b) with W held as 4-bit codes plus a scale and a zero per group of 32, in
    `pieces` parts side by side along the input (the input fed once per piece)."""

    def __init__(
        self,
        form: Int4Form | Iterable[Int4Form],
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype,
        kind: str,
        source: str = "",
        order: torch.Tensor | None = None,
        rows: int | None = None,
    ) -> None:
        super().__init__()
        forms = iter([form] if isinstance(form, Int4Form) else form)  # row chunks: 64-row multiples but the last
        first = next(forms)
        self.in_features, self.pieces = first.in_features, first.pieces
        self.compute_dtype, self.kind = compute_dtype, kind
        self.out_features = first.codes.shape[0] if rows is None else rows  # rows: all chunks' (given chunks)
        self.own_kernel = compute_dtype == torch.float32 and kernel_available()  # int4.c, else torch's
        chunks = itertools.chain([first], forms)
        # 8 bits: one piece of 8-bit codes on lmtrace's kernel (nibbles.bytes_form); group: the input
        # positions a scale covers (16: Q6_K's, in 8 bits)
        self.bits, self.group = 4, 32
        if self.own_kernel:  # (panels, pieces * in * 8) code words, (2, panels, groups * 64) scales and zeros
            packed, scale_zeros, self.bits, self.group = nibble_chunks(chunks, self.pieces, self.out_features)
            self.pieces = 1 if self.bits == 8 else self.pieces
        else:  # torch's int4 form: (padded out, pieces * in / 2), (groups, padded out, 2)
            packed, scale_zeros = _packed_chunks(chunks, self.pieces, compute_dtype, self.out_features)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zeros", scale_zeros)
        self.source, self.order = source, order  # the GGUF tensor's name and row order (float_reference)
        self.packed_numel = self.out_features * self.in_features  # weights it stands for (arch.summarize)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(self.prepared(x), x.dtype).reshape(*x.shape[:-1], self.out_features)

    def prepared(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the kernel reads it: (..., in) -> (rows, pieces * in) in the compute dtype
        (layers of one input, such as q/k/v, can share it: lmtrace.model.layer_path)."""
        flat = x.reshape(-1, x.shape[-1]).to(self.compute_dtype)  # (..., in) -> (rows, in)
        if self.own_kernel:  # the C kernel reads each piece's input from the one row
            return flat.contiguous()
        if self.pieces > 1:  # one copy of the input per piece: (rows, in) -> (rows, pieces * in)
            flat = flat.repeat(1, self.pieces)
        return flat.contiguous()

    def product(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(rows, out) in `dtype` for a `prepared` input: the layer's output, bias added."""
        if self.own_kernel:
            from lmtrace.model.fused import ops

            out = ops.int4_mm(flat, self.packed, self.scale_zeros, self.pieces, self.bits, self.group)
        else:
            out = int4_mm(flat, self.packed, self.scale_zeros)
        if out.shape[-1] != self.out_features:  # (rows, padded out) -> (rows, out)
            out = out[:, : self.out_features]
        out = out.to(dtype)
        return out if self.bias is None else out + self.bias

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale_zeros))

    def extra_repr(self) -> str:
        return (
            f"{self.kind}, in={self.in_features}, out={self.out_features}, pieces={self.pieces}, bits={self.bits}, "
            f"compute={self.compute_dtype}, kernel={'lmtrace int4.c' if self.own_kernel else 'torch int4'}"
        )


class PackedHead(PackedLinear):
    """The lm_head, packed, with its best `refine` logits of every row recomputed in float32 from
    the tensor's own blocks (`raw`, one row of bytes per token, read from the memory-mapped file
    and dequantized by gguf for the rows a step needs): the kernel stores its output in bfloat16,
    whose spacing at a logit of 20 is 0.125, too coarse for logprobs; the rows a step reads (the
    chosen token, the top alternatives) then carry float32 logits, the far tail the coarse ones."""

    def __init__(
        self,
        form: Int4Form | Iterable[Int4Form],
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype,
        kind: str,
        source: str = "",
        refine: int = 64,
        raw: np.ndarray | None = None,
        rows: int | None = None,
    ) -> None:
        super().__init__(form, bias, compute_dtype, kind, source, rows=rows)
        if raw is None:
            raise ValueError("a packed head needs its tensor's raw blocks")
        self.refine = min(refine, self.out_features)
        self.raw = raw  # (out, bytes a row) uint8; not a buffer: it stays in the file

    def exact_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """(k,) token ids -> (k, in) float32: gguf's own dequantization of those rows."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        blocks = np.asarray(self.raw[rows.numpy()])
        w = dequantize(blocks, GGMLQuantizationType[self.kind.split("+")[0]])
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(len(rows), self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        coarse = super().forward(x)  # (..., out)
        if self.refine == 0:  # a draft model's head: its proposals need no float32 logits
            return coarse
        return self.refined(x, coarse)

    # the rows come from numpy on the host: torch.compile runs the refinement eagerly, after its graph
    @torch.compiler.disable
    def refined(self, x: torch.Tensor, coarse: torch.Tensor) -> torch.Tensor:
        """The coarse logits with each row's best `refine` recomputed in float32."""
        flat, logits = x.reshape(-1, x.shape[-1]).float(), coarse.reshape(-1, self.out_features)
        with one_thread() if len(flat) <= 4 else contextlib.nullcontext():  # a decode step's few rows
            idx = logits.topk(self.refine, dim=-1).indices  # (rows, refine)
            unique, where = idx.unique(return_inverse=True)  # (k,), (rows, refine) positions into it
            w = self.exact_rows(unique)[where]  # (rows, refine, in)
            exact = torch.einsum("rki,ri->rk", w, flat)  # (rows, refine)
            if self.bias is not None:
                exact = exact + self.bias[idx]
            return logits.scatter(-1, idx, exact.to(logits.dtype)).reshape(coarse.shape)


def default_compute() -> torch.dtype:
    """float32 where lmtrace's C kernel can be built (a C compiler: the float32 model's products,
    faster than torch's bfloat16 kernel here), else bfloat16 (torch's vectorized int4 kernel)."""
    return torch.float32 if kernel_available() else torch.bfloat16


def _form(found: Found, out_features: int, in_features: int) -> Int4Form:
    if found.note:
        raise ValueError(found.note)
    form = int4_form(found.tensor.tensor_type.name, found.tensor.data, out_features, in_features)
    return form if found.order is None else permute_rows(form, found.order)


def _forms(found: Found, out_features: int, in_features: int) -> Iterator[Int4Form]:
    """The tensor's form in chunks of rows, made one at a time (a large tensor's codes are never all
    held as int32 at once)."""
    if found.order is not None or found.note or out_features <= CHUNK_ROWS:
        yield _form(found, out_features, in_features)
        return
    raw, kind = found.tensor.data.reshape(out_features, -1), found.tensor.tensor_type.name
    for i in range(0, out_features, CHUNK_ROWS):
        yield int4_form(kind, raw[i : i + CHUNK_ROWS], min(CHUNK_ROWS, out_features - i), in_features)
        release(raw[i : i + CHUNK_ROWS])  # its pages read: out of resident memory


def _same_rows(form: Int4Form, weight: torch.Tensor, count: int = 16) -> bool:
    """Whether `count` rows spread over the tensor (the first and the last among them) dequantize
    to the loaded weights exactly: a wrong tensor or row order shows on any of them."""
    rows = torch.linspace(0, form.codes.shape[0] - 1, min(count, form.codes.shape[0])).round().long().unique()
    part = Int4Form(form.codes[rows], form.scales[:, rows], form.zeros[:, rows], form.pieces)
    return torch.equal(part.dequantize(), weight.detach()[rows].float())


def _pack_one(model: nn.Module, module: nn.Linear, found: Found, compute: torch.dtype, check: bool) -> PackedLinear:
    kind, tensor = found.tensor.tensor_type.name, found.tensor
    forms = _forms(found, module.out_features, module.in_features)
    first = next(forms)
    if check and not _same_rows(first, module.weight[: first.codes.shape[0]]):
        raise ValueError("the blocks do not reproduce the loaded weights")
    head = module is model.get_output_embeddings() and compute != torch.float32

    def build(form: Int4Form | Iterable[Int4Form]) -> PackedLinear:
        if head:
            raw = tensor.data.reshape(len(module.weight), -1)  # (out, bytes a row), in the mapped file
            return PackedHead(form, module.bias, compute, kind, tensor.name, raw=raw, rows=module.out_features)
        return PackedLinear(form, module.bias, compute, kind, tensor.name, found.order, rows=module.out_features)

    try:
        layer = build(itertools.chain([first], forms))
    except ValueError as e:
        if "row chunks" not in str(e):
            raise
        layer = build(_form(found, module.out_features, module.in_features))  # chunks of other pieces: as one
    if module.weight is model.get_input_embeddings().weight:
        layer.packed_numel = 0  # tied: the embedding's parameters count these weights already
    return layer


def pack_gguf(
    model: nn.Module,
    path: str | Path,
    compute_dtype: torch.dtype | None = None,
    fuse: bool = True,
    check: bool = True,
    before_fuse: Callable[[nn.Module, PackReport], None] | None = None,
) -> PackReport:
    """Replaces the model's linear layers by packed ones read from the GGUF file at `path` (the
    file the model was loaded from). With `check`, each packed layer's dequantized weights are
    checked equal to the loaded float32 weights before the swap; a layer that fails keeps its
    float weights. With `fuse`, gate/up then run as one kernel call (model/gguf/fused.py).
    Raises InvalidParameter when no linear layer packs: a float model is never labelled packed."""
    started = time.perf_counter()
    compute_dtype = default_compute() if compute_dtype is None else compute_dtype
    reader = GGUFTensors(path)
    found, arch = linear_tensors(model, reader)
    report = PackReport(compute_dtype=str(compute_dtype).replace("torch.", ""), path=str(path), architecture=arch)
    if compute_dtype == torch.float32 and kernel_available():
        report.kernel = "lmtrace's"
    from lmtrace.model.gguf.progress import Progress

    progress = Progress(f"packing {Path(path).name}", sum(int(f.tensor.n_bytes) for f in found.values()))
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        progress.advance(int(found[name].tensor.n_bytes) if name in found else 0)
        weight_bytes = module.weight.numel() * module.weight.element_size()
        try:
            if name not in found:
                raise ValueError("no GGUF tensor found")
            packed = _pack_one(model, module, found[name], compute_dtype, check)
        except (ValueError, RuntimeError) as e:
            kind = found[name].tensor.tensor_type.name + ": " if name in found else ""
            report.kept_float[name], report.float_bytes = f"{kind}{e}", report.float_bytes + weight_bytes
            continue
        model.set_submodule(name, packed)
        reader.release(found[name].tensor)  # its blocks read: their pages out of resident memory
        trim_heap()  # and the conversion's buffers, freed, out of it too
        report.packed[name] = found[name].tensor.tensor_type.name
        report.packed_bytes += packed.nbytes()
    progress.close()
    if not report.packed:
        raise InvalidParameter(
            f"weights: 'packed' packs none of the {len(report.kept_float)} linear layers of "
            f"{Path(path).name} ({_why(report)}); run it with --weights float"
        )
    if before_fuse is not None:  # model/gguf/direct.py: the float parts, once the packed ones are in place
        before_fuse(model, report)
    if fuse:
        _fuse(model, found, reader, report)
    report.seconds = time.perf_counter() - started
    model.lmtrace_packed = report
    return report


def _fuse(model: nn.Module, found: dict[str, Found], reader: GGUFTensors, report: PackReport) -> None:
    """The packed layers' siblings as one kernel call (gate/up stacked, q/k/v joined), then the
    Llama decoder layers as one function (on lmtrace's kernel with every small operation in C)."""
    from lmtrace.model import layer_path
    from lmtrace.model.gguf.fused import fuse as fuse_groups
    from lmtrace.model.gguf.joined import join_attention

    def form_of(name: str, layer: PackedLinear) -> Int4Form:
        form = _form(found[name], layer.out_features, layer.in_features)
        reader.release(found[name].tensor)
        return form

    report.fused = fuse_groups(model, form_of)
    trim_heap()  # the unfused layers' blocks, freed
    report.joined = join_attention(model)  # q/k/v in one call of lmtrace's kernel
    report.layers = layer_path.install(model)  # Llama decoder layers as one function
    report.small_ops = layer_path.fused_layers(model, every=True)  # on lmtrace's kernel: all in C


def _why(report: PackReport) -> str:
    reasons: dict[str, int] = {}
    for reason in report.kept_float.values():
        reasons[reason] = reasons.get(reason, 0) + 1
    top = sorted(reasons.items(), key=lambda kv: -kv[1])[:2]
    return "; ".join(f"{n} x {r}" for r, n in top) or "the model has no linear layers"


def float_reference(model: nn.Module) -> nn.Module:
    """A float32 copy of a packed model with every PackedLinear back as an nn.Linear holding the
    GGUF's dequantized weights (read again from the file): the path packed decoding is measured
    against, equal to what `load(weights="float")` gives."""
    report = report_of(model)
    ref = nn.Module.float(copy.deepcopy(model))  # transformers' own .float() refuses GGUF-loaded models
    if report is None:
        return ref.eval()
    from lmtrace.model.gguf.fused import FusedMLP, Stub

    tensors = {t.name: t for t in GGUFTensors(report.path).tensors}
    del ref.lmtrace_packed
    for name, module in list(ref.named_modules()):
        if isinstance(module, FusedMLP):  # the MLP as it was, its gate and up read below
            module.original.down_proj = module.down_proj
            ref.set_submodule(name, module.original)
    for name, module in list(ref.named_modules()):
        if isinstance(module, (PackedLinear, Stub)):
            found = Found(tensors[module.source], getattr(module, "order", None))
            form = _form(found, module.out_features, module.in_features)
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            with torch.no_grad():
                linear.weight.copy_(form.dequantize())
                if module.bias is not None:
                    linear.bias.copy_(module.bias.float())
            ref.set_submodule(name, linear.requires_grad_(False))
        elif isinstance(module, PackedEmbedding):
            ref.set_submodule(name, _float_embedding(module))
    return ref.eval()


def _float_embedding(module: PackedEmbedding) -> nn.Module:
    """The model's own embedding module holding the whole dequantized table."""
    embed = copy.copy(module.original)  # its buffers (Gemma's scale) shared, its weight replaced
    embed._parameters = dict(embed._parameters)
    embed.padding_idx = module.padding_idx
    rows = torch.arange(module.num_embeddings)
    embed.weight = nn.Parameter(torch.cat([module.rows(part) for part in rows.split(CHUNK_ROWS)]), requires_grad=False)
    return embed
