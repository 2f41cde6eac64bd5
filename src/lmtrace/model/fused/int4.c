/* A packed GGUF layer's product in float32 (see lmtrace/model/gguf/nibbles.py): y = x W^T where W
   is held as 4-bit codes c with, per group of 32 along the input and per output column, a scale S
   and a zero Z, the weight being (c - 8) * S + Z, summed over the layer's pieces (each piece reads
   the same input). Columns go in panels of 64: a chunk of a panel's weights is made in float32,
   fma(c - 8, S, Z) (one rounding: gguf's own dequantized value for a one-piece type), into a
   buffer, and every input row multiplies it. Each output element is a chain of fused multiply-adds
   along each chunk of 128 input positions in order, the chunks' sums added in order, so it is the
   same whatever the rows of the call, the threads sharing it, or how its rows and columns are
   blocked. Built by lmtrace.model.fused.build
   with the other kernels. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define PANEL 64 /* output columns made together */
#define CHUNK 128 /* input positions of a panel in the buffer at once (32 KB) */

/* one product: x (rows, in) float32; codes (panels, pieces * in, 32) bytes (byte j: column j's code
   in its low nibble, column j + 32's in its high one); scales and zeros (panels, pieces * in / 32,
   64) float32; y (rows, panels * 64) float32 */
typedef struct {
    const float* x;
    long rows;
    long in;
    const uint8_t* codes;
    const float* scales;
    const float* zeros;
    long panels;
    int pieces;
    float* y;
} lmt_int4;

/* the panel's weights at input positions k0 .. k0 + n of piece p, as w[k][64] */
static void weights(const lmt_int4* a, long panel, int p, long k0, long n, float* w) {
    const long k_all = a->pieces * a->in, groups = k_all / 32;
    const uint8_t* codes = a->codes + (panel * k_all + p * a->in + k0) * 32;
    const float* scales = a->scales + (panel * groups + (p * a->in + k0) / 32) * PANEL;
    const float* zeros = a->zeros + (panel * groups + (p * a->in + k0) / 32) * PANEL;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i low = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi32(8);
    for (long k = 0; k < n; k++) {
        const float* s = scales + (k / 32) * PANEL;
        const float* z = zeros + (k / 32) * PANEL;
        __m256i v = _mm256_loadu_si256((const __m256i*)(codes + k * 32));
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        __m128i parts[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1), _mm256_castsi256_si128(hi),
                            _mm256_extracti128_si256(hi, 1)};
        for (int q = 0; q < 4; q++) {
            __m256i c0 = _mm256_sub_epi32(_mm256_cvtepu8_epi32(parts[q]), eight);
            __m256i c1 = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(parts[q], 8)), eight);
            int at = q * 16;
            _mm256_storeu_ps(w + k * PANEL + at, _mm256_fmadd_ps(_mm256_cvtepi32_ps(c0), _mm256_loadu_ps(s + at),
                                                                 _mm256_loadu_ps(z + at)));
            _mm256_storeu_ps(w + k * PANEL + at + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(c1),
                                                                     _mm256_loadu_ps(s + at + 8),
                                                                     _mm256_loadu_ps(z + at + 8)));
        }
    }
#else
    for (long k = 0; k < n; k++)
        for (int j = 0; j < PANEL; j++) {
            const uint8_t b = codes[k * 32 + (j & 31)];
            const float c = (float)((j < 32 ? b & 15 : b >> 4) - 8);
            w[k * PANEL + j] = fmaf(c, scales[(k / 32) * PANEL + j], zeros[(k / 32) * PANEL + j]);
        }
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
/* rows m .. m + 4, columns j0 .. j0 + 16 of the panel: y (or, for the first chunk, 0) + x[:, k0 ..
   k0 + n] w, the chunk's products summed apart first */
static inline void four_rows(const lmt_int4* a, const float* w, long n, const float* x, float* y, long out,
                             int first) {
    __m256 acc[4][2];
    for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (long k = 0; k < n; k++) {
        __m256 w0 = _mm256_loadu_ps(w + k * PANEL), w1 = _mm256_loadu_ps(w + k * PANEL + 8);
        for (int r = 0; r < 4; r++) {
            __m256 xk = _mm256_broadcast_ss(x + r * a->in + k);
            acc[r][0] = _mm256_fmadd_ps(w0, xk, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, xk, acc[r][1]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int h = 0; h < 2; h++) {
            float* at = y + r * out + h * 8;
            _mm256_storeu_ps(at, first ? acc[r][h] : _mm256_add_ps(_mm256_loadu_ps(at), acc[r][h]));
        }
}

/* one row, the panel's 64 columns, each weight made in registers as weights() makes it (the same
   value), half a panel at a time: for calls of fewer than 4 rows, where a buffer would be written
   and read for one row's use */
static void direct(const lmt_int4* a, long panel, int p, long k0, long n, const float* x, float* y, int first) {
    const long k_all = a->pieces * a->in, groups = k_all / 32;
    const uint8_t* codes = a->codes + (panel * k_all + p * a->in + k0) * 32;
    const long group0 = panel * groups + (p * a->in + k0) / 32;
    const __m256i low = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi32(8);
    for (int half = 0; half < 2; half++) {
        __m256 acc[4], s[4], z[4];
        for (int q = 0; q < 4; q++) acc[q] = s[q] = z[q] = _mm256_setzero_ps();
        for (long k = 0; k < n; k++) {
            if (k % 32 == 0)
                for (int q = 0; q < 4; q++) {
                    s[q] = _mm256_loadu_ps(a->scales + (group0 + k / 32) * PANEL + half * 32 + q * 8);
                    z[q] = _mm256_loadu_ps(a->zeros + (group0 + k / 32) * PANEL + half * 32 + q * 8);
                }
            __m256i v = _mm256_loadu_si256((const __m256i*)(codes + k * 32));
            v = _mm256_and_si256(half ? _mm256_srli_epi16(v, 4) : v, low);
            __m128i parts[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
            __m256 xk = _mm256_broadcast_ss(x + k);
            for (int q = 0; q < 4; q++) {
                __m128i bytes = q & 1 ? _mm_srli_si128(parts[q / 2], 8) : parts[q / 2];
                __m256 c = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), eight));
                acc[q] = _mm256_fmadd_ps(_mm256_fmadd_ps(c, s[q], z[q]), xk, acc[q]);
            }
        }
        for (int q = 0; q < 4; q++) {
            float* at = y + half * 32 + q * 8;
            _mm256_storeu_ps(at, first ? acc[q] : _mm256_add_ps(_mm256_loadu_ps(at), acc[q]));
        }
    }
}

/* one row, the panel's 64 columns */
static inline void one_row(const float* w, long n, const float* x, float* y, int first) {
    __m256 acc[8];
    for (int h = 0; h < 8; h++) acc[h] = _mm256_setzero_ps();
    for (long k = 0; k < n; k++) {
        __m256 xk = _mm256_broadcast_ss(x + k);
        for (int h = 0; h < 8; h++) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(w + k * PANEL + h * 8), xk, acc[h]);
    }
    for (int h = 0; h < 8; h++)
        _mm256_storeu_ps(y + h * 8, first ? acc[h] : _mm256_add_ps(_mm256_loadu_ps(y + h * 8), acc[h]));
}
#else
static void one_row(const float* w, long n, const float* x, float* y, int first) {
    for (int j = 0; j < PANEL; j++) {
        float acc = 0.0f;
        for (long k = 0; k < n; k++) acc = fmaf(w[k * PANEL + j], x[k], acc);
        y[j] = first ? acc : y[j] + acc;
    }
}
#endif

static void panels(const lmt_int4* a, long start, long end) {
    float* w = (float*)aligned_alloc(64, sizeof(float) * CHUNK * PANEL);
    const long out = a->panels * PANEL;
    for (long panel = start; panel < end; panel++)
        for (int p = 0; p < a->pieces; p++)
            for (long k0 = 0; k0 < a->in; k0 += CHUNK) {
                const long n = a->in - k0 < CHUNK ? a->in - k0 : CHUNK;
                const int first = p == 0 && k0 == 0;
                long m = 0;
#if defined(__AVX2__) && defined(__FMA__)
                if (a->rows < 4) {
                    for (; m < a->rows; m++)
                        direct(a, panel, p, k0, n, a->x + m * a->in + k0, a->y + m * out + panel * PANEL, first);
                    continue;
                }
#endif
                weights(a, panel, p, k0, n, w);
#if defined(__AVX2__) && defined(__FMA__)
                for (; m + 4 <= a->rows; m += 4)
                    for (int j = 0; j < PANEL; j += 16)
                        four_rows(a, w + j, n, a->x + m * a->in + k0, a->y + m * out + panel * PANEL + j, out, first);
#endif
                for (; m < a->rows; m++) one_row(w, n, a->x + m * a->in + k0, a->y + m * out + panel * PANEL, first);
            }
    free(w);
}

typedef struct {
    const lmt_int4* a;
    long start, end;
} part;

static void* run(void* p) {
    const part* q = (const part*)p;
    panels(q->a, q->start, q->end);
    return NULL;
}

/* the product on `threads` threads (the calling one and threads - 1 started for the call), each
   taking a run of panels */
void lmt_int4_mm(const lmt_int4* a, int threads) {
    if (threads > 64) threads = 64;
    if (threads > a->panels) threads = (int)a->panels;
    if (threads <= 1) {
        panels(a, 0, a->panels);
        return;
    }
    pthread_t started[64];
    part parts[64];
    int running = 0;
    const long step = (a->panels + threads - 1) / threads;
    for (int t = 0; t < threads; t++) {
        const long start = t * step < a->panels ? t * step : a->panels;
        parts[t] = (part){a, start, start + step < a->panels ? start + step : a->panels};
    }
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&started[running], NULL, run, &parts[t]) == 0)
            running++;
        else
            panels(a, parts[t].start, parts[t].end); /* no thread to be had: this one does the part */
    }
    panels(a, parts[0].start, parts[0].end);
    for (int t = 0; t < running; t++) pthread_join(started[t], NULL);
}
