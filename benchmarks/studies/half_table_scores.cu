// Would PQS's scores take fewer shared-memory reads from 16-bit tables? (benchmarks/studies/half_table_scores.py)
//
// The fused step's CUDA shortlist (plugins/kernels/pq_shortlist.cu) scores a key with one 4-byte shared-memory read
// per (sub-space, query head): a sub-space's 16 float32 entries fill the 32 banks' half, so a warp's read takes one
// wavefront, and the scores are bound by those wavefronts. Two heads' entries in one 4-byte word halve the reads.
// A block per (batch row · KV head, chunk of keys), a thread per key, the tables in shared memory; each form writes
// the G scores of its keys, the sub-spaces summed in order 0..M-1 (what the step does):
//   FORM 0: float32 tables [G][M][CC], float32 sums (the step's);
//   FORM 1: float16 tables [G/2][M][CC][2] (a head pair a word), float32 sums;
//   FORM 2: float16 tables, float16 sums (__hadd2, two heads an add);
//   FORM 3: bfloat16 tables [G/2][M][CC][2], float32 sums (each half of the word made a float by a shift or a mask).
// Codes as PQS's index keeps them: [BH, N, M/2] uint8, byte j holding sub-space 2j (low nibble) and 2j + 1 (high).

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

constexpr int M = 64;     // sub-spaces (head dim 128, two dimensions each)
constexpr int CC = 16;    // centroids per sub-space
constexpr int G = 4;      // query heads per KV head
constexpr int THREADS = 256;

template <int FORM>
__global__ void __launch_bounds__(THREADS) scores(const uint32_t* __restrict__ tables,
                                                  const uint8_t* __restrict__ codes, float* __restrict__ out, int N,
                                                  int chunk) {
    constexpr int WORDS = FORM == 0 ? G * M * CC : G / 2 * M * CC;
    __shared__ uint32_t table[WORDS];
    const int bh = blockIdx.y;
    for (int i = threadIdx.x; i < WORDS; i += THREADS) table[i] = tables[(size_t)bh * WORDS + i];
    __syncthreads();
    const float* f32 = reinterpret_cast<const float*>(table);
    const __half2* h2 = reinterpret_cast<const __half2*>(table);
    const int end = min(N, (blockIdx.x + 1) * chunk);
    for (int n = blockIdx.x * chunk + threadIdx.x; n < end; n += THREADS) {
        const uint4* code = reinterpret_cast<const uint4*>(codes + ((size_t)bh * N + n) * (M / 2));
        const uint4 lo = __ldg(code), hi = __ldg(code + 1);
        const unsigned words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        float s[G];
        __half2 h[G / 2];
#pragma unroll
        for (int g = 0; g < G; ++g) s[g] = 0.f;
#pragma unroll
        for (int p = 0; p < G / 2; ++p) h[p] = __float2half2_rn(0.f);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int b = 0; b < 8; ++b) {  // a nibble at a time: sub-space m = 8j + b
                const int m = 8 * j + b;
                const unsigned c = (words[j] >> (4 * b)) & 15;
                if (FORM == 0) {
#pragma unroll
                    for (int g = 0; g < G; ++g) s[g] += f32[(g * M + m) * CC + c];
                } else {
#pragma unroll
                    for (int p = 0; p < G / 2; ++p) {
                        const int at = (p * M + m) * CC + c;
                        if (FORM == 1) {
                            const float2 f = __half22float2(h2[at]);
                            s[2 * p] += f.x;
                            s[2 * p + 1] += f.y;
                        } else if (FORM == 2) {
                            h[p] = __hadd2(h[p], h2[at]);
                        } else {
                            const uint32_t w = table[at];
                            s[2 * p] += __uint_as_float(w << 16);
                            s[2 * p + 1] += __uint_as_float(w & 0xFFFF0000u);
                        }
                    }
                }
            }
        }
        if (FORM == 2) {
#pragma unroll
            for (int p = 0; p < G / 2; ++p) {
                const float2 f = __half22float2(h[p]);
                s[2 * p] = f.x, s[2 * p + 1] = f.y;
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) out[((size_t)bh * G + g) * N + n] = s[g];
    }
}

extern "C" int launch_scores(int form, const void* tables, const void* codes, void* out, int BH, int N, int chunk,
                             void* stream) {
    const dim3 grid((N + chunk - 1) / chunk, BH);
    const cudaStream_t s = (cudaStream_t)stream;
    const uint32_t* t = (const uint32_t*)tables;
    const uint8_t* c = (const uint8_t*)codes;
    float* o = (float*)out;
    switch (form) {
        case 0: scores<0><<<grid, THREADS, 0, s>>>(t, c, o, N, chunk); break;
        case 1: scores<1><<<grid, THREADS, 0, s>>>(t, c, o, N, chunk); break;
        case 2: scores<2><<<grid, THREADS, 0, s>>>(t, c, o, N, chunk); break;
        case 3: scores<3><<<grid, THREADS, 0, s>>>(t, c, o, N, chunk); break;
        default: return (int)cudaErrorInvalidValue;
    }
    return (int)cudaGetLastError();
}
