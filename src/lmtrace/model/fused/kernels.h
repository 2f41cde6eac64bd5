/* The structs and entry points the C files of lmtrace.model.fused share (kernels.c: the small
   operations; int4.c: packed GGUF products; layer.c: a packed Llama decoder layer made of both). */
#ifndef LMT_KERNELS_H
#define LMT_KERNELS_H
#include <stdint.h>

/* an RMSNorm: its weight (n floats), epsilon, and the width of torch's vectors its sum follows */
typedef struct {
    const float* weight;
    float eps;
    int lanes;
} lmt_norm;

/* One decode step's attention: its tensors (q[b, h] at b * q_stride[0] + h * q_stride[1]; k[b, g, l]
   at b * k_stride[0] + g * k_stride[1] + l * k_stride[2], v likewise), keep[b * keep_stride + l]
   (bytes, 0: masked out; NULL: every key), out (batch, heads, d), `length` floats of scratch */
typedef struct {
    const float *q, *k, *v;
    long q_stride[2], k_stride[3], v_stride[3];
    const unsigned char* keep;
    long keep_stride;
    float *out, *scores;
    long batch, heads, kv_heads, length, d;
    float scale;
} lmt_attention;

/* one packed product: x (rows, in) float32; with 4 bits, codes (panels, pieces * in / 8, 8, 8)
   uint32: for each panel, run of 8 input positions and block of 8 columns, one 32-bit word per
   column whose nibble j holds (c ^ 8) for position j of the run (read back as a signed nibble it is
   c - 8), the weight (c - 8) * S + Z; with 8 bits (one piece), codes (panels, in, 64) int8 c, the
   weight c * S + Z; scales and zeros (panels, pieces * in / group, 64) float32; y (rows, panels *
   64) float32 */
typedef struct {
    const float* x;
    long rows;
    long in;
    const uint32_t* codes;
    const float* scales;
    const float* zeros;
    long panels;
    int pieces;
    float* y;
    int bits;  /* 4 or 8 */
    int group; /* input positions a scale and zero cover: 32, or with 8 bits 16 (Q6_K) */
} lmt_int4;

void lmt_rms_norm(const float* x, float* out, long rows, long n, const lmt_norm* norm);
void lmt_add_rms_norm(const float* x, const float* y, float* h, float* out, long rows, long n, const lmt_norm* norm);
void lmt_silu_mul(const float* gu, long stride, float* out, long rows, long inter);
void lmt_rotary(const float* x, long stride, const float* cos, const float* sin, float* out, long rows, long heads,
                long d);
void lmt_decode_attention(const lmt_attention* a);
void lmt_int4_mm(const lmt_int4* a, int threads);
#endif
