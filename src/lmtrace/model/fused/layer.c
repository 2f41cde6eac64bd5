/* A Llama decoder layer on packed GGUF weights (lmtrace's int4 kernel, int4.c) and the small
   operations of kernels.c, in two calls a step instead of about forty torch and ctypes calls: the
   operations lmtrace.model.layer_path runs one by one, in the same order on the same numbers, so the
   layer's output is the same to the bit (tests/test_c_layer.py). The cache update between the two
   halves stays transformers' (lmtrace.model.fused.layer). */
#include <stdlib.h>

#include "kernels.h"

/* a layer's fixed parts: its two RMSNorms and four packed products (each product's x, rows and y
   are set per call), its shape, and when a product is worth torch's threads */
typedef struct {
    lmt_norm input_norm, post_norm;
    lmt_int4 qkv, o, gate_up, down;
    long hidden, heads, kv_heads, head_dim, inter;
    float scale;
    int threads;
    long serial_work;
} lmt_layer;

/* the product of `x` (rows, in) into `y` (rows, panels * 64), on torch's threads where it is
   worth them (lmtrace.model.fused.ops.int4_mm's rule) */
static void product(const lmt_layer* layer, lmt_int4 p, const float* x, long rows, float* y) {
    p.x = x;
    p.rows = rows;
    p.y = y;
    long work = rows * p.in * p.pieces * p.panels * 64;
    lmt_int4_mm(&p, work >= layer->serial_work ? layer->threads : 1);
}

/* x (rows, hidden) -> qkv (rows, q + k + v) = the packed q/k/v of its RMSNorm, and qk (rows,
   heads + kv_heads, head_dim) = the rotary embedding of its q and k heads (cos, sin (rows, head_dim)) */
void lmt_layer_qkv(const lmt_layer* layer, const float* x, long rows, const float* cos, const float* sin, float* qkv,
                   float* qk) {
    float* normed = (float*)malloc(sizeof(float) * rows * layer->hidden);
    lmt_rms_norm(x, normed, rows, layer->hidden, &layer->input_norm);
    product(layer, layer->qkv, normed, rows, qkv);
    free(normed);
    long width = layer->qkv.panels * 64;
    lmt_rotary(qkv, width, cos, sin, qk, rows, layer->heads + layer->kv_heads, layer->head_dim);
}

/* the rest of a decode step (one position a row): `attention` (its q, k, v, mask and scratch set;
   its out unset) over the cache, the output product, the residual add and RMSNorm, the MLP and
   its residual add: out (rows, hidden) from the layer's input x (rows, hidden) */
void lmt_layer_rest(const lmt_layer* layer, lmt_attention attention, const float* x, long rows, float* out) {
    long hidden = layer->hidden, inter = layer->inter;
    float* attended = (float*)malloc(sizeof(float) * rows * layer->heads * layer->head_dim);
    float* projected = (float*)malloc(sizeof(float) * rows * hidden);
    float* h = (float*)malloc(sizeof(float) * rows * hidden);
    float* normed = (float*)malloc(sizeof(float) * rows * hidden);
    float* gate_up = (float*)malloc(sizeof(float) * rows * 2 * inter);
    float* act = (float*)malloc(sizeof(float) * rows * inter);
    attention.out = attended;
    lmt_decode_attention(&attention);
    product(layer, layer->o, attended, rows, projected);
    lmt_add_rms_norm(x, projected, h, normed, rows, hidden, &layer->post_norm);
    product(layer, layer->gate_up, normed, rows, gate_up);
    lmt_silu_mul(gate_up, 2 * inter, act, rows, inter);
    product(layer, layer->down, act, rows, projected);
    for (long i = 0; i < rows * hidden; i++) out[i] = h[i] + projected[i];
    free(attended);
    free(projected);
    free(h);
    free(normed);
    free(gate_up);
    free(act);
}
