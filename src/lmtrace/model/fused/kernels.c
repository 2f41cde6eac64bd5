/* lmtrace's fused small operations of a Llama decoder layer, float32, one thread (see
   lmtrace/model/fused/__init__.py). Built at first use by lmtrace.model.fused.build with
   -ffp-contract=off: each product and sum is rounded as torch rounds it, no fused multiply-add. */
#include <math.h>

#include "kernels.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(LMT_MVEC)
__m256 _ZGVdN8v_expf(__m256); /* glibc's libmvec: expf on 8 lanes */
#endif

/* The sum of the squares of n floats in torch's order (ATen's SumKernel.cpp for a contiguous row:
   vectors of `lanes` floats, four at a time, summed in levels of 16, the four then the lanes added in
   turn), so that RMSNorm's mean of squares is torch's to the bit where `lanes` is its vector width
   (8 with AVX2, 16 with AVX-512). */
static float sum_of_squares(const float* x, long n, int lanes) {
    float acc[4][4][16] = {{{0}}}; /* [level][one of the four vectors][lane] */
    long vectors = n / lanes, size = vectors / 4, power = 0;
    while ((1L << power) < size) power++;
    power = power / 4 < 4 ? 4 : power / 4;
    long step = 1L << power, i = 0;
    while (i + step <= size) {
        for (long j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < lanes; l++) acc[0][k][l] += x[(i * 4 + k) * lanes + l] * x[(i * 4 + k) * lanes + l];
        for (int level = 1; level < 4; level++) {
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < lanes; l++) {
                    acc[level][k][l] += acc[level - 1][k][l];
                    acc[level - 1][k][l] = 0;
                }
            if (i & ((step - 1) << (level * power))) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < lanes; l++) acc[0][k][l] += x[(i * 4 + k) * lanes + l] * x[(i * 4 + k) * lanes + l];
    for (int level = 1; level < 4; level++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < lanes; l++) acc[0][k][l] += acc[level][k][l];
    for (long v = size * 4; v < vectors; v++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += x[v * lanes + l] * x[v * lanes + l];
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0;
    for (long t = vectors * lanes; t < n; t++) total += x[t] * x[t];
    for (int l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}


/* out = w * (x * rsqrt(mean(x^2) + eps)) per row of n: transformers' LlamaRMSNorm in float32, as
   torch's rms_norm computes it */
void lmt_rms_norm(const float* x, float* out, long rows, long n, const lmt_norm* norm) {
    const float* w = norm->weight;
    for (long r = 0; r < rows; r++) {
        const float* xr = x + r * n;
        float* o = out + r * n;
        float rstd = 1.0f / sqrtf(sum_of_squares(xr, n, norm->lanes) / (float)n + norm->eps);
        for (long i = 0; i < n; i++) o[i] = w[i] * (xr[i] * rstd);
    }
}

/* h = x + y (the residual stream), out = the RMSNorm of h */
void lmt_add_rms_norm(const float* x, const float* y, float* h, float* out, long rows, long n, const lmt_norm* norm) {
    for (long i = 0; i < rows * n; i++) h[i] = x[i] + y[i];
    lmt_rms_norm(h, out, rows, n, norm);
}

/* out[r, i] = silu(g[i]) * u[i] where row r of gu (stride floats apart) is [g (inter), u (inter)] */
void lmt_silu_mul(const float* gu, long stride, float* out, long rows, long inter) {
    for (long r = 0; r < rows; r++) {
        const float* g = gu + r * stride;
        const float* u = g + inter;
        float* o = out + r * inter;
        long i = 0;
#if defined(__AVX2__) && defined(LMT_MVEC)
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= inter; i += 8) {
            __m256 x = _mm256_loadu_ps(g + i);
            __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, _ZGVdN8v_expf(_mm256_sub_ps(zero, x))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < inter; i++) o[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    }
}

/* the rotary embedding of `heads` heads of d per row: out = x * cos + rotate_half(x) * sin, where
   rotate_half(x) = [-x[d/2:], x[:d/2]] (transformers' apply_rotary_pos_emb, the same roundings);
   row r of x starts stride floats after row r - 1, cos and sin are (rows, d), out (rows, heads, d) */
void lmt_rotary(const float* x, long stride, const float* cos, const float* sin, float* out, long rows, long heads,
                long d) {
    long half = d / 2;
    for (long r = 0; r < rows; r++) {
        const float* c = cos + r * d;
        const float* s = sin + r * d;
        for (long h = 0; h < heads; h++) {
            const float* xh = x + r * stride + h * d;
            float* o = out + (r * heads + h) * d;
            for (long i = 0; i < half; i++) o[i] = xh[i] * c[i] + (-xh[i + half]) * s[i];
            for (long i = half; i < d; i++) o[i] = xh[i] * c[i] + xh[i - half] * s[i];
        }
    }
}

/* the dot product of two rows of n floats: 8 running sums (one AVX2 register), then added pairwise */
static float dot(const float* a, const float* b, long n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    long i = 0;
#if defined(__AVX2__)
    __m256 sum = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) sum = _mm256_add_ps(sum, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    _mm256_storeu_ps(acc, sum);
#endif
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float tail = 0;
    for (; i < n; i++) tail += a[i] * b[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
}

/* exp(x - top) in place over n floats (-inf: 0), and their sum */
static float exp_shifted(float* x, long n, float top) {
    long l = 0;
    float total = 0.0f;
#if defined(__AVX2__) && defined(LMT_MVEC)
    __m256 sum = _mm256_setzero_ps(), shift = _mm256_set1_ps(top);
    for (; l + 8 <= n; l += 8) {
        __m256 e = _ZGVdN8v_expf(_mm256_sub_ps(_mm256_loadu_ps(x + l), shift)); /* exp(-inf) = 0 */
        _mm256_storeu_ps(x + l, e);
        sum = _mm256_add_ps(sum, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sum);
    total = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
#endif
    for (; l < n; l++) {
        x[l] = expf(x[l] - top);
        total += x[l];
    }
    return total;
}

/* o (d) = sum over l of p[l] * v[l * v_sl + i] */
static void weighted_sum(const float* p, const float* v, long v_sl, long length, long d, float* o) {
    long i = 0;
#if defined(__AVX2__)
    for (; i + 32 <= d; i += 32) { /* 32 outputs in 4 registers, the keys streamed once */
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (long l = 0; l < length; l++) {
            const float* vl = v + l * v_sl + i;
            __m256 w = _mm256_set1_ps(p[l]);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(w, _mm256_loadu_ps(vl)));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(w, _mm256_loadu_ps(vl + 8)));
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(w, _mm256_loadu_ps(vl + 16)));
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(w, _mm256_loadu_ps(vl + 24)));
        }
        _mm256_storeu_ps(o + i, a0);
        _mm256_storeu_ps(o + i + 8, a1);
        _mm256_storeu_ps(o + i + 16, a2);
        _mm256_storeu_ps(o + i + 24, a3);
    }
#endif
    for (; i < d; i++) {
        float acc = 0.0f;
        for (long l = 0; l < length; l++) acc += p[l] * v[l * v_sl + i];
        o[i] = acc;
    }
}


/* softmax(scale q.k) v over each row's keys for every row and query head, query head h reading
   key/value head h / (heads / kv_heads) (grouped-query). A row with no key to attend gets zeros. */
void lmt_decode_attention(const lmt_attention* a) {
    long group = a->heads / a->kv_heads, d = a->d, length = a->length;
    float* scores = a->scores;
    for (long b = 0; b < a->batch; b++) {
        for (long h = 0; h < a->heads; h++) {
            const float* qh = a->q + b * a->q_stride[0] + h * a->q_stride[1];
            const float* kh = a->k + b * a->k_stride[0] + (h / group) * a->k_stride[1];
            const unsigned char* keep = a->keep ? a->keep + b * a->keep_stride : 0;
            float* o = a->out + (b * a->heads + h) * d;
            float top = -INFINITY;
            for (long l = 0; l < length; l++) {
                scores[l] = keep && !keep[l] ? -INFINITY : dot(qh, kh + l * a->k_stride[2], d) * a->scale;
                if (scores[l] > top) top = scores[l];
            }
            if (top == -INFINITY) {
                for (long i = 0; i < d; i++) o[i] = 0.0f;
                continue;
            }
            float total = exp_shifted(scores, length, top);
            for (long l = 0; l < length; l++) scores[l] /= total;
            const float* vh = a->v + b * a->v_stride[0] + (h / group) * a->v_stride[1];
            weighted_sum(scores, vh, a->v_stride[2], length, d, o);
        }
    }
}
