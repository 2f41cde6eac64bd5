"""Running a GGUF model on its own quantized weights (`lmtrace.load(..., weights="packed")`):
every `nn.Linear` whose GGUF tensor is Q4_0, Q4_1 or Q8_0 is replaced by a `PackedLinear` that
keeps the blocks at 4 bits and multiplies with torch's CPU weight-only kernel
(`aten._weight_int4pack_mm_for_cpu`). A tensor of another type (e.g. Q6_K, F16) keeps its
dequantized float weights, and the report says which and why.

The kernel's vectorized (AVX2/AVX-512) path takes bfloat16 activations, scales and zeros and
accumulates in float32, so by default each packed matmul rounds its input, scales and zeros to
bfloat16 (`compute_dtype`); with float32 it runs torch's scalar path on the exact weights."""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmtrace.model.gguf.blocks import GROUP, Int4Form, int4_form, permute_rows


class PackedLinear(nn.Module):
    """y = x W^T (+ b) with W held as 4-bit codes plus a scale and a zero per group of 32."""

    def __init__(self, form: Int4Form, bias: torch.Tensor | None, compute_dtype: torch.dtype, kind: str,
                 source: str = "") -> None:  # fmt: skip
        super().__init__()
        self.out_features, self.in_features = form.codes.shape[0], form.in_features
        self.doubled, self.compute_dtype, self.kind = form.doubled, compute_dtype, kind
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(form.codes, 1)  # (out, in' / 2) uint8
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zeros", torch.stack([form.scales, form.zeros], -1).to(compute_dtype))
        self.source = source  # the GGUF tensor's name
        self.packed_numel = self.out_features * self.in_features  # weights it stands for (arch.summarize)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(self.compute_dtype)  # (..., in) -> (rows, in)
        if self.doubled:  # Q8_0: the high nibbles' half, then the low nibbles' half
            flat = torch.cat([flat, flat], dim=-1)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), self.packed, GROUP, self.scale_zeros)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale_zeros))

    def extra_repr(self) -> str:
        return f"{self.kind}, in={self.in_features}, out={self.out_features}, compute={self.compute_dtype}"


class PackedHead(PackedLinear):
    """The lm_head, packed, with its best `refine` logits of every row recomputed in float32 from
    the exact dequantized rows: the kernel stores its output in bfloat16, whose spacing at a
    logit of 20 is 0.125, too coarse for logprobs; the rows a step reads (the chosen token, the
    top alternatives) then carry float32 logits, and only the far tail keeps the coarse ones."""

    def __init__(self, form: Int4Form, bias: torch.Tensor | None, compute_dtype: torch.dtype, kind: str,
                 source: str = "", refine: int = 64) -> None:  # fmt: skip
        super().__init__(form, bias, compute_dtype, kind, source)
        self.refine = min(refine, self.out_features)
        self.codes = form.codes.to(torch.uint8)  # (out, in') 1 byte a weight, read only for `refine` rows a step
        self.scales, self.zeros = form.scales.t().contiguous(), form.zeros.t().contiguous()  # (out, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        coarse = super().forward(x)  # (..., out)
        if self.refine == 0:  # a draft model's head: its proposals need no float32 logits
            return coarse
        flat, logits = x.reshape(-1, x.shape[-1]).float(), coarse.reshape(-1, self.out_features)
        idx = logits.topk(self.refine, dim=-1).indices  # (rows, refine)
        w = self.codes[idx].float().sub_(8)  # (rows, refine, in')
        groups = w.shape[-1] // GROUP
        w = w.view(*idx.shape, groups, GROUP).mul_(self.scales[idx][..., None]).add_(self.zeros[idx][..., None])
        w = w.view(*idx.shape, -1)
        if self.doubled:
            w = w[..., : self.in_features] + w[..., self.in_features :]
        exact = torch.einsum("rki,ri->rk", w, flat)  # (rows, refine)
        if self.bias is not None:
            exact = exact + self.bias[idx]
        return logits.scatter(-1, idx, exact.to(logits.dtype)).reshape(coarse.shape)


@dataclass
class PackReport:
    """What `pack_gguf` did: which layers run packed, which keep float weights and why."""

    packed: dict[str, str] = field(default_factory=dict)  # module name -> GGUF type
    kept_float: dict[str, str] = field(default_factory=dict)  # module name -> reason
    compute_dtype: str = "bfloat16"
    path: str = ""  # the GGUF file
    packed_bytes: int = 0  # bytes of the packed matmul weights
    float_bytes: int = 0  # bytes of the linear weights kept in float
    seconds: float = 0.0
    fused: int = 0  # groups of sibling projections stacked into one kernel call (model/gguf/fused.py)

    def line(self) -> str:
        """One line for the load status: what runs packed and what does not."""
        text = (f"packed weights: {len(self.packed)} linear layers at 4 bits "
                f"({self.packed_bytes / 1e6:.0f} MB, {self.compute_dtype} activations)")  # fmt: skip
        if self.kept_float:
            reasons = sorted({f"{n} ({r})" for n, r in self.kept_float.items()})
            text += f"; kept in float: {', '.join(reasons[:3])}" + (" …" if len(reasons) > 3 else "")
        return text

    def short(self) -> str:
        """e.g. "packed 4-bit (Q4_1 x210, Q8_0 x1), bfloat16 activations; kept float: 1" """
        counts: dict[str, int] = {}
        for kind in self.packed.values():
            counts[kind] = counts.get(kind, 0) + 1
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))
        text = f"packed 4-bit ({kinds}), {self.compute_dtype} activations"
        return text + (f"; kept float: {len(self.kept_float)}" if self.kept_float else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _gguf_names(model: nn.Module, reader: Any) -> dict[str, Any]:
    """Linear module name -> its GGUF tensor, through gguf's own name map for the architecture;
    a tied lm_head maps to the embedding's tensor."""
    import gguf

    model_type = model.config.model_type
    arch = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == model_type), None)
    if arch is None:
        return {}
    names = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}
    embed = model.get_input_embeddings()
    embed_name = next((n for n, m in model.named_modules() if m is embed), None)
    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        key = names.get_name(name)
        if (key is None or f"{key}.weight" not in tensors) and embed_name and module.weight is embed.weight:
            key = names.get_name(embed_name)
        if key is not None and f"{key}.weight" in tensors:
            found[name] = tensors[f"{key}.weight"]
    return found


def _llama_rows(model: nn.Module, name: str, rows: int) -> torch.Tensor | None:
    """The row order transformers gives Llama's q/k projections when it reads a GGUF (llama.cpp
    permutes them for its rotary layout); None for every other tensor."""
    if model.config.model_type not in ("llama", "mistral") or not name.endswith(("q_proj", "k_proj")):
        return None
    heads = model.config.num_attention_heads
    if name.endswith("k_proj"):
        heads = getattr(model.config, "num_key_value_heads", None) or heads
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def _form(model: nn.Module, name: str, out_features: int, in_features: int, tensor: Any) -> Int4Form:
    form = int4_form(tensor.tensor_type.name, tensor.data, out_features, in_features)
    order = _llama_rows(model, name, out_features)
    return form if order is None else permute_rows(form, order)


def _pack_one(model: nn.Module, name: str, module: nn.Linear, tensor: Any, compute: torch.dtype) -> PackedLinear:
    kind = tensor.tensor_type.name
    form = _form(model, name, module.out_features, module.in_features, tensor)
    if not torch.equal(form.dequantize(), module.weight.detach().float()):
        raise ValueError("the blocks do not reproduce the loaded weights")
    head = module is model.get_output_embeddings() and compute != torch.float32
    layer = (PackedHead if head else PackedLinear)(form, module.bias, compute, kind, tensor.name)
    if module.weight is model.get_input_embeddings().weight:
        layer.packed_numel = 0  # tied: the embedding's parameters count these weights already
    return layer


def pack_gguf(
    model: nn.Module, path: str | Path, compute_dtype: torch.dtype = torch.bfloat16, fuse: bool = True
) -> PackReport:
    """Replaces the model's linear layers by packed ones read from the GGUF file at `path` (the
    file the model was loaded from). Each packed layer's dequantized weights are checked equal to
    the loaded float32 weights before the swap; a layer that fails keeps its float weights. With
    `fuse`, q/k/v and gate/up then run as one kernel call each (model/gguf/fused.py)."""
    import gguf

    started = time.perf_counter()
    report = PackReport(compute_dtype=str(compute_dtype).replace("torch.", ""), path=str(path))
    tensors = _gguf_names(model, gguf.GGUFReader(str(path)))
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        tensor = tensors.get(name)
        weight_bytes = module.weight.numel() * module.weight.element_size()
        if tensor is None:
            report.kept_float[name], report.float_bytes = "no GGUF tensor found", report.float_bytes + weight_bytes
            continue
        try:
            packed = _pack_one(model, name, module, tensor, compute_dtype)
        except (ValueError, RuntimeError) as e:
            report.kept_float[name] = f"{tensor.tensor_type.name}: {e}"
            report.float_bytes += weight_bytes
            continue
        model.set_submodule(name, packed)
        report.packed[name] = tensor.tensor_type.name
        report.packed_bytes += packed.nbytes()
    if fuse:
        from lmtrace.model.gguf.fused import fuse as fuse_groups

        def form_of(name: str, layer: PackedLinear) -> Int4Form:
            return _form(model, name, layer.out_features, layer.in_features, tensors[name])

        report.fused = fuse_groups(model, form_of)
    report.seconds = time.perf_counter() - started
    model.lmtrace_packed = report
    return report


def report_of(model: nn.Module) -> PackReport | None:
    """The PackReport of a packed model, None for a float one."""
    return getattr(model, "lmtrace_packed", None)


def float_reference(model: nn.Module) -> nn.Module:
    """A float32 copy of a packed model with every PackedLinear back as an nn.Linear holding the
    GGUF's dequantized weights (read again from the file): the path packed decoding is measured
    against, equal to what `load(weights="float")` gives."""
    import gguf

    report = report_of(model)
    ref = nn.Module.float(copy.deepcopy(model))  # transformers' own .float() refuses GGUF-loaded models
    if report is None:
        return ref.eval()
    from lmtrace.model.gguf.fused import FusedMLP, Stub

    tensors = {t.name: t for t in gguf.GGUFReader(report.path).tensors}
    del ref.lmtrace_packed
    for name, module in list(ref.named_modules()):
        if isinstance(module, FusedMLP):  # the MLP as it was, its gate and up read below
            module.original.down_proj = module.down_proj
            ref.set_submodule(name, module.original)
    for name, module in list(ref.named_modules()):
        if isinstance(module, (PackedLinear, Stub)):
            form = _form(ref, name, module.out_features, module.in_features, tensors[module.source])
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            with torch.no_grad():
                linear.weight.copy_(form.dequantize())
                if module.bias is not None:
                    linear.bias.copy_(module.bias.float())
            ref.set_submodule(name, linear.requires_grad_(False))
    return ref.eval()
