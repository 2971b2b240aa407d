/*
 * What a park of a transposed V (flash attention off) can reach on this machine, apart from the server.
 *
 * A request's cells, contiguous in the pool, are in a transposed V one run of CELLS*2 bytes per channel,
 * a row of the whole pool (KV*2 bytes) apart; a park packs them. This copies 64 layers x 64 channels of
 * such rows into one buffer six ways and prints each against a same-run memcpy of 512 MiB:
 *   v0 memcpy per row (what the server does for rows under 16 KiB)   v1 streamed stores per row
 *   v2 memcpy + prefetch of the next row's first 1 KiB              v3 streamed + the same prefetch
 *   v4 streamed + prefetch of the whole next row                    v5 streamed in 1 KiB pieces, each
 *   prefetching the next row's same piece                            v6/v7 4/8 rows at once, 512 B each
 *
 *   cc -O2 -o /tmp/strided_save bench/strided_save.c && /tmp/strided_save 1024 25600 && /tmp/strided_save 6144 25600
 *
 * (CELLS = 1024: a 16 MiB f16 snapshot of the 64-layer model; 6144: 96 MiB; KV = the pool's cells.)
 * Measured in docs/parking.md ("Contiguous cells ..."): no variant gets a 2 KiB row past about half of
 * memcpy, or a 12 KiB row reliably past memcpy per row.
 */
#define _POSIX_C_SOURCE 200112L
#include <emmintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xmmintrin.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void streamed(uint8_t * d, const uint8_t * s, size_t n) {
    size_t head = (16 - ((uintptr_t) d & 15)) & 15;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= 16; n -= 16, d += 16, s += 16) {
        _mm_stream_si128((__m128i *) d, _mm_loadu_si128((const __m128i *) s));
    }
    memcpy(d, s, n);
}

static void prefetch(const uint8_t * p, size_t n) {
    for (size_t o = 0; o < n; o += 64) {
        _mm_prefetch((const char *) p + o, _MM_HINT_T0);
    }
}

int main(int argc, char ** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s CELLS KV\n", argv[0]);
        return 2;
    }
    const size_t layers = 64, ch = 64, blk = (size_t) atol(argv[1]) * 2, stride = (size_t) atol(argv[2]) * 2;
    const size_t big = (size_t) 512 << 20, tot = layers * ch * blk;
    uint8_t * V[64];
    for (size_t l = 0; l < layers; l++) {
        V[l] = aligned_alloc(4096, ch * stride);
        memset(V[l], 1, ch * stride);
    }
    uint8_t *dst = aligned_alloc(4096, tot), *a = aligned_alloc(4096, big), *b = aligned_alloc(4096, big);
    memset(dst, 0, tot), memset(a, 1, big), memset(b, 2, big);
    printf("| rows | variant | GB/s | vs memcpy |\n|---|---|---|---|\n");
    for (int rep = 0; rep < 3; rep++) {
        for (int v = 0; v < 8; v++) {
            double t = now();
            memcpy(b, a, big);  // also evicts the rows from the caches
            const double mc = big / (now() - t) / 1e9;
            t = now();
            uint8_t * d = dst;
            for (size_t l = 0; l < layers; l++) {
                if (v >= 6) {
                    const size_t R = v == 6 ? 4 : 8;
                    for (size_t c = 0; c < ch; c += R, d += R * blk) {
                        for (size_t o = 0; o < blk; o += 512) {
                            for (size_t r = 0; r < R; r++) {
                                memcpy(d + r * blk + o, V[l] + (c + r) * stride + o, blk - o < 512 ? blk - o : 512);
                            }
                        }
                    }
                    continue;
                }
                for (size_t c = 0; c < ch; c++, d += blk) {
                    const uint8_t * s = V[l] + c * stride;
                    const uint8_t * next = c + 1 < ch ? s + stride : (l + 1 < layers ? V[l + 1] : s);
                    if (v == 5) {
                        for (size_t o = 0; o < blk; o += 1024) {
                            const size_t k = blk - o < 1024 ? blk - o : 1024;
                            prefetch(next + o, k);
                            streamed(d + o, s + o, k);
                        }
                        continue;
                    }
                    if (v >= 2) {
                        prefetch(next, v == 4 ? blk : (blk < 1024 ? blk : 1024));
                    }
                    if (v == 0 || v == 2) {
                        memcpy(d, s, blk);
                    } else {
                        streamed(d, s, blk);
                    }
                }
            }
            const double g = tot / (now() - t) / 1e9;
            printf("| %zu B | v%d | %.1f | %.0f%% |\n", blk, v, g, 100 * g / mc);
        }
    }
    return 0;
}
