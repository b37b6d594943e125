// Issue 56's question, asked in CUDA: can one launch per (batch row, KV head) score PQS's codes for every query head
// of the group, keep the scores on chip, and cut each head's shortlist there — instead of writing the scores to global
// memory and reading them back in two more launches (pq_scores, pq_cut, pq_list)?
//
// A (batch row, KV head)'s scores do not fit one SM's shared memory (16K positions × 4 heads × 4 bytes = 256 KB), so
// the launch uses a thread-block cluster (sm_90): CL blocks share the positions, each keeps its part of the scores in
// its own shared memory, and the cluster's blocks read each other's radix histograms through distributed shared
// memory, meeting at cluster barriers. Triton has no such barrier, which is why this is CUDA.
//
// Two kernels (benchmarks/studies/cluster_shortlist.py builds and times them):
//   lut_scores:        a block per (batch row · KV head, chunk): each key's G scores Σ_m table[g, m, code_m] from the
//                      tables in shared memory, written to global memory (what Triton's _group_lut_scores does);
//   cluster_shortlist: a cluster per (batch row · KV head): the same scores kept in shared memory as order keys, each
//                      head's k-th largest by a radix select over four 8-bit digits (the cluster's histograms summed
//                      through distributed shared memory), and the k positions written (ties at the cut: the first
//                      blocks' first; within a block in no set order).
// Layouts as PQS's index keeps them: tables [BH, G, M, 16] float32, codes [BH, N, M/2] uint8, two 4-bit codes a byte
// (byte j: sub-space 2j in the low nibble, 2j + 1 in the high one).

#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace cg = cooperative_groups;

constexpr int M = 64;       // sub-spaces (head dim 128, two dimensions each)
constexpr int CC = 16;      // centroids per sub-space (4-bit codes)
constexpr int W = M / 2;    // code bytes per key
constexpr int G = 4;        // query heads per KV head (Llama-3.1-8B: 32 / 8)
constexpr int THREADS = 256;

__device__ __forceinline__ unsigned order_key(float f) {  // float → unsigned, same order
    unsigned b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The G scores of one key: sub-spaces summed in order, 0..M-1, as a float32 running sum.
__device__ __forceinline__ void score_key(const float* __restrict__ table, const uint8_t* __restrict__ code,
                                          float out[G]) {
    uint4 lo = __ldg(reinterpret_cast<const uint4*>(code));
    uint4 hi = __ldg(reinterpret_cast<const uint4*>(code + 16));
    unsigned words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int g = 0; g < G; ++g) out[g] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            unsigned byte = (words[j] >> (8 * b)) & 0xFF;
            int m = 2 * (4 * j + b);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                out[g] += table[(g * M + m) * CC + (byte & 15)];
                out[g] += table[(g * M + m + 1) * CC + (byte >> 4)];
            }
        }
    }
}

__device__ __forceinline__ void load_tables(float* table, const float* __restrict__ tables, int bh) {
    for (int i = threadIdx.x; i < G * M * CC; i += blockDim.x) table[i] = tables[(size_t)bh * G * M * CC + i];
}

__global__ void lut_scores(const float* __restrict__ tables, const uint8_t* __restrict__ codes,
                           float* __restrict__ scores, int N, int chunk) {
    __shared__ float table[G * M * CC];
    int bh = blockIdx.y;
    load_tables(table, tables, bh);
    __syncthreads();
    int start = blockIdx.x * chunk, end = min(start + chunk, N);
    for (int n = start + threadIdx.x; n < end; n += blockDim.x) {
        float s[G];
        score_key(table, codes + ((size_t)bh * N + n) * W, s);
#pragma unroll
        for (int g = 0; g < G; ++g) scores[((size_t)bh * G + g) * N + n] = s[g];
    }
}

// Each head's digit of the cut from the cluster's summed histograms `total` [G][256]: the largest digit d whose bins
// d..255 hold at least `rest` keys; `rest` becomes the count still wanted within bin d. One warp per head.
__device__ void pick_digits(const unsigned* total, unsigned* digit, unsigned* rest) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp < G) {
        unsigned c[8], mine = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) mine += (c[j] = total[warp * 256 + lane * 8 + j]);
        unsigned suffix = mine;  // Σ over lanes ≥ this lane
        for (int o = 1; o < 32; o <<= 1) {
            unsigned v = __shfl_down_sync(0xFFFFFFFFu, suffix, o);
            if (lane + o < 32) suffix += v;
        }
        unsigned want = rest[warp];
        __syncwarp();
        if (suffix - mine < want && suffix >= want) {
            unsigned above = suffix - mine;
            for (int j = 7; j >= 0; --j) {
                if (above + c[j] >= want) {
                    digit[warp] = lane * 8 + j;
                    rest[warp] = want - above;
                    break;
                }
                above += c[j];
            }
        }
    }
}

__global__ void cluster_shortlist(const float* __restrict__ tables, const uint8_t* __restrict__ codes, int N, int k,
                                  int* __restrict__ listed, unsigned* __restrict__ cuts) {
    cg::cluster_group cluster = cg::this_cluster();
    const int CL = cluster.num_blocks();
    const int rank = cluster.block_rank();
    const int bh = blockIdx.x / CL;
    const int chunk = (N + CL - 1) / CL;
    const int start = rank * chunk;
    const int len = max(0, min(chunk, N - start));

    extern __shared__ unsigned char smem[];
    float* table = reinterpret_cast<float*>(smem);             // G·M·CC
    unsigned* hist = reinterpret_cast<unsigned*>(table + G * M * CC);  // G·256: this block's
    unsigned* total = hist + G * 256;                          // G·256: the cluster's
    unsigned* state = total + G * 256;                         // per head: prefix, rest, digit, above, tied, taken
    unsigned* keys = state + 8 * G;                            // G·chunk order keys
    unsigned* prefix = state, *rest = state + G, *digit = state + 2 * G;
    unsigned* above = state + 3 * G, *tied = state + 4 * G, *written = state + 5 * G, *tie_taken = state + 6 * G;

    load_tables(table, tables, bh);
    for (int i = threadIdx.x; i < G * 256; i += blockDim.x) hist[i] = 0;
    if (threadIdx.x < G) {
        prefix[threadIdx.x] = 0;
        rest[threadIdx.x] = k;
        above[threadIdx.x] = tied[threadIdx.x] = written[threadIdx.x] = tie_taken[threadIdx.x] = 0;
    }
    __syncthreads();
    // 1. The scores, kept as order keys, and each head's histogram of their first digit.
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        float s[G];
        score_key(table, codes + ((size_t)bh * N + start + i) * W, s);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            unsigned key = order_key(s[g]);
            keys[g * chunk + i] = key;
            atomicAdd(&hist[g * 256 + (key >> 24)], 1u);
        }
    }
    // 2. Four digits: the cluster's histograms summed from every block's shared memory, the digit picked, the next
    // digit counted among the keys that share the cut's digits so far.
    for (int pass = 0; pass < 4; ++pass) {
        cluster.sync();  // every block's histogram complete
        for (int i = threadIdx.x; i < G * 256; i += blockDim.x) {
            unsigned sum = 0;
            for (int r = 0; r < CL; ++r) sum += cluster.map_shared_rank(hist, r)[i];
            total[i] = sum;
        }
        __syncthreads();
        pick_digits(total, digit, rest);
        __syncthreads();
        if (threadIdx.x < G) prefix[threadIdx.x] = (prefix[threadIdx.x] << 8) | digit[threadIdx.x];
        cluster.sync();  // every block done reading the histograms
        if (pass == 3) break;
        for (int i = threadIdx.x; i < G * 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const int shift = 24 - 8 * pass;  // the bits of the digits found so far start here
        for (int i = threadIdx.x; i < len; i += blockDim.x) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                unsigned key = keys[g * chunk + i];
                if ((key >> shift) == prefix[g]) atomicAdd(&hist[g * 256 + ((key >> (shift - 8)) & 0xFF)], 1u);
            }
        }
    }
    // 3. The listing: every key above the cut, and the first `rest` tied with it, block by block.
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            unsigned key = keys[g * chunk + i];
            if (key > prefix[g]) atomicAdd(&above[g], 1u);
            else if (key == prefix[g]) atomicAdd(&tied[g], 1u);
        }
    }
    cluster.sync();
    __shared__ unsigned base_above[G], base_tied[G], all_above[G];
    if (threadIdx.x < G) {
        unsigned a = 0, t = 0, total_above = 0;
        for (int r = 0; r < CL; ++r) {
            unsigned ra = cluster.map_shared_rank(above, r)[threadIdx.x];
            unsigned rt = cluster.map_shared_rank(tied, r)[threadIdx.x];
            if (r < rank) a += ra, t += rt;
            total_above += ra;
        }
        base_above[threadIdx.x] = a;
        base_tied[threadIdx.x] = t;
        all_above[threadIdx.x] = total_above;
        if (rank == 0) cuts[bh * G + threadIdx.x] = prefix[threadIdx.x];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            unsigned key = keys[g * chunk + i];
            int* out = listed + ((size_t)bh * G + g) * k;
            if (key > prefix[g]) {
                out[base_above[g] + atomicAdd(&written[g], 1u)] = start + i;
            } else if (key == prefix[g]) {
                unsigned t = base_tied[g] + atomicAdd(&tie_taken[g], 1u);
                if (t < rest[g]) out[all_above[g] + t] = start + i;
            }
        }
    }
    cluster.sync();  // no block leaves while another may still read its shared memory
}

extern "C" {

int launch_lut_scores(const void* tables, const void* codes, void* scores, int BH, int N, int chunk, void* stream) {
    dim3 grid((N + chunk - 1) / chunk, BH);
    lut_scores<<<grid, THREADS, 0, (cudaStream_t)stream>>>((const float*)tables, (const uint8_t*)codes,
                                                          (float*)scores, N, chunk);
    return (int)cudaGetLastError();
}

size_t cluster_shortlist_smem(int N, int CL) {
    int chunk = (N + CL - 1) / CL;
    return sizeof(float) * G * M * CC + sizeof(unsigned) * (2 * G * 256 + 8 * G + (size_t)G * chunk);
}

int launch_cluster_shortlist(const void* tables, const void* codes, int BH, int N, int k, int CL, void* listed,
                             void* cuts, void* stream) {
    size_t smem = cluster_shortlist_smem(N, CL);
    cudaError_t err = cudaFuncSetAttribute(cluster_shortlist, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess) return (int)err;
    if (CL > 8) {
        err = cudaFuncSetAttribute(cluster_shortlist, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
        if (err != cudaSuccess) return (int)err;
    }
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(BH * CL);
    config.blockDim = dim3(THREADS);
    config.dynamicSmemBytes = smem;
    config.stream = (cudaStream_t)stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeClusterDimension;
    attribute[0].val.clusterDim.x = CL;
    attribute[0].val.clusterDim.y = 1;
    attribute[0].val.clusterDim.z = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    err = cudaLaunchKernelEx(&config, cluster_shortlist, (const float*)tables, (const uint8_t*)codes, N, k,
                             (int*)listed, (unsigned*)cuts);
    return (int)err;
}

}  // extern "C"
