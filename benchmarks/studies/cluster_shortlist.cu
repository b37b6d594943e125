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
//   cluster_shortlist with a selection: then, in the same launch, each head's q_b best positions of every cluster b
//                      (the per-cluster selection) from the same on-chip keys, by a radix select over eight 4-bit
//                      digits for all (head, cluster) pairs at once, written cluster by cluster.
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
constexpr int C = 64;        // clusters (QGC's default)
constexpr int PAIRS = G * C;  // (head, cluster) pairs of a selection: one thread each
static_assert(PAIRS == THREADS, "the selection gives each (head, cluster) pair a thread");
enum Mode : unsigned { PICK = 0, ALL = 1, NONE = 2 };

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

// f(i, q, key) for each of this block's keys i that lies in a cluster, for every head: q the (head, cluster) pair.
template <class F>
__device__ __forceinline__ void each_member(int len, int chunk, const uint8_t* member_of, const unsigned* keys, F f) {
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        const int b = member_of[i];
        if (b < C) {
#pragma unroll
            for (int g = 0; g < G; ++g) f(i, g * C + b, keys[g * chunk + i]);
        }
    }
}

// The per-cluster selection from the block's on-chip keys: for every (head g, cluster b) pair, the q_b best keys of
// the cluster's members (quotas [BH, G, C], each at most the cluster's size), by a radix select over eight 4-bit
// digits whose histograms [pair][16] the cluster's blocks sum through distributed shared memory; the positions go to
// selected [BH, G, width], cluster b's run at Σ_{b' < b} q_b' (ties at a pair's cut: the first blocks' first).
__device__ void select_per_cluster(cg::cluster_group& cluster, int CL, int rank, int bh, int chunk, int start, int len,
                                   int N, const unsigned* keys, uint8_t* member_of, unsigned* work,
                                   const uint8_t* __restrict__ assignment, const int* __restrict__ quotas, int width,
                                   int* __restrict__ selected) {
    unsigned* hist = work;                   // PAIRS·16: this block's
    unsigned* total = hist + PAIRS * 16;     // PAIRS·16: the cluster's
    unsigned* cut = total + PAIRS * 16;      // per pair: the cut's digits so far, then the cut
    unsigned* rest = cut + PAIRS;            // the keys still wanted at the cut's digits
    unsigned* mode = rest + PAIRS;           // PICK, ALL (q_b ≥ the cluster's size) or NONE (q_b = 0)
    unsigned* above = mode + PAIRS;          // this block's keys above the cut, and at it
    unsigned* tied = above + PAIRS;
    unsigned* written = tied + PAIRS;
    unsigned* taken = written + PAIRS;
    unsigned* base_above = taken + PAIRS;    // the earlier blocks' keys above the cut, and at it
    unsigned* base_tied = base_above + PAIRS;
    unsigned* all_above = base_tied + PAIRS;  // every block's keys above the cut
    unsigned* offset = all_above + PAIRS;     // the pair's run in its head's row
    const int p = threadIdx.x, pg = p / C, pc = p % C;
    for (int i = threadIdx.x; i < len; i += blockDim.x) member_of[i] = assignment[(size_t)bh * N + start + i];
    for (int i = threadIdx.x; i < PAIRS * 16; i += blockDim.x) hist[i] = 0;
    rest[p] = quotas[((size_t)bh * G + pg) * C + pc];
    cut[p] = above[p] = tied[p] = written[p] = taken[p] = 0;
    mode[p] = PICK;
    unsigned run = 0;
    for (int b = 0; b < pc; ++b) run += quotas[((size_t)bh * G + pg) * C + b];
    offset[p] = run;
    __syncthreads();
    each_member(len, chunk, member_of, keys,
                [&](int, int q, unsigned key) { atomicAdd(&hist[q * 16 + (key >> 28)], 1u); });
    // Block r owns pairs [r·PAIRS/CL, (r + 1)·PAIRS/CL): it sums their histograms over the cluster, picks their digits
    // and writes them into every block's shared memory (each block reads PAIRS·16 counters a pass, not CL times that).
    const int owned = PAIRS / CL;
    for (int pass = 0; pass < 8; ++pass) {
        cluster.sync();
        for (int i = threadIdx.x; i < owned * 16; i += blockDim.x) {
            const int j = rank * owned * 16 + i;
            unsigned sum = 0;
            for (int r = 0; r < CL; ++r) sum += cluster.map_shared_rank(hist, r)[j];
            total[j] = sum;
        }
        __syncthreads();
        if (p < owned) {
            const int q = rank * owned + p;
            unsigned m = mode[q], digits = cut[q], wanted = rest[q];
            if (pass == 0) {
                unsigned members = 0;
                for (int d = 0; d < 16; ++d) members += total[q * 16 + d];
                m = wanted == 0 ? NONE : (wanted >= members ? ALL : PICK);
            }
            if (m == PICK) {
                unsigned seen = 0;
                for (int d = 15; d >= 0; --d) {
                    if (seen + total[q * 16 + d] >= wanted) {
                        digits = (digits << 4) | d;
                        wanted -= seen;
                        break;
                    }
                    seen += total[q * 16 + d];
                }
            }
            for (int r = 0; r < CL; ++r) {
                cluster.map_shared_rank(mode, r)[q] = m;
                cluster.map_shared_rank(cut, r)[q] = digits;
                cluster.map_shared_rank(rest, r)[q] = wanted;
            }
        }
        cluster.sync();  // every block done reading the histograms; every pair's digit written everywhere
        if (pass == 7) break;
        for (int i = threadIdx.x; i < PAIRS * 16; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const int shift = 28 - 4 * pass;
        each_member(len, chunk, member_of, keys, [&](int, int q, unsigned key) {
            if (mode[q] == PICK && (key >> shift) == cut[q]) atomicAdd(&hist[q * 16 + ((key >> (shift - 4)) & 15)], 1u);
        });
    }
    // ALL: every key is at or above 0, and the ties at 0 fit; NONE: nothing is above the largest key, no tie is taken.
    if (mode[p] == ALL) cut[p] = 0;
    if (mode[p] == NONE) cut[p] = 0xFFFFFFFFu, rest[p] = 0;
    __syncthreads();
    each_member(len, chunk, member_of, keys, [&](int, int q, unsigned key) {
        if (key > cut[q]) atomicAdd(&above[q], 1u);
        else if (key == cut[q]) atomicAdd(&tied[q], 1u);
    });
    cluster.sync();
    {
        unsigned a = 0, t = 0, every = 0;
        for (int r = 0; r < CL; ++r) {
            unsigned ra = cluster.map_shared_rank(above, r)[p];
            if (r < rank) a += ra, t += cluster.map_shared_rank(tied, r)[p];
            every += ra;
        }
        base_above[p] = a;
        base_tied[p] = t;
        all_above[p] = every;
    }
    __syncthreads();
    each_member(len, chunk, member_of, keys, [&](int i, int q, unsigned key) {
        int* out = selected + ((size_t)bh * G + q / C) * width + offset[q];
        if (key > cut[q]) {
            out[base_above[q] + atomicAdd(&written[q], 1u)] = start + i;
        } else if (key == cut[q]) {
            unsigned t = base_tied[q] + atomicAdd(&taken[q], 1u);
            if (t < rest[q]) out[all_above[q] + t] = start + i;
        }
    });
}

// The q largest of n keys read through `at(j)` (j < n), 0 < q < n: the cut τ (count(key ≥ τ) ≥ q > count(key > τ))
// by bisection over the 32-bit keys, and how many keys lie above it.
template <class At>
__device__ unsigned bisect_cut(At at, int n, unsigned q, unsigned* above_cut) {
    unsigned lo = 0xFFFFFFFFu, hi = 0;
    for (int j = 0; j < n; ++j) lo = min(lo, at(j)), hi = max(hi, at(j));
    unsigned long long top = (unsigned long long)hi + 1, bottom = lo;  // count(≥ bottom) ≥ q > count(≥ top)
    while (top - bottom > 1) {
        unsigned long long mid = bottom + (top - bottom) / 2;
        unsigned count = 0;
        for (int j = 0; j < n; ++j) count += at(j) >= mid;
        if (count >= q) bottom = mid; else top = mid;
    }
    unsigned above = 0;
    for (int j = 0; j < n; ++j) above += at(j) > bottom;
    *above_cut = above;
    return (unsigned)bottom;
}

// The per-cluster selection from candidates, in three cluster barriers: each block lists its members by cluster; a
// (head, cluster) pair whose quota covers its cluster is written whole by every block; otherwise each block sends the
// pair's min(q_b, its members) best keys with their positions to the pair's owner block (p mod CL), through
// distributed shared memory, and the owner takes the q_b best of what it received.
__device__ void select_from_candidates(cg::cluster_group& cluster, int CL, int rank, int bh, int chunk, int start,
                                       int len, int N, const unsigned* keys, uint8_t* member_of, unsigned* work,
                                       int capacity, const uint8_t* __restrict__ assignment,
                                       const int* __restrict__ quotas, int width, int* __restrict__ selected) {
    unsigned* count = work;                  // C: this block's members of each cluster
    unsigned* first = count + C;             // C: where they start in `order`
    unsigned* fill = first + C;              // C
    unsigned* size = fill + C;               // C: the cluster's members in every block
    unsigned* before = size + C;             // C: in the earlier blocks
    unsigned* offset = before + C;           // PAIRS: the pair's run in its head's row
    unsigned* slot = offset + PAIRS;         // PAIRS: the owned pair's first candidate
    unsigned* received = slot + PAIRS;       // PAIRS: the candidates the owned pair has received
    unsigned* cand_key = received + PAIRS;   // capacity
    unsigned* cand_pos = cand_key + capacity;  // capacity
    uint16_t* order = reinterpret_cast<uint16_t*>(cand_pos + capacity);  // chunk: members by cluster, in order
    const int p = threadIdx.x, pg = p / C, pc = p % C;
    const int* row_quotas = quotas + ((size_t)bh * G + pg) * C;
    for (int i = threadIdx.x; i < len; i += blockDim.x) member_of[i] = assignment[(size_t)bh * N + start + i];
    if (p < C) count[p] = fill[p] = 0;
    received[p] = 0;
    unsigned run = 0;
    for (int b = 0; b < pc; ++b) run += row_quotas[b];
    offset[p] = run;
    __syncthreads();
    for (int i = threadIdx.x; i < len; i += blockDim.x)
        if (member_of[i] < C) atomicAdd(&count[member_of[i]], 1u);
    __syncthreads();
    if (p == 0) {
        unsigned at = 0;
        for (int b = 0; b < C; ++b) first[b] = at, at += count[b];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < len; i += blockDim.x) {  // (in no set order within a cluster: ties are not ordered)
        int b = member_of[i];
        if (b < C) order[first[b] + atomicAdd(&fill[b], 1u)] = (uint16_t)i;
    }
    cluster.sync();  // every block's counts written
    if (p < C) {
        unsigned all = 0, earlier = 0;
        for (int r = 0; r < CL; ++r) {
            unsigned n = cluster.map_shared_rank(count, r)[p];
            all += n;
            if (r < rank) earlier += n;
        }
        size[p] = all;
        before[p] = earlier;
    }
    __syncthreads();
    {  // pair p's room in its owner's candidates: CL · q for each pair the owner selects among, in pair order
        unsigned room = 0;
        for (int q = p % CL; q < p; q += CL) {
            const unsigned quota = quotas[((size_t)bh * G + q / C) * C + q % C];
            if (quota > 0 && quota < size[q % C]) room += CL * quota;
        }
        slot[p] = room;
    }
    {
        const unsigned q = row_quotas[pc], n = count[pc];
        const unsigned* mine = keys + pg * chunk;
        const uint16_t* members = order + first[pc];
        int* out = selected + ((size_t)bh * G + pg) * width + offset[p];
        if (q >= size[pc]) {  // the whole cluster
            for (unsigned j = 0; j < n; ++j) out[before[pc] + j] = start + members[j];
        } else if (q > 0 && n > 0) {  // this block's min(q, n) best, to the owner
            const unsigned want = min(q, n);
            unsigned* to_key = cluster.map_shared_rank(cand_key, p % CL);
            unsigned* to_pos = cluster.map_shared_rank(cand_pos, p % CL);
            unsigned at = slot[p] + atomicAdd(cluster.map_shared_rank(received, p % CL) + p, want);
            if (want == n) {
                for (unsigned j = 0; j < n; ++j) to_key[at + j] = mine[members[j]], to_pos[at + j] = start + members[j];
            } else {
                unsigned above;
                const unsigned cut = bisect_cut([&](int j) { return mine[members[j]]; }, n, want, &above);
                unsigned ties = want - above;
                for (unsigned j = 0; j < n; ++j) {
                    const unsigned key = mine[members[j]];
                    if (key > cut || (key == cut && ties > 0)) {
                        if (key == cut) --ties;
                        to_key[at] = key, to_pos[at] = start + members[j], ++at;
                    }
                }
            }
        }
    }
    cluster.sync();  // every candidate received
    if (p % CL == rank) {
        const unsigned q = row_quotas[pc], n = received[p];
        if (q > 0 && q < size[pc]) {
            const unsigned* ck = cand_key + slot[p];
            const unsigned* cp = cand_pos + slot[p];
            int* out = selected + ((size_t)bh * G + pg) * width + offset[p];
            unsigned above = n, cut = 0;  // n = q: every candidate (each at or above 0)
            if (n > q) cut = bisect_cut([&](int j) { return ck[j]; }, n, q, &above);
            unsigned ties = q - above, at = 0;
            for (unsigned j = 0; j < n; ++j) {
                if (ck[j] > cut || (ck[j] == cut && ties > 0)) {
                    if (ck[j] == cut) --ties;
                    out[at++] = cp[j];
                }
            }
        }
    }
}

// The per-cluster selection at owner blocks, in three cluster barriers: every key of a (head, cluster) pair is sent,
// with its position, to the pair's owner block (p mod CL) through distributed shared memory, into the pair's own
// segment there; then each owner takes the q_b best keys of each pair it owns by a radix select over four 8-bit
// digits in its own shared memory (a histogram of 256 bins per owned pair, each digit picked by a warp), with no
// barrier but its own block's.
__device__ void select_at_owners(cg::cluster_group& cluster, int CL, int rank, int bh, int chunk, int start, int len,
                                 int N, const unsigned* keys, uint8_t* member_of, unsigned* work, int capacity,
                                 const uint8_t* __restrict__ assignment, const int* __restrict__ quotas, int width,
                                 int* __restrict__ selected) {
    const int owned = PAIRS / CL;
    unsigned* count = work;                  // C: this block's members of each cluster
    unsigned* size = count + C;              // C: the cluster's members in every block
    unsigned* before = size + C;             // C: in the earlier blocks
    unsigned* segment = before + C;          // PAIRS: the pair's first entry at its owner
    unsigned* offset = segment + PAIRS;      // PAIRS: the pair's run in its head's row
    unsigned* cut = offset + PAIRS;          // per owned pair (owned): the cut's digits so far, then the cut
    unsigned* rest = cut + owned;            // the keys still wanted at the cut's digits
    unsigned* mode = rest + owned;           // PICK, ALL or NONE
    unsigned* written = mode + owned;        // the keys above the cut written, and the ties taken
    unsigned* taken = written + owned;
    unsigned* hist = taken + owned;          // owned · 256
    unsigned* entry_key = hist + owned * 256;        // capacity: the owned pairs' keys, pair by pair
    unsigned* entry_pos = entry_key + capacity;      // and their positions
    uint16_t* local_rank = reinterpret_cast<uint16_t*>(entry_pos + capacity);  // chunk: among the block's members
    uint8_t* entry_pair = reinterpret_cast<uint8_t*>(local_rank + chunk);      // capacity: the owned pair's index
    const int p = threadIdx.x, pg = p / C, pc = p % C;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    for (int i = threadIdx.x; i < len; i += blockDim.x) member_of[i] = assignment[(size_t)bh * N + start + i];
    if (p < C) count[p] = 0;
    unsigned run = 0;
    for (int b = 0; b < pc; ++b) run += quotas[((size_t)bh * G + pg) * C + b];
    offset[p] = run;
    __syncthreads();
    for (int i = threadIdx.x; i < len; i += blockDim.x)
        if (member_of[i] < C) local_rank[i] = (uint16_t)atomicAdd(&count[member_of[i]], 1u);
    cluster.sync();  // every block's counts written
    if (p < C) {
        unsigned all = 0, earlier = 0;
        for (int r = 0; r < CL; ++r) {
            const unsigned n = cluster.map_shared_rank(count, r)[p];
            all += n;
            if (r < rank) earlier += n;
        }
        size[p] = all;
        before[p] = earlier;
    }
    __syncthreads();
    {  // pair p's segment at its owner: after the owner's earlier pairs' members
        unsigned at = 0;
        for (int q = p % CL; q < p; q += CL) at += size[q % C];
        segment[p] = at;
    }
    __syncthreads();
    each_member(len, chunk, member_of, keys, [&](int i, int q, unsigned key) {
        const int owner = q % CL;
        const unsigned at = segment[q] + before[q % C] + local_rank[i];
        if (at >= (unsigned)capacity) return;  // room too small (the host's bound is wrong): the check fails, no fault
        cluster.map_shared_rank(entry_key, owner)[at] = key;
        cluster.map_shared_rank(entry_pos, owner)[at] = start + i;
        cluster.map_shared_rank(entry_pair, owner)[at] = (uint8_t)(q / CL);
    });
    cluster.sync();  // every entry received
    const int last = (owned - 1) * CL + rank;
    const unsigned entries = min(segment[last] + size[last % C], (unsigned)capacity);
    if (p < owned) {
        const int q = p * CL + rank;
        const unsigned quota = quotas[((size_t)bh * G + q / C) * C + q % C], n = size[q % C];
        mode[p] = quota == 0 ? NONE : (quota >= n ? ALL : PICK);
        cut[p] = mode[p] == NONE ? 0xFFFFFFFFu : 0;  // ALL: every key is above 0
        rest[p] = mode[p] == NONE ? 0 : quota;
        written[p] = taken[p] = 0;
    }
    for (int pass = 0; pass < 4; ++pass) {
        for (int i = threadIdx.x; i < owned * 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const int shift = 24 - 8 * pass;  // the digit's lowest bit; the digits found so far lie above shift + 8
        for (unsigned j = threadIdx.x; j < entries; j += blockDim.x) {
            const int t = entry_pair[j];
            const unsigned key = entry_key[j];
            if (mode[t] == PICK && (pass == 0 || (key >> (shift + 8)) == cut[t]))
                atomicAdd(&hist[t * 256 + ((key >> shift) & 0xFF)], 1u);
        }
        __syncthreads();
        for (int t = warp; t < owned; t += warps) {  // a warp a pair: the digit whose bins and above hold `rest`
            if (mode[t] != PICK) continue;
            unsigned c[8], mine = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) mine += (c[j] = hist[t * 256 + lane * 8 + j]);
            unsigned suffix = mine;
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned v = __shfl_down_sync(0xFFFFFFFFu, suffix, o);
                if (lane + o < 32) suffix += v;
            }
            const unsigned want = rest[t];
            __syncwarp();
            if (suffix - mine < want && suffix >= want) {
                unsigned above = suffix - mine;
                for (int j = 7; j >= 0; --j) {
                    if (above + c[j] >= want) {
                        cut[t] = (cut[t] << 8) | (lane * 8 + j);
                        rest[t] = want - above;
                        break;
                    }
                    above += c[j];
                }
            }
        }
        __syncthreads();
    }
    for (unsigned j = threadIdx.x; j < entries; j += blockDim.x) {
        const int t = entry_pair[j], q = t * CL + rank;
        const unsigned key = entry_key[j];
        int* out = selected + ((size_t)bh * G + q / C) * width + offset[q];
        const unsigned quota = quotas[((size_t)bh * G + q / C) * C + q % C];
        if (key > cut[t]) {
            out[atomicAdd(&written[t], 1u)] = entry_pos[j];
        } else if (key == cut[t]) {
            const unsigned tie = atomicAdd(&taken[t], 1u);
            if (tie < rest[t]) out[quota - rest[t] + tie] = entry_pos[j];
        }
    }
}

__global__ void cluster_shortlist(const float* __restrict__ tables, const uint8_t* __restrict__ codes, int N, int k,
                                  int* __restrict__ listed, unsigned* __restrict__ cuts,
                                  const uint8_t* __restrict__ assignment, const int* __restrict__ quotas, int width,
                                  int* __restrict__ selected, int method, int capacity) {
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
    if (selected != nullptr) {  // (the same branch in every block of the cluster)
        uint8_t* member_of = reinterpret_cast<uint8_t*>(keys + G * chunk);
        unsigned* work = reinterpret_cast<unsigned*>(member_of + ((chunk + 3) / 4) * 4);
        if (method == 1)
            select_per_cluster(cluster, CL, rank, bh, chunk, start, len, N, keys, member_of, work, assignment, quotas,
                               width, selected);
        else if (method == 2)
            select_from_candidates(cluster, CL, rank, bh, chunk, start, len, N, keys, member_of, work, capacity,
                                   assignment, quotas, width, selected);
        else
            select_at_owners(cluster, CL, rank, bh, chunk, start, len, N, keys, member_of, work, capacity, assignment,
                             quotas, width, selected);
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

// method 0: the shortlist alone; 1: and the selection by radix passes; 2: and the selection from candidates, with room
// for `capacity` of them in each block; 3: and the selection at owner blocks, with room for `capacity` entries each.
size_t cluster_shortlist_smem(int N, int CL, int method, int capacity) {
    int chunk = (N + CL - 1) / CL;
    size_t bytes = sizeof(float) * G * M * CC + sizeof(unsigned) * (2 * G * 256 + 8 * G + (size_t)G * chunk);
    if (method) bytes += ((chunk + 3) / 4) * 4;
    if (method == 1) bytes += sizeof(unsigned) * (2 * PAIRS * 16 + 11 * PAIRS);
    if (method == 2) bytes += sizeof(unsigned) * (6 * C + 3 * PAIRS + 2 * (size_t)capacity) + sizeof(uint16_t) * chunk;
    if (method == 3) {
        const size_t owned = PAIRS / CL;
        bytes += sizeof(unsigned) * (3 * C + 2 * PAIRS + 5 * owned + 256 * owned + 2 * (size_t)capacity);
        bytes += sizeof(uint16_t) * chunk + capacity;
    }
    return bytes;
}

// selected == nullptr (method 0): the shortlist alone (assignment, quotas, width and capacity unread).
int launch_cluster_shortlist(const void* tables, const void* codes, int BH, int N, int k, int CL, void* listed,
                             void* cuts, const void* assignment, const void* quotas, int width, void* selected,
                             int method, int capacity, void* stream) {
    if ((method == 0) != (selected == nullptr)) return (int)cudaErrorInvalidValue;
    size_t smem = cluster_shortlist_smem(N, CL, method, capacity);
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
                             (int*)listed, (unsigned*)cuts, (const uint8_t*)assignment, (const int*)quotas, width,
                             (int*)selected, method, capacity);
    return (int)err;
}

}  // extern "C"
