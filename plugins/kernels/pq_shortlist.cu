// PQS's scores and two-stage shortlist in one launch: what ``pq_scores``, ``pq_cut`` and ``pq_list`` do in three
// Triton launches (``plugins/kernels/two_stage.py``), the same outputs, with the scores kept on chip between the
// phases. Loaded by ``plugins/kernels/pq_shortlist_cuda.py``, which compiles it with nvcc at first use (sm_90+).
//
// Why CUDA: a (batch row, KV head)'s scores do not fit one SM's shared memory (16K positions × 4 selection rows ×
// 4 bytes = 256 KB), and the cut needs every position's score before any is listed. Triton has no barrier between
// programs, so its step writes the scores, cuts in a second launch and lists in a third. A thread-block cluster
// (sm_90) of CL blocks shares the positions: each block keeps its part of the scores in its own shared memory, and
// the blocks sum each other's radix histograms through distributed shared memory between cluster barriers.
//
// One cluster per (batch row b, KV head h) = bh; each block owns `chunk` consecutive positions (block rank r:
// [r·chunk, (r + 1)·chunk)). Per selection row s of the head (GS of them, each the max over G query heads):
//   1. scores: s·max_j Σ_m table[s, j, m, code_m] (sub-spaces summed in order), -inf outside the clusters (the sink,
//      the local window, padding — but the row leaving the window is inside: it joins a cluster in this step; the
//      clustered positions are the range [start + sink, n - 1 - local], no per-key read: ``StaticState``), kept
//      in shared memory; each row's histogram of the first 8-bit digit of the scores' order keys;
//   2. the cut: k = min(⌈rerank · E_sel⌉, L, the inside positions), τ the k-th largest key by a radix select over
//      four 8-bit digits (each pass the cluster's histograms summed), `ties` the keys equal to τ that the shortlist
//      takes (the first ones in position order: the reference's stable sort);
//   3. the listing, in position order: a block's place in the row's shortlist from the counts of the blocks before
//      it; within the block, each warp's span of consecutive positions placed after the warps before it, ranks from
//      warp ballots. Each listed position is written to `listed`, and its score becomes its box (a NaN whose
//      payload is its entry + 1: ``listed_box``); every other position below the length gets its score.
// The listed rows' exact logits are Triton's (``exact_logits``, the launch after this one: a launch of its own keeps
// every SM's warps on the K rows' loads). On an H100, per head at 32 × 32K and 1%, inside this launch (within the
// clusters' blocks, a warp eight K rows at a time, each read once for the rows that list it) they took 0.9 ms against
// 0.10; a Triton launch over the union of a KV head's entries (each K row read by the first row that lists it, the
// others' entries found through their boxes) took 0.14 against 0.10, and 0.41 against 0.27 at 3%: each box's 4-byte
// read costs a 32-byte sector (commit 70cddbc, ``pq_shortlist_phases``).
// Order keys as ``unsigned_key``: the float's bits, negated magnitude for negative floats, plus 2^31 (-0.0 and 0.0
// share a key).

//
// Compiled once per (query heads a KV head, shared or per head) pair: the heads' loops unroll, the sums stay in
// registers. `stop` (a study's knob, 0 in the step) ends the launch after a phase: 1 the scores, 2 the cut.

#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace cg = cooperative_groups;

// 512 threads a block, the listing a warp's span at a time (not tiles of the block's threads, four barriers a tile):
// on an H100 per head, the fused step in a CUDA graph at 32 × 32K took 1.620 / 2.395 ms at 1% / 3% against
// 1.895 / 2.649 with 256 threads and tiles, at 16 × 16K 0.506 / 0.694 against 0.511 / 0.708 (dense 1.348 and
// 0.352 ms). Counting the histograms' bins a warp at a time (``__match_any_sync``, one atomic a bin) was slower than
// the same-address atomics: 0.503 against 0.448 ms for the scores at 32 × 32K
// (``benchmarks/studies/results/pq_shortlist_listing_h100.json``).
constexpr int THREADS = 512;
constexpr int WARPS = THREADS / 32;
constexpr int MAX_HEADS = 8;  // query heads a KV head

__device__ __forceinline__ unsigned order_key(float f) {
    const unsigned bits = __float_as_uint(f);
    return (bits & 0x80000000u) ? 0x80000000u - (bits & 0x7FFFFFFFu) : bits | 0x80000000u;
}

struct Args {
    const float* tables;        // [BH, GS, G, M, CC]
    const uint8_t* codes;       // [BH, CAP, W]
    const int64_t* length;      // [1]
    const int64_t* start;       // [B]: each row's first valid position
    const double* density;      // [1]
    const double* multiple;     // [1]
    float* scores;              // [BH·GS, CAP]
    int* listed;                // [BH·GS, L]
    int* counts;                // [BH·GS]
    int64_t* cut;               // [BH·GS]
    int* ties;                  // [BH·GS]
    int Hkv, M, CC, W, packed, local, cap, fixed, tokens, L, chunk, stop;
    float scale;
};

// The digit of each row's cut from the cluster's summed histograms `total` [GS][256]: the largest d whose bins
// d..255 hold at least rest[s] keys; rest[s] becomes the count still wanted within bin d. A warp a row.
template <int GS>
__device__ void pick_digits(const unsigned* total, unsigned* digit, unsigned* rest) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int s = warp; s < GS; s += WARPS) {
        unsigned c[8], mine = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) mine += (c[j] = total[s * 256 + lane * 8 + j]);
        unsigned suffix = mine;  // Σ over lanes ≥ this one
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned v = __shfl_down_sync(0xFFFFFFFFu, suffix, o);
            if (lane + o < 32) suffix += v;
        }
        const unsigned want = rest[s];
        __syncwarp();
        if (want > 0 && suffix - mine < want && suffix >= want) {
            unsigned above = suffix - mine;
            for (int j = 7; j >= 0; --j) {
                if (above + c[j] >= want) {
                    digit[s] = lane * 8 + j;
                    rest[s] = want - above;
                    break;
                }
                above += c[j];
            }
        }
        __syncwarp();
    }
}

template <int HEADS, bool SHARED>
__global__ void __launch_bounds__(THREADS) pq_shortlist(Args a) {
    constexpr int GS = SHARED ? 1 : HEADS;  // selection rows of the KV head
    constexpr int G = SHARED ? HEADS : 1;   // query heads a selection row
    cg::cluster_group cluster = cg::this_cluster();
    const int CL = cluster.num_blocks();
    const int rank = cluster.block_rank();
    const int bh = blockIdx.x / CL;
    const int b = bh / a.Hkv;
    const int64_t n = a.length[0];
    const int first = rank * a.chunk;
    const int len = (int)max((int64_t)0, min((int64_t)a.chunk, n - first));
    const int table_size = a.M * a.CC;

    extern __shared__ __align__(16) unsigned char smem[];
    float* table = reinterpret_cast<float*>(smem);                        // HEADS · M · CC
    float* value = table + HEADS * table_size;                            // GS · chunk: the scores
    unsigned* hist = reinterpret_cast<unsigned*>(value + GS * a.chunk);   // GS · 256: this block's
    unsigned* total = hist + GS * 256;                                    // GS · 256: the cluster's
    __shared__ unsigned prefix[GS], rest[GS], digit[GS], wanted[GS];
    __shared__ unsigned above[GS], tied[GS], above_before[GS], tied_before[GS];
    __shared__ unsigned warp_above[GS][WARPS], warp_tied[GS][WARPS];

    const float* tables = a.tables + (size_t)bh * HEADS * table_size;
    for (int i = threadIdx.x; i < HEADS * table_size; i += THREADS) table[i] = tables[i];
    for (int i = threadIdx.x; i < GS * 256; i += THREADS) hist[i] = 0;
    if (threadIdx.x < GS) prefix[threadIdx.x] = digit[threadIdx.x] = 0;  // (the listing writes above and tied)
    __syncthreads();

    // 1. The scores and each row's first digit.
    const int64_t leaving = n - 1 - a.local;  // the row leaving the window: it joins a cluster in this step
    const int64_t lowest = a.start[b] + a.fixed - a.local;  // past the row's sink
    for (int i = threadIdx.x; i < len; i += THREADS) {
        const int64_t pos = first + i;
        const bool inside = pos >= lowest && pos <= leaving;
        float sums[HEADS];
#pragma unroll
        for (int j = 0; j < HEADS; ++j) sums[j] = 0.f;
        if (inside) {
            const uint8_t* code = a.codes + ((size_t)bh * a.cap + pos) * a.W;
            // Four code bytes, the first of them byte `first_byte` of the key's: sub-spaces in order.
            auto add = [&](unsigned word, int first_byte) {
#pragma unroll
                for (int byte = 0; byte < 4; ++byte) {
                    const unsigned c = (word >> (8 * byte)) & 0xFF;
                    if (a.packed) {
                        const float* entry = table + 2 * (first_byte + byte) * a.CC;
#pragma unroll
                        for (int j = 0; j < HEADS; ++j) {
                            sums[j] += entry[j * table_size + (c & 15)];
                            sums[j] += entry[j * table_size + a.CC + (c >> 4)];
                        }
                    } else {
                        const float* entry = table + (first_byte + byte) * a.CC;
#pragma unroll
                        for (int j = 0; j < HEADS; ++j) sums[j] += entry[j * table_size + c];
                    }
                }
            };
            if (a.W % 16 == 0) {
                for (int w = 0; w < a.W; w += 16) {
                    const uint4 v = __ldg(reinterpret_cast<const uint4*>(code + w));
                    add(v.x, w), add(v.y, w + 4), add(v.z, w + 8), add(v.w, w + 12);
                }
            } else {
                for (int w = 0; w < a.W; w += 4) add(__ldg(reinterpret_cast<const unsigned*>(code + w)), w);
            }
        }
#pragma unroll
        for (int s = 0; s < GS; ++s) {
            float best = sums[s * G];
#pragma unroll
            for (int j = 1; j < G; ++j) best = fmaxf(best, sums[s * G + j]);
            const float score = inside ? best * a.scale : -INFINITY;
            value[s * a.chunk + i] = score;
            if (inside) atomicAdd(&hist[s * 256 + (order_key(score) >> 24)], 1u);
        }
    }
    if (a.stop == 1) return;  // (no block has read another's memory yet)

    // 2. The cut: four digits, each from the cluster's histograms summed.
    const int row0 = bh * GS;  // the head's first selection row
    for (int pass = 0; pass < 4; ++pass) {
        cluster.sync();  // every block's histogram complete
        for (int i = threadIdx.x; i < GS * 256; i += THREADS) {
            unsigned sum = 0;
            for (int r = 0; r < CL; ++r) sum += cluster.map_shared_rank(hist, r)[i];
            total[i] = sum;
        }
        __syncthreads();
        if (pass == 0 && threadIdx.x < GS) {  // k: the budget's shortlist, at most L and the inside positions
            unsigned inside = 0;
            for (int d = 0; d < 256; ++d) inside += total[threadIdx.x * 256 + d];
            const int64_t valid = n - a.start[b];
            int64_t budget = a.tokens >= 0 ? (int64_t)a.tokens : (int64_t)floor((double)valid * a.density[0]);
            budget = max(budget - a.fixed, (int64_t)0);
            int64_t k = (int64_t)ceil(a.multiple[0] * (double)budget);
            k = min(min(k, (int64_t)a.L), (int64_t)inside);
            wanted[threadIdx.x] = rest[threadIdx.x] = (unsigned)k;
        }
        __syncthreads();
        pick_digits<GS>(total, digit, rest);
        __syncthreads();
        if (threadIdx.x < GS) prefix[threadIdx.x] = (prefix[threadIdx.x] << 8) | digit[threadIdx.x];
        cluster.sync();  // every block done reading the histograms
        if (pass == 3) break;
        for (int i = threadIdx.x; i < GS * 256; i += THREADS) hist[i] = 0;
        __syncthreads();
        const int shift = 24 - 8 * pass;  // the digits found so far are the key's bits from here up
        for (int i = threadIdx.x; i < len; i += THREADS) {
#pragma unroll
            for (int s = 0; s < GS; ++s) {
                const float score = value[s * a.chunk + i];
                const unsigned key = order_key(score);
                if (score > -INFINITY && (key >> shift) == prefix[s])
                    atomicAdd(&hist[s * 256 + ((key >> (shift - 8)) & 0xFF)], 1u);
            }
        }
    }
    // prefix[s] is τ, rest[s] the ties at τ the shortlist takes (where wanted[s] > 0).
    if (a.stop == 2) return;

    // 3. The listing, in position order. Each warp owns `span` consecutive positions of the block's (a whole number of
    // warps' widths): it counts its keys above τ and at τ by ballots; the warps' counts give the block's (which the
    // blocks after it read) and each warp's place after the warps and blocks before it; then each warp lists its span
    // 32 positions at a time, ranks from ballots, with no barrier of the block's between.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned lanes_below = (1u << lane) - 1u;
    const int span = a.chunk / WARPS, lo = warp * span, hi = min(lo + span, len);
    auto classify = [&](int i, int s, float& score, bool& over, bool& tie) {
        score = i < hi ? value[s * a.chunk + i] : -INFINITY;
        const bool ok = wanted[s] > 0 && score > -INFINITY;
        const unsigned key = order_key(score);
        over = ok && key > prefix[s];
        tie = ok && key == prefix[s];
    };
    {
        unsigned overs[GS] = {}, ties[GS] = {};
        for (int i = lo + lane; i - lane < hi; i += 32) {
#pragma unroll
            for (int s = 0; s < GS; ++s) {
                float score;
                bool over, tie;
                classify(i, s, score, over, tie);
                overs[s] += __popc(__ballot_sync(0xFFFFFFFFu, over));
                ties[s] += __popc(__ballot_sync(0xFFFFFFFFu, tie));
            }
        }
        if (lane == 0) {
#pragma unroll
            for (int s = 0; s < GS; ++s) warp_above[s][warp] = overs[s], warp_tied[s][warp] = ties[s];
        }
    }
    __syncthreads();
    if (threadIdx.x < GS) {
        const int s = threadIdx.x;
        unsigned sum_above = 0, sum_tied = 0;
        for (int w = 0; w < WARPS; ++w) sum_above += warp_above[s][w], sum_tied += warp_tied[s][w];
        above[s] = sum_above, tied[s] = sum_tied;
    }
    cluster.sync();  // every block's counts written
    if (threadIdx.x < GS) {
        const int s = threadIdx.x;
        unsigned a_before = 0, t_before = 0;
        for (int r = 0; r < rank; ++r) {
            a_before += cluster.map_shared_rank(above, r)[s];
            t_before += cluster.map_shared_rank(tied, r)[s];
        }
        above_before[s] = a_before, tied_before[s] = t_before;
        if (rank == 0) {
            a.counts[row0 + s] = (int)wanted[s];
            a.cut[row0 + s] = wanted[s] > 0 ? (int64_t)prefix[s] : (int64_t)4294967296LL;
            a.ties[row0 + s] = wanted[s] > 0 ? (int)rest[s] : 0;
        }
    }
    __syncthreads();
    // Each row's ties and entries before this warp's span: the blocks' before this one, then the warps' before it.
    unsigned ties_run[GS], end[GS];
#pragma unroll
    for (int s = 0; s < GS; ++s) {
        unsigned a_before = above_before[s], t_before = tied_before[s];
        for (int w = 0; w < warp; ++w) a_before += warp_above[s][w], t_before += warp_tied[s][w];
        ties_run[s] = t_before, end[s] = a_before + min(t_before, rest[s]);
    }
    for (int i = lo + lane; i - lane < hi; i += 32) {
        const int64_t pos = first + i;
#pragma unroll
        for (int s = 0; s < GS; ++s) {
            float score;
            bool over, tie;
            classify(i, s, score, over, tie);
            const unsigned tied_ballot = __ballot_sync(0xFFFFFFFFu, tie);
            const bool kept = over || (tie && ties_run[s] + __popc(tied_ballot & lanes_below) < rest[s]);
            ties_run[s] += __popc(tied_ballot);
            const unsigned kept_ballot = __ballot_sync(0xFFFFFFFFu, kept);
            const unsigned slot = end[s] + __popc(kept_ballot & lanes_below);
            if (kept) a.listed[(size_t)(row0 + s) * a.L + slot] = (int)pos;
            if (i < hi)  // the score, or the listed position's box
                a.scores[(size_t)(row0 + s) * a.cap + pos] = kept ? __uint_as_float((slot + 1) | 0x7F800000u) : score;
            end[s] += __popc(kept_ballot);
        }
    }
    cluster.sync();  // no block leaves while another may still read its shared memory
}

template <int HEADS, bool SHARED>
static cudaError_t launch(const Args& args, int blocks, int CL, size_t smem, cudaStream_t stream) {
    auto kernel = pq_shortlist<HEADS, SHARED>;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err == cudaSuccess && CL > 8)
        err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (err != cudaSuccess) return err;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(blocks);
    config.blockDim = dim3(THREADS);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeClusterDimension;
    attribute[0].val.clusterDim.x = CL;
    attribute[0].val.clusterDim.y = 1;
    attribute[0].val.clusterDim.z = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, args);
}

template <int HEADS>
static cudaError_t launch_heads(const Args& args, bool shared, int blocks, int CL, size_t smem, cudaStream_t stream) {
    return shared ? launch<HEADS, true>(args, blocks, CL, smem, stream)
                  : launch<HEADS, false>(args, blocks, CL, smem, stream);
}

extern "C" {

// The most shared memory a block of `device` may take (dynamic and static), in bytes.
int oa_shared_memory_limit(int device) {
    int bytes = 0;
    return cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess ? bytes : 0;
}

// The positions a block of a CL-block cluster owns: a whole number of tiles.
static int chunk_of(int cap, int CL) { return ((cap + CL - 1) / CL + THREADS - 1) / THREADS * THREADS; }

// The dynamic shared memory a block of a CL-block cluster needs over `cap` positions (the scores of its positions,
// the tables, histograms).
size_t oa_pq_shortlist_smem(int heads, int GS, int M, int CC, int cap, int CL) {
    return sizeof(float) * ((size_t)heads * M * CC + (size_t)GS * chunk_of(cap, CL)) +
           sizeof(unsigned) * 2 * GS * 256;
}

// GS selection rows of G query heads each (GS = 1 or G = 1); stop: 0 (see the top). Returns a cudaError_t (0:
// launched).
int oa_pq_shortlist(const float* tables, const uint8_t* codes, const int64_t* length, const int64_t* start,
                    const double* density, const double* multiple, float* scores, int* listed, int* counts,
                    int64_t* cut, int* ties, int B, int Hkv, int GS, int G, int M, int CC, int W, int packed,
                    int local, int cap, int fixed, int tokens, int L, float scale, int CL, int stop, void* stream) {
    const int heads = GS * G;
    if ((GS != 1 && G != 1) || heads < 1 || heads > MAX_HEADS || W % 4 != 0 || CL < 1 || CL > 16)
        return (int)cudaErrorInvalidValue;
    const int chunk = chunk_of(cap, CL);
    Args args = {tables, codes, length, start, density, multiple, scores, listed, counts, cut, ties,
                 Hkv, M, CC, W, packed, local, cap, fixed, tokens, L, chunk, stop, scale};
    const size_t smem = oa_pq_shortlist_smem(heads, GS, M, CC, cap, CL);
    const int blocks = B * Hkv * CL;
    const bool shared = GS == 1 && G > 1;
    cudaStream_t s = (cudaStream_t)stream;
    switch (heads) {
        case 1: return (int)launch_heads<1>(args, shared, blocks, CL, smem, s);
        case 2: return (int)launch_heads<2>(args, shared, blocks, CL, smem, s);
        case 3: return (int)launch_heads<3>(args, shared, blocks, CL, smem, s);
        case 4: return (int)launch_heads<4>(args, shared, blocks, CL, smem, s);
        case 5: return (int)launch_heads<5>(args, shared, blocks, CL, smem, s);
        case 6: return (int)launch_heads<6>(args, shared, blocks, CL, smem, s);
        case 7: return (int)launch_heads<7>(args, shared, blocks, CL, smem, s);
        default: return (int)launch_heads<8>(args, shared, blocks, CL, smem, s);
    }
}

}  // extern "C"
