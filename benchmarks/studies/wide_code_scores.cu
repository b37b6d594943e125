// Would PQS's 4d×8b code (256 centroids of each 4 dimensions: half the lookups of the default's 2d×4b, the same
// D/4 bytes a key) score faster on the GPU? (benchmarks/studies/wide_code_scores.py)
//
// The default's scores are bound by shared-memory lookups (docs/results.md, "The scores"): one 4-byte read per
// (sub-space, query head), a sub-space's 16 entries in 16 banks, so a warp's read is one wavefront. 4d×8b reads half
// as many entries, but from 256-entry tables: a warp's 32 reads land in random banks and conflict (about 3.5
// wavefronts a read for random codes), and a KV head's float32 tables are 128 KB instead of 16 KB.
// A block per (batch row · KV head, chunk of keys), a thread per key, the G heads' tables in dynamic shared memory;
// each form writes the G scores of its keys, the sub-spaces summed in order 0..M-1:
//   FORM 0: 2d×4b, float32 tables [G][64][16] (the step's);
//   FORM 1: 2d×4b, float16 tables [G/2][64][16][2] (a head pair a word), float32 sums;
//   FORM 2: 4d×8b, float32 tables [G][32][256];
//   FORM 3: 4d×8b, float16 tables [G/2][32][256][2], float32 sums.
// Codes as PQS's index keeps them, 32 bytes a key at head dim 128: 2d×4b byte j holds sub-spaces 2j (low nibble)
// and 2j + 1 (high); 4d×8b byte m is sub-space m.

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

constexpr int G = 4;  // query heads per KV head
constexpr int BYTES = 32;  // code bytes a key
constexpr int THREADS = 512;

template <bool WIDE, bool HALF>
__global__ void __launch_bounds__(THREADS) scores(const uint32_t* __restrict__ tables,
                                                  const uint8_t* __restrict__ codes, float* __restrict__ out, int N,
                                                  int chunk) {
    constexpr int M = WIDE ? 32 : 64, CC = WIDE ? 256 : 16;
    constexpr int WORDS = (HALF ? G / 2 : G) * M * CC;
    extern __shared__ uint32_t table[];
    const int bh = blockIdx.y;
    for (int i = threadIdx.x; i < WORDS; i += THREADS) table[i] = tables[(size_t)bh * WORDS + i];
    __syncthreads();
    const float* f32 = reinterpret_cast<const float*>(table);
    const __half2* h2 = reinterpret_cast<const __half2*>(table);
    const int end = min(N, (blockIdx.x + 1) * chunk);
    for (int n = blockIdx.x * chunk + threadIdx.x; n < end; n += THREADS) {
        const uint4* code = reinterpret_cast<const uint4*>(codes + ((size_t)bh * N + n) * BYTES);
        const uint4 lo = __ldg(code), hi = __ldg(code + 1);
        const unsigned words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        float s[G];
#pragma unroll
        for (int g = 0; g < G; ++g) s[g] = 0.f;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const unsigned c = WIDE ? (words[m / 4] >> (8 * (m % 4))) & 255 : (words[m / 8] >> (4 * (m % 8))) & 15;
            if (HALF) {
#pragma unroll
                for (int p = 0; p < G / 2; ++p) {
                    const float2 f = __half22float2(h2[(p * M + m) * CC + c]);
                    s[2 * p] += f.x;
                    s[2 * p + 1] += f.y;
                }
            } else {
#pragma unroll
                for (int g = 0; g < G; ++g) s[g] += f32[(g * M + m) * CC + c];
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) out[((size_t)bh * G + g) * N + n] = s[g];
    }
}

template <bool WIDE, bool HALF>
static int run(const uint32_t* t, const uint8_t* c, float* o, int BH, int N, int chunk, cudaStream_t s) {
    constexpr int M = WIDE ? 32 : 64, CC = WIDE ? 256 : 16;
    const size_t smem = sizeof(uint32_t) * (HALF ? G / 2 : G) * M * CC;
    cudaError_t err = cudaFuncSetAttribute(scores<WIDE, HALF>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess) return (int)err;
    scores<WIDE, HALF><<<dim3((N + chunk - 1) / chunk, BH), THREADS, smem, s>>>(t, c, o, N, chunk);
    return (int)cudaGetLastError();
}

extern "C" int launch_scores(int form, const void* tables, const void* codes, void* out, int BH, int N, int chunk,
                             void* stream) {
    const cudaStream_t s = (cudaStream_t)stream;
    const uint32_t* t = (const uint32_t*)tables;
    const uint8_t* c = (const uint8_t*)codes;
    float* o = (float*)out;
    switch (form) {
        case 0: return run<false, false>(t, c, o, BH, N, chunk, s);
        case 1: return run<false, true>(t, c, o, BH, N, chunk, s);
        case 2: return run<true, false>(t, c, o, BH, N, chunk, s);
        case 3: return run<true, true>(t, c, o, BH, N, chunk, s);
        default: return (int)cudaErrorInvalidValue;
    }
}
