"""The small operations of a Llama decoder layer fused in C, for `matmul="onednn-fused"` (CLI
`--matmul onednn-fused`): oneDNN's packed products (lmtrace.model.matmul) and, between them,
RMSNorm, the residual add with the RMSNorm after it, the rotary embedding of q and k, SiLU·mul and
a decode step's attention, each one call of a small C library (kernels.c) instead of two to eight
torch operations (or SDPA's general kernel).

Why: at a decode step of a small model each torch operation costs its dispatch (about 10 µs on a
2-core AMD EPYC, where F.rms_norm on 16 rows of 576 takes 34 µs and the C kernel 13), and the
bundled model makes about 15 of them a layer between its products; vLLM's CPU backend computes the
same operations in C++ kernels of its own.

The library is compiled at first use with the machine's C compiler (`cc`, or $CC) for this CPU
(`-march=native`) into lmtrace's cache (lmtrace.model.fused.build), once per source, compiler and
CPU. Where there is no compiler, `onednn-fused` is refused in one line naming it.

The numbers: float32 throughout, every product and sum rounded as torch rounds it (no fused
multiply-add). The residual adds, the rotary embedding and RMSNorm are torch's to the bit (RMSNorm
sums its squares in ATen's order at torch's vector width); SiLU's exp is glibc's vector expf and
the attention sums in its own order, so logprobs move from the default path's by float32 rounding,
within the opt-in bound (5e-5, tested) as `--matmul onednn`'s do. The decoder layers run it only
where lmtrace.model.layer_path runs them as one function; a layer that falls back to transformers'
forward (a hook, a replaced module, gradients) computes transformers' operations, and the attention
kernel runs only for transformers' own sdpa attention (not one an observer registered).

Packed GGUF layers (`weights="packed"`) multiply on lmtrace's own kernel here too (int4.c: 4-bit
codes, or 8-bit for the types of 5 to 8 bits, float32 inputs); their Llama layers take all of these
operations, and where every product is whole 64-column panels a decode step's layer is two calls
(layer.c, lmtrace.model.fused.layer: q/k/v before transformers' cache update, the rest after), the
same operations in the same order as one by one, so the same bits.
"""
