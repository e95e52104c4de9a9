// Decode GEMV family: y_i = x @ W_i^T for up to four ORIGINAL weight matrices sharing one input, every
// weight element read exactly once for all rows of x (up to 64 per launch). Up to 4 rows run on CUDA
// cores (below); 5-64 rows run on tensor cores:
//
// A block of 4 warps owns a group of 64 output columns (16 per warp: 16 rows of one weight, or of the gate
// AND up weights for the SiLU-gated front) and one of S slices of K. Per 32-wide k block a lane streams 16
// bytes of weight row g and g+8 (g = lane / 4) and reads 16 bytes of x row g of each group of 8 batch rows
// (the 4 warps read the same x slice, so it comes from L1), and issues two mma.m16n8k16 per batch group. The
// 8 consecutive k of a lane map to fragment slots {2t, 2t+1, 2t+8, 2t+9} of two k-steps; A and B use the
// same permutation, so the dot products are unchanged. The S blocks of a group form a thread-block cluster
// and sum their partial tiles through distributed shared memory in split order (deterministic); S grows
// until the grid fills the GPU several times over, so a small N no longer leaves SMs idle. A warp holds two
// stages of weight fragments in registers: the next stage's loads are in flight while this one's mma run
// (measured at 0c76328: 0.8B decode +15 % at 8 rows, +9 % at 16). The GDN input projection runs one stage at
// 9-16 rows, where that measured faster (launch_mma); SEGKI_GEMV_PIPE=0 runs one stage everywhere, same bits.
#include "bulk.cuh"
#include "common.cuh"

#include <cooperative_groups.h>

#include <algorithm>

namespace segki {
namespace {

namespace cg = cooperative_groups;

constexpr int kTileWarps = 4;  // 16-column tiles per block
constexpr int kUnroll = 4;     // k blocks (32 wide) whose weight loads are issued together
constexpr int kMaxSplits = 8;  // K slices per group = cluster size (the portable maximum)
constexpr int kMaxW = 4;

enum class Epilogue { Plain, SiluMul };

template <typename T>
struct GemvArgs {
  const T* x;            // [M, K]
  int m, k;
  int nw;
  const T* w[kMaxW];     // [N_i, K]
  const T* bias[kMaxW];  // [N_i] or nullptr
  T* out[kMaxW];         // [M, N_i]
  int n[kMaxW];
  int tile_start[kMaxW + 1];  // cumulative 16-row tile offsets
  int prefetch_cols;          // per weight row, columns warmed into L2 before the PDL wait (-1: all)
  int prefetch_blocks;        // blocks (in launch order) that warm L2: the first wave (first_wave_blocks). A
                              // later block starts after one of this kernel has passed the wait, so its warm-up
                              // would only ask twice for the lines its loads want next (`small_splits/`: the
                              // 0.8B lm_head 160.7 -> 145.7 us at one row, 195.3 -> 152.5 at 16; the 4B o_proj
                              // 9.27 -> 8.48 us at one row)
  const T* residual;          // [M, N_0], added to the rounded output (one plain weight only), or nullptr
  // Gated-DeltaNet conv in the epilogue of weight 0 (gdn_in_proj_conv), or conv_state == nullptr: each output
  // channel is owned by one thread, which shifts its conv state and stores SiLU(conv) instead of the value.
  T* conv_state;              // [M, N_0, conv_width]
  const T* conv_w;            // [N_0, conv_width]
  const T* conv_b;            // [N_0] or nullptr
  int conv_width;
  // RMSNorm prologue (copy-engine path only), or norm_w == nullptr: x is normalized on its way into shared
  // memory, so the norm before the projection needs no launch of its own.
  const T* norm_w;            // [K]
  float norm_eps;
  bool norm_unit_offset;
};

// Before the PDL wait each block of the first wave warms the first kPrefetchBytes of each of its weight rows'
// K slice into L2 (measured on the H200, 4B shape, b=1: 2 KB gives 77-88 % of copy bandwidth on the input
// projections against 66-70 % for the whole slice and 74-86 % for none; decode 288 -> 315 tok/s, 0.8B unchanged).
// SEGKI_GEMV_PREFETCH=<bytes> sets another amount (0: none, -1: the whole slice), for measurements.
constexpr long kPrefetchBytes = 2048;

inline int prefetch_cols(size_t elem_size) {
  static const long bytes = env_long("SEGKI_GEMV_PREFETCH", kPrefetchBytes, -1, LONG_MAX);
  return bytes < 0 ? -1 : (int)(bytes / (long)elem_size);
}

__device__ __forceinline__ int prefetch_end(int c0, int c1, int cols) { return cols < 0 ? c1 : min(c1, c0 + cols); }

// The weight fragments of one pipeline stage: U consecutive 32-wide k blocks of each of the NACC weights (the
// SiLU-gated front streams gate and up together); lane (g, t) holds 16 bytes of tile rows g (lo) and g + 8 (hi).
template <int NACC, int U>
struct Stage {
  uint4 lo[NACC][U], hi[NACC][U];
};

// Issues the stage's weight loads for k blocks kb..kb+U-1 (nothing past kend).
template <typename T, int NACC, int U>
__device__ __forceinline__ void load_stage(Stage<NACC, U>& s, const T* const (&w)[NACC], int k, bool lo_ok,
                                           bool hi_ok, int kb, int kend) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int c = 0; c < NACC; ++c)
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kk = (kb + u) * 32 + t * 8;
      const bool in = kk < kend;
      s.lo[c][u] = in && lo_ok ? ld_stream(w[c] + (size_t)g * k + kk) : make_uint4(0, 0, 0, 0);
      s.hi[c][u] = in && hi_ok ? ld_stream(w[c] + (size_t)(g + 8) * k + kk) : make_uint4(0, 0, 0, 0);
    }
}

// acc[c][j] += the stage's k blocks of weight c times x row g of each group j of 8 batch rows: the lane's 8
// consecutive k map to fragment slots {2t, 2t+1, 2t+8, 2t+9} of two mma k-steps (A and B permuted alike).
template <typename T, int NB, int NACC, int U>
__device__ __forceinline__ void mma_stage(const Stage<NACC, U>& s, const T* __restrict__ x, int m, int k, int kb,
                                          int kend, float acc[NACC][NB][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int kk = (kb + u) * 32 + t * 8;
    uint4 xv[NB];  // x is read once per k block for every weight (L1 hits: the block's 4 warps share it)
#pragma unroll
    for (int j = 0; j < NB; ++j)
      xv[j] = kk < kend && j * 8 + g < m ? ld_cached(x + (size_t)(j * 8 + g) * k + kk) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int c = 0; c < NACC; ++c)
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        mma16816<T>(acc[c][j], s.lo[c][u].x, s.hi[c][u].x, s.lo[c][u].y, s.hi[c][u].y, xv[j].x, xv[j].y);
        mma16816<T>(acc[c][j], s.lo[c][u].z, s.hi[c][u].z, s.lo[c][u].w, s.hi[c][u].w, xv[j].z, xv[j].w);
      }
  }
}

// acc[c][NB][4]: C fragments of weight c (rows g, g+8 of the tile x batch columns 2t, 2t+1 of group j) over k
// blocks [kb0, kb1), summed in k order. PIPE: two stages in registers, the next stage's loads in flight while
// this one's mma run, so a warp never waits on a drained pipe between stages; else one stage at a time (the GDN
// input projection at 9-16 rows, see launch_mma; everything under SEGKI_GEMV_PIPE=0). The same sums in the same
// order either way. The next stage's loads sit behind a (warp-uniform) branch of their own: without it ptxas
// interleaved them with this stage's mma in the plain kernels (from 5 rows up), after the first mma had waited
// for this stage's data (the SASS order). Putting them first did not make the GDN input projection win with
// two stages at 16 rows (`gemv_pipe/at_c2dba80.md`).
template <typename T, int NB, int NACC, bool PIPE>
__device__ __forceinline__ void tile_dot(const T* const (&w)[NACC], int rows_left, const T* __restrict__ x, int m,
                                         int k, int kb0, int kb1, float acc[NACC][NB][4]) {
  constexpr int U = kUnroll / NACC;  // k blocks per weight and stage: 2 x kUnroll x 16 bytes per lane
  const int g = (threadIdx.x & 31) >> 2;
  const bool lo_ok = g < rows_left, hi_ok = g + 8 < rows_left;
  const int kend = min(kb1 * 32, k);
  Stage<NACC, U> s0, s1;
  if constexpr (!PIPE) {
    for (int kb = kb0; kb < kb1; kb += U) {
      load_stage<T, NACC, U>(s0, w, k, lo_ok, hi_ok, kb, kend);
      mma_stage<T, NB, NACC, U>(s0, x, m, k, kb, kend, acc);
    }
    return;
  }
  load_stage<T, NACC, U>(s0, w, k, lo_ok, hi_ok, kb0, kend);
  for (int kb = kb0; kb < kb1; kb += 2 * U) {  // a stage is loaded only if it will be used
    if (kb + U < kb1) load_stage<T, NACC, U>(s1, w, k, lo_ok, hi_ok, kb + U, kend);
    mma_stage<T, NB, NACC, U>(s0, x, m, k, kb, kend, acc);
    if (kb + U >= kb1) break;
    if (kb + 2 * U < kb1) load_stage<T, NACC, U>(s0, w, k, lo_ok, hi_ok, kb + 2 * U, kend);
    mma_stage<T, NB, NACC, U>(s1, x, m, k, kb + U, kend, acc);
  }
}

// Which weight a 16-row tile of the concatenated outputs belongs to.
template <typename T, Epilogue EPI>
__device__ __forceinline__ int weight_of_tile(const GemvArgs<T>& a, int tile) {
  int wi = 0;
  if constexpr (EPI == Epilogue::Plain) {
#pragma unroll
    for (int j = 1; j < kMaxW; ++j) wi += (j < a.nw && tile >= a.tile_start[j]) ? 1 : 0;
  }
  return wi;
}

// One output element from its accumulated value(s): SiLU(gate) * up, or + bias, then + residual with the
// roundings of the unfused model (the projection rounded to T, then the sum), or weight 0's conv token.
template <typename T, Epilogue EPI>
__device__ __forceinline__ void store_out(const GemvArgs<T>& a, int wi, int row, int col, float v, float up) {
  if (row >= a.n[wi] || col >= a.m) return;
  const size_t o = (size_t)col * a.n[wi] + row;
  if constexpr (EPI == Epilogue::SiluMul) {
    v = silu(v) * up;
  } else {
    if (a.bias[wi]) v += to_float<T>(a.bias[wi][row]);
    if (a.residual) {
      v = round_to<T>(v) + to_float<T>(a.residual[o]);
    }
    if (wi == 0 && a.conv_state)
      v = conv_token<T>(a.conv_state + o * a.conv_width, a.conv_w, a.conv_b, row, round_to<T>(v), a.conv_width);
  }
  a.out[wi][o] = from_float<T>(v);
}

// What store_out will read for output (row, col) of weight wi -- bias, residual, weight 0's conv state, weights
// and bias -- pulled into L1 ahead of the dot product, so the epilogue after the reduction's barrier hits L1
// instead of paying a round trip to memory at the end of the kernel. Only the addresses, no registers held.
template <typename T>
__device__ __forceinline__ void prefetch_epilogue(const GemvArgs<T>& a, int wi, int row, int col) {
  const size_t o = (size_t)col * a.n[wi] + row;
  if (a.bias[wi]) asm volatile("prefetch.global.L1 [%0];" ::"l"(a.bias[wi] + row));
  if (a.residual) asm volatile("prefetch.global.L1 [%0];" ::"l"(a.residual + o));
  if (wi == 0 && a.conv_state) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(a.conv_state + o * a.conv_width));
    asm volatile("prefetch.global.L1 [%0];" ::"l"(a.conv_w + (size_t)row * a.conv_width));
    if (a.conv_b) asm volatile("prefetch.global.L1 [%0];" ::"l"(a.conv_b + row));
  }
}

// Fragment element f of a warp: (C slot i, batch group j, lane) -> tile row and batch column.
template <int NB>
__device__ __forceinline__ void frag_pos(int f, int& row, int& col) {
  const int lane = f / (NB * 4), j = (f / 4) % NB, i = f % 4;
  row = (lane >> 2) + (i >= 2 ? 8 : 0);
  col = j * 8 + 2 * (lane & 3) + (i & 1);
}

template <int NB, Epilogue EPI>
constexpr int part_bytes() {  // the block's partial C tiles for the split-K reduction
  return (EPI == Epilogue::SiluMul ? 2 : 1) * kTileWarps * 32 * NB * 4 * (int)sizeof(float);
}

template <typename T, int NB, Epilogue EPI, bool PIPE>
__global__ void __launch_bounds__(kTileWarps * 32) gemv_mma_kernel(const GemvArgs<T> a, int splits) {
  constexpr int NACC = EPI == Epilogue::SiluMul ? 2 : 1;
  constexpr int FRAG = 32 * NB * 4;  // floats in one warp's C fragments
  // part[NACC][kTileWarps * FRAG]: the block's partial tiles for the split-K reduction
  extern __shared__ __align__(16) char smem[];
  float* part = reinterpret_cast<float*>(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int total_tiles = EPI == Epilogue::SiluMul ? a.tile_start[1] : a.tile_start[a.nw];
  const int tile = blockIdx.x * kTileWarps + warp;
  const int wi = weight_of_tile<T, EPI>(a, min(tile, total_tiles - 1));
  const int row0 = (tile - a.tile_start[wi]) * 16;
  const int kblocks = (a.k + 31) / 32, per_split = (kblocks + splits - 1) / splits;
  const int kb0 = min(kblocks, (int)blockIdx.y * per_split), kb1 = min(kblocks, kb0 + per_split);

  const T* w0 = a.w[wi] + (size_t)row0 * a.k;
  const T* w1 = a.w[NACC - 1] + (size_t)row0 * a.k;  // SiluMul: the up weight
  const int rows_left = a.n[wi] - row0, k_lo = kb0 * 32, kend = min(a.k, kb1 * 32);

  pdl_launch_dependents();
  // weights only (never written by a kernel of the step): start on them, then wait
  if (tile < total_tiles && (int)(blockIdx.x * gridDim.y + blockIdx.y) < a.prefetch_blocks) {
    const int r = min(16, rows_left), c1 = prefetch_end(k_lo, kend, a.prefetch_cols);
    prefetch_rows_l2(w0, r, a.k, k_lo, c1);
    if constexpr (EPI == Epilogue::SiluMul) prefetch_rows_l2(w1, r, a.k, k_lo, c1);
  }
  pdl_wait();
  float acc[NACC][NB][4] = {};
  if (tile < total_tiles) {
    const T* w[NACC];
    w[0] = w0;
    if constexpr (EPI == Epilogue::SiluMul) w[NACC - 1] = w1;
    tile_dot<T, NB, NACC, PIPE>(w, rows_left, a.x, a.m, a.k, kb0, kb1, acc);
  }
  if (splits == 1) {  // the whole K in this block: write from registers
    if (tile >= total_tiles) return;
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        int row, col;
        frag_pos<NB>((lane * NB + j) * 4 + i, row, col);
        store_out<T, EPI>(a, wi, row0 + row, col, acc[0][j][i], acc[NACC - 1][j][i]);
      }
    return;
  }
#pragma unroll
  for (int c = 0; c < NACC; ++c)
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) part[(c * kTileWarps + warp) * FRAG + (lane * NB + j) * 4 + i] = acc[c][j][i];
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  // block `rank` of the cluster sums every splits-th element of the group's tiles over all K slices
  const int rank = (int)cluster.block_rank();
  for (int e = rank * blockDim.x + threadIdx.x; e < kTileWarps * FRAG; e += splits * blockDim.x) {
    const int tl = blockIdx.x * kTileWarps + e / FRAG;
    if (tl >= total_tiles) break;
    float v[NACC] = {};
    for (int s = 0; s < splits; ++s) {
      const float* peer = cluster.map_shared_rank(part, s);
#pragma unroll
      for (int c = 0; c < NACC; ++c) v[c] += peer[c * kTileWarps * FRAG + e];
    }
    const int wj = weight_of_tile<T, EPI>(a, tl);
    int row, col;
    frag_pos<NB>(e % FRAG, row, col);
    store_out<T, EPI>(a, wj, (tl - a.tile_start[wj]) * 16 + row, col, v[0], v[NACC - 1]);
  }
  cluster.sync();  // peers' shared memory stays alive until every block has read it
}

// ---- small batches (m <= 4): CUDA cores, one warp streams a contiguous 512-byte stretch of one weight row
// per load instruction (the best DRAM locality); `splits` warps share a row's K when N alone cannot fill
// the GPU, and their partial sums meet in shared memory.
constexpr int kWarps = 8;        // warps per block
constexpr int kSmallUnroll = 4;  // 512-byte stretches of each weight row in flight per warp

struct RowStart {  // cumulative output rows per weight
  int v[kMaxW + 1];
};

// acc[c][r] += the 8 weights wf[c] . the 8 values of x row r in xv[r], for the rows present (r < m).
template <typename T, int MAXM, int NACC>
__device__ __forceinline__ void fma_stretch(const uint4 (&xv)[MAXM], const float (&wf)[NACC][8], int m,
                                            float acc[NACC][MAXM]) {
#pragma unroll
  for (int r = 0; r < MAXM; ++r) {
    if (r < m) {
      float xf[8];
      unpack8<T>(xv[r], xf);
#pragma unroll
      for (int c = 0; c < NACC; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[c][r] = fmaf(wf[c][i], xf[i], acc[c][r]);
    }
  }
}

template <int MAXM, int NACC>
__device__ __forceinline__ void warp_sum_all(float acc[NACC][MAXM]) {
#pragma unroll
  for (int c = 0; c < NACC; ++c)
#pragma unroll
    for (int r = 0; r < MAXM; ++r) acc[c][r] = warp_sum(acc[c][r]);
}

// acc[c][r] = (weight row c . x row r) over columns [k0, k1), warp-summed: each lane takes 8 consecutive columns
// of every 256. Per round the lane issues the loads of kSmallUnroll stretches of every weight row (the gated
// front streams gate and up together) before it uses any, so NACC x 2 KB per warp are in flight at once.
template <typename T, int MAXM, int NACC>
__device__ __forceinline__ void row_dot(const T* const (&wrow)[NACC], const T* __restrict__ x, int m, int k,
                                        int k0, int k1, float acc[NACC][MAXM]) {
  const int lane = threadIdx.x & 31;
  for (int kk0 = k0 + lane * 8; kk0 < k1; kk0 += 256 * kSmallUnroll) {
    uint4 wv[NACC][kSmallUnroll];
#pragma unroll
    for (int u = 0; u < kSmallUnroll; ++u)
#pragma unroll
      for (int c = 0; c < NACC; ++c) {
        const int kk = kk0 + u * 256;
        wv[c][u] = kk < k1 ? ld_stream(wrow[c] + kk) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int u = 0; u < kSmallUnroll; ++u) {
      const int kk = kk0 + u * 256;
      if (kk >= k1) break;
      // the stretch's x of every row, then each weight unpacked once: this order keeps every weight load ahead
      // of the first FMA in all six kernels with no spill (unpacking per row spilled in the gated 4-row kernel,
      // unpacking before the x loads let ptxas sink the plain kernels' loads again)
      uint4 xv[MAXM];
#pragma unroll
      for (int r = 0; r < MAXM; ++r) xv[r] = r < m ? ld_cached(x + (size_t)r * k + kk) : make_uint4(0, 0, 0, 0);
      float wf[NACC][8];
#pragma unroll
      for (int c = 0; c < NACC; ++c) unpack8<T>(wv[c][u], wf[c]);
      fma_stretch<T, MAXM, NACC>(xv, wf, m, acc);
    }
  }
  warp_sum_all<MAXM, NACC>(acc);
}

// What warp `warp` of (virtual) block `vb` computes: output `item` (weight `wi`, its row `row`), K part `part`
// of `splits`, columns [k0, k1).
struct SmallItem {
  int item, part, wi, row, k0, k1;
};

template <typename T, Epilogue EPI>
__device__ __forceinline__ SmallItem small_item(const GemvArgs<T>& a, const RowStart& rs, int splits, int vb,
                                                int warp) {
  SmallItem it;
  it.item = vb * (kWarps / splits) + warp / splits;
  it.part = warp % splits;
  const int chunk = ((a.k + splits - 1) / splits + 255) / 256 * 256;
  it.k0 = min(a.k, it.part * chunk);
  it.k1 = min(a.k, it.k0 + chunk);
  it.wi = 0;
  it.row = it.item;
  if constexpr (EPI == Epilogue::Plain) {
#pragma unroll
    for (int j = 1; j < kMaxW; ++j) it.wi += (j < a.nw && it.item >= rs.v[j]) ? 1 : 0;
    it.row = it.item - rs.v[it.wi];
  }
  return it;
}

template <typename T, Epilogue EPI>
__device__ __forceinline__ int small_total(const GemvArgs<T>& a, const RowStart& rs) {
  return EPI == Epilogue::SiluMul ? a.n[0] : rs.v[a.nw];
}

// The warp's weight rows of block `vb`, warmed into L2 if the block is in the first wave (weights only: safe
// before the PDL wait).
template <typename T, Epilogue EPI>
__device__ __forceinline__ void small_prefetch(const GemvArgs<T>& a, const RowStart& rs, int splits, int vb) {
  const SmallItem it = small_item<T, EPI>(a, rs, splits, vb, threadIdx.x >> 5);
  if (it.item >= small_total<T, EPI>(a, rs)) return;
  // (an empty range past the first wave, not an early return: the branch spilled in the gated 4-row kernel)
  const int k1p = vb < a.prefetch_blocks ? prefetch_end(it.k0, it.k1, a.prefetch_cols) : it.k0;
  prefetch_rows_l2(a.w[it.wi] + (size_t)it.row * a.k, 1, a.k, it.k0, k1p);
  if constexpr (EPI == Epilogue::SiluMul) prefetch_rows_l2(a.w[1] + (size_t)it.row * a.k, 1, a.k, it.k0, k1p);
}

// The outputs of block `vb`: each warp's partial dot products, summed over the K parts in part order through
// `red`, stored by lane r for row r of x.
template <typename T, int MAXM, Epilogue EPI>
__device__ __forceinline__ void small_block(const GemvArgs<T>& a, const RowStart& rs, int splits, int vb,
                                            float (*red)[EPI == Epilogue::SiluMul ? 2 : 1][MAXM]) {
  constexpr int NACC = EPI == Epilogue::SiluMul ? 2 : 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const SmallItem it = small_item<T, EPI>(a, rs, splits, vb, warp);
  const bool active = it.item < small_total<T, EPI>(a, rs);
  if constexpr (EPI == Epilogue::Plain)  // the lane that stores this output: its epilogue's reads into L1 now
    if (active && it.part == 0 && lane < a.m && lane < MAXM) prefetch_epilogue<T>(a, it.wi, it.row, lane);
  float acc[NACC][MAXM] = {};
  if (active) {
    const T* rows[NACC];
    rows[0] = a.w[it.wi] + (size_t)it.row * a.k;
    if constexpr (EPI == Epilogue::SiluMul) rows[NACC - 1] = a.w[1] + (size_t)it.row * a.k;
    row_dot<T, MAXM, NACC>(rows, a.x, a.m, a.k, it.k0, it.k1, acc);
  }
  if (lane == 0) {
#pragma unroll
    for (int c = 0; c < NACC; ++c)
#pragma unroll
      for (int r = 0; r < MAXM; ++r) red[warp][c][r] = acc[c][r];
  }
  __syncthreads();
  // (the bound again, not `active`: a flag live across the barrier spilled in the 4-row kernel)
  if (it.part == 0 && it.item < small_total<T, EPI>(a, rs) && lane < a.m && lane < MAXM) {
    float v[NACC];
#pragma unroll
    for (int c = 0; c < NACC; ++c) {
      v[c] = 0.f;
      for (int p = 0; p < splits; ++p) v[c] += red[warp + p][c][lane];
    }
    store_out<T, EPI>(a, it.wi, it.row, lane, v[0], v[NACC - 1]);
  }
}

template <typename T, int MAXM, Epilogue EPI>
__global__ void __launch_bounds__(kWarps * 32) gemv_small_kernel(const GemvArgs<T> a, const RowStart rs, int splits) {
  __shared__ float red[kWarps][EPI == Epilogue::SiluMul ? 2 : 1][MAXM];
  pdl_launch_dependents();
  // weights only: warm L2 while the previous kernel finishes
  small_prefetch<T, EPI>(a, rs, splits, blockIdx.x);
  pdl_wait();
  small_block<T, MAXM, EPI>(a, rs, splits, blockIdx.x, red);
}

// K parts per output row of the CUDA-core path: double while the grid is below 8192 warps and every part keeps
// a full round of kSmallUnroll 512-byte stretches per weight row. A warp's share of HBM requests is its loads in
// flight: splitting a 0.8B row (K 1024-3584) down to one or two stretches per warp held the one-row GEMVs to
// 19-39 % of copy bandwidth against 55 % with four (`gemv_pipe/at_c2dba80.md`); with a full round they reach
// 30-61 % and 0.8B decode b=1 904 -> 1022 tok/s, b=4 2647 -> 3282 (`small_splits/`). The 4B shapes split as
// before.
inline int small_splits(int total_rows, int k) {
  const int stretches = (k + 255) / 256;
  int splits = 1;
  while (splits < kWarps && total_rows * splits < 8192 && stretches / (2 * splits) >= kSmallUnroll) splits *= 2;
  return splits;
}

// Blocks of the CUDA-core path for `total_rows` outputs split `splits` ways (kWarps / splits rows per block).
inline int small_blocks(int total_rows, int splits) {
  const int rows_per_block = kWarps / splits;
  return (total_rows + rows_per_block - 1) / rows_per_block;
}

constexpr int kMaxRowsPerLaunch = 64;
constexpr int kMaxSmallRows = 4;

template <typename T, Epilogue EPI>
void launch_small(const GemvArgs<T>& a, const RowStart& rs, int total_rows) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const int splits = small_splits(total_rows, a.k);
  const int blocks = small_blocks(total_rows, splits);
#define SEGKI_SMALL_CASE(M)                                                                         \
  if (a.m <= M) {                                                                                  \
    GemvArgs<T> b = a;                                                                             \
    b.prefetch_blocks = first_wave_blocks<gemv_small_kernel<T, M, EPI>>(kWarps * 32, 0);           \
    launch_pdl(gemv_small_kernel<T, M, EPI>, dim3(blocks), dim3(kWarps * 32), stream, dim3(1), b, rs, splits); \
    return;                                                                                        \
  }
  SEGKI_SMALL_CASE(1) SEGKI_SMALL_CASE(2) SEGKI_SMALL_CASE(4)
#undef SEGKI_SMALL_CASE
}

// ---- small batches through the copy engine (sm_90, 1-4 rows): one block per chunk of output rows (at most
// 32 KB of their weight rows) copies the chunk into shared memory with cp.async.bulk before the PDL wait -- so a
// kernel's weights are in flight while the previous kernel finishes, and no register holds a load -- then reads
// x (staged once) and the rows from shared memory, each lane the same 8 consecutive columns of every 256 as
// row_dot: a chunk of 8 or more rows sums in row_dot's order with one K part (bit-equal to the register path
// where that has one part too); a chunk of fewer rows splits each row's stretches over the idle warps and sums
// the parts in part order. A block whose rows span weights takes one chunk per weight through two slots (a
// third and later wait for a slot to be read). With a norm prologue x is normalized as it is staged (stage_x), so
// the RMSNorm before the projection needs no launch (dispatch asks for it at 1-2 rows, where that measured faster:
// `results/fold_norm_prologue/`).
// Where it runs (`results/bulk_grid/`): weights of at most 16 MiB, or rows of at most 2 KB -- the 0.8B model's
// projections and output head, where the register path pays its ramp and tail per launch or keeps too few bytes
// in flight per warp: 0.8B decode b=1 1035 -> 1121 tok/s, b=4 3265 -> 3423 (one run). The 4B shapes (21-1272 MB,
// rows of 5-18 KB) stay on the register path, which streams them at 60-100 % of copy bandwidth (this path:
// 52-82 %, 4B decode b=1 323 -> 293). One block per SM streaming its whole range through a ring lost everywhere but the
// one-chunk o_proj (a block completed one slot per ~1.5 us; 0.8B decode b=1 862-872, `results/bulk_gemv/`).
constexpr int kBulkChunkBytes = 32 * 1024;  // weight bytes per slot, at most
constexpr int kBulkSmemBytes = 108 * 1024;  // x and the two slots, at most
constexpr int kBulkSlots = 2;
constexpr long kBulkMaxWeightBytes = 16L << 20;  // the routing rule above
constexpr int kBulkMaxRowBytes = 2048;

struct BulkPlan {
  int items;           // output rows (of the gated front: SiLU(gate) * up values) per row of x
  int rows_per_chunk;  // rows of each streamed weight per slot
  int x_elems;         // x's place at the start of shared memory (its m * K elements, rounded up to 128 bytes)
};

// `rows` consecutive rows of weight `wi` from `row`: the next chunk of a block's range [item, end), which ends
// at the range's end, the weight's last row or the slot's capacity.
struct BulkChunk {
  int wi, row, rows;
};

template <typename T, Epilogue EPI>
__device__ __forceinline__ BulkChunk bulk_chunk(const GemvArgs<T>& a, const RowStart& rs, int item, int end,
                                                int rpc) {
  BulkChunk ch;
  ch.wi = 0;
  int first = 0;  // the weight's first row among all outputs (selects, not an indexed array: no stack frame)
  if constexpr (EPI == Epilogue::Plain) {
#pragma unroll
    for (int j = 1; j < kMaxW; ++j) {
      if (j < a.nw && item >= rs.v[j]) {
        ch.wi = j;
        first = rs.v[j];
      } else if (j <= a.nw && ch.wi == j - 1) {
        end = min(end, rs.v[j]);
      }
    }
  }
  ch.row = item - first;
  ch.rows = min(rpc, end - item);
  return ch;
}

// Thread 0: the chunk's weight rows (gate then up rows for the gated front) into `slot`, completing on `full`.
template <typename T, Epilogue EPI>
__device__ __forceinline__ void bulk_issue(const GemvArgs<T>& a, const BulkChunk& ch, T* slot, uint64_t* full) {
  const unsigned bytes = (unsigned)ch.rows * a.k * sizeof(T);
  const T* w = a.w[0];
#pragma unroll
  for (int j = 1; j < kMaxW; ++j) w = ch.wi == j ? a.w[j] : w;
  mbar_expect(full, EPI == Epilogue::SiluMul ? 2 * bytes : bytes);
  bulk_load(slot, w + (size_t)ch.row * a.k, bytes, full);
  if constexpr (EPI == Epilogue::SiluMul)
    bulk_load(slot + (size_t)ch.rows * a.k, a.w[1] + (size_t)ch.row * a.k, bytes, full);
}

// acc[c][r] += (shared weight row c . shared x row r) over the 256-column stretches part, part + parts, ... of
// K, warp-summed; with one part the products and sums of row_dot, in its order.
template <typename T, int MAXM, int NACC>
__device__ __forceinline__ void smem_row_dot(const T* const (&wrow)[NACC], const T* __restrict__ x, int m, int k,
                                             int part, int parts, float acc[NACC][MAXM]) {
  const int lane = threadIdx.x & 31;
#pragma unroll 4
  for (int kk = part * 256 + lane * 8; kk < k; kk += 256 * parts) {
    uint4 xv[MAXM];
#pragma unroll
    for (int r = 0; r < MAXM; ++r)
      xv[r] = r < m ? *reinterpret_cast<const uint4*>(x + (size_t)r * k + kk) : make_uint4(0, 0, 0, 0);
    float wf[NACC][8];
#pragma unroll
    for (int c = 0; c < NACC; ++c) unpack8<T>(*reinterpret_cast<const uint4*>(wrow[c] + kk), wf[c]);
    fma_stretch<T, MAXM, NACC>(xv, wf, m, acc);
  }
  warp_sum_all<MAXM, NACC>(acc);
}

// Lane r's value of x row r: acc[c][lane] without an indexed register array.
template <int MAXM>
__device__ __forceinline__ float lane_value(const float (&acc)[MAXM], int lane) {
  float v = acc[0];
#pragma unroll
  for (int r = 1; r < MAXM; ++r) v = lane == r ? acc[r] : v;
  return v;
}

// x [m, K] into shared memory once (read from L2 per stretch, under the copies' traffic, its latency had made the
// dot products slower than the weights' arrival: 0.8B o_proj 3.5 us against 3.3 on the register path), through
// the launch's RMSNorm when it has one. The norm is rms_norm_kernel's arithmetic thread for thread (the same 8
// columns of every 2048 per thread, the same block reduction, 256 threads both), so the rows hold the bits that
// kernel would have stored. It sits on every block's path between the PDL wait and the dot products, so it costs
// one round trip: every row's first 8 columns are requested at once and kept in registers, and the thread's first
// 8 norm weights (`w0`) were loaded before the wait; only columns past the first 2048 go through memory twice.
template <typename T, int MAXM>
__device__ __forceinline__ void stage_x(const GemvArgs<T>& a, T* __restrict__ xs, float (*scratch)[32], uint4 w0) {
  if (a.norm_w == nullptr) {
    for (int i = threadIdx.x; i < a.m * a.k / 8; i += kWarps * 32)
      reinterpret_cast<uint4*>(xs)[i] = ld_cached(a.x + (size_t)i * 8);
    return;
  }
  constexpr int kStride = kWarps * 32 * 8;  // columns between a thread's stretches
  const int i0 = threadIdx.x * 8;
  uint4 first[MAXM];  // [row]: the thread's first 8 columns of each row
#pragma unroll
  for (int r = 0; r < MAXM; ++r)
    first[r] = r < a.m && i0 < a.k ? ld_cached(a.x + (size_t)r * a.k + i0) : make_uint4(0, 0, 0, 0);
  float ss[MAXM];
#pragma unroll
  for (int r = 0; r < MAXM; ++r) {
    float v[8];
    unpack8<T>(first[r], v);
    ss[r] = add_squares8(v, 0.f);
    if (r < a.m)
      for (int i = i0 + kStride; i < a.k; i += kStride) {  // rows wider than 2048: the rest as they are, for now
        const uint4 u = ld_cached(a.x + (size_t)r * a.k + i);
        *reinterpret_cast<uint4*>(xs + (size_t)r * a.k + i) = u;
        unpack8<T>(u, v);
        ss[r] = add_squares8(v, ss[r]);
      }
  }
  block_sums<MAXM>(ss, scratch);
  float wf0[8];
  unpack8<T>(w0, wf0);
#pragma unroll
  for (int r = 0; r < MAXM; ++r) {
    if (r < a.m && i0 < a.k) {
      const float inv = rms_inverse(ss[r], a.k, a.norm_eps);
      float v[8], w[8];
      unpack8<T>(first[r], v);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = rms_scaled<T>(v[j], inv, wf0[j], a.norm_unit_offset);
      *reinterpret_cast<uint4*>(xs + (size_t)r * a.k + i0) = pack8<T>(v);
      for (int i = i0 + kStride; i < a.k; i += kStride) {  // normalized in place, by the thread that stored them
        uint4* p = reinterpret_cast<uint4*>(xs + (size_t)r * a.k + i);
        unpack8<T>(*p, v);
        unpack8<T>(ld_cached(a.norm_w + i), w);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = rms_scaled<T>(v[j], inv, w[j], a.norm_unit_offset);
        *p = pack8<T>(v);
      }
    }
  }
}

template <typename T, int MAXM, Epilogue EPI>
__global__ void __launch_bounds__(kWarps * 32, 3) gemv_bulk_kernel(const GemvArgs<T> a, const RowStart rs,
                                                                  const BulkPlan plan) {
  constexpr int NACC = EPI == Epilogue::SiluMul ? 2 : 1;
  extern __shared__ __align__(128) unsigned char bulk_smem[];  // x [m][K], then the ring [slots][NACC][rpc][K]
  __shared__ __align__(8) uint64_t full[kBulkSlots];
  __shared__ float red[kWarps][NACC][MAXM];
  __shared__ float norm_scratch[MAXM][32];
  T* xs = reinterpret_cast<T*>(bulk_smem);
  T* ring = xs + plan.x_elems;
  const int rpc = plan.rows_per_chunk;
  const int begin = (int)((long long)blockIdx.x * plan.items / gridDim.x);
  const int end = (int)((long long)(blockIdx.x + 1) * plan.items / gridDim.x);
  const size_t slot_elems = (size_t)NACC * rpc * a.k;
  int ahead = begin;  // thread 0: the first row not yet requested
  if (threadIdx.x == 0) {  // weights only: safe before the wait
    for (int s = 0; s < kBulkSlots; ++s) mbar_init(&full[s]);
    bulk_fence_init();
    for (int s = 0; s < kBulkSlots && ahead < end; ++s) {
      const BulkChunk ch = bulk_chunk<T, EPI>(a, rs, ahead, end, rpc);
      bulk_issue<T, EPI>(a, ch, ring + s * slot_elems, &full[s]);
      ahead += ch.rows;
    }
  }
  // the norm prologue's first weights (a parameter, never written by a kernel of the step: safe before the wait)
  const uint4 w0 = a.norm_w && threadIdx.x * 8 < a.k ? ld_cached(a.norm_w + threadIdx.x * 8) : make_uint4(0, 0, 0, 0);
  pdl_launch_dependents();
  pdl_wait();
  stage_x<T, MAXM>(a, xs, norm_scratch, w0);
  __syncthreads();  // x is in place and the barriers are initialized before any thread waits on them
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int item = begin;
  for (int c = 0; item < end; ++c) {
    const BulkChunk ch = bulk_chunk<T, EPI>(a, rs, item, end, rpc);
    int parts = 1;  // warps per row: the chunk's rows share the 8 warps
    while (parts * 2 * ch.rows <= kWarps) parts *= 2;
    const int part = warp % parts, first = warp / parts, stride = kWarps / parts;
    const int slot = c % kBulkSlots;
    if constexpr (EPI == Epilogue::Plain)  // the storing lanes' epilogue reads into L1 while the copies land
      if (part == 0 && lane < a.m)
        for (int r = first; r < ch.rows; r += stride) prefetch_epilogue<T>(a, ch.wi, ch.row + r, lane);
    mbar_wait(&full[slot], (unsigned)(c / kBulkSlots) & 1u);
    const T* w = ring + slot * slot_elems;
    for (int r = first; r < ch.rows; r += stride) {
      float acc[NACC][MAXM] = {};
      const T* rows[NACC];
      rows[0] = w + (size_t)r * a.k;
      if constexpr (EPI == Epilogue::SiluMul) rows[NACC - 1] = w + (size_t)(ch.rows + r) * a.k;
      smem_row_dot<T, MAXM, NACC>(rows, xs, a.m, a.k, part, parts, acc);
      if (parts == 1) {
        if (lane < a.m) store_out<T, EPI>(a, ch.wi, ch.row + r, lane, lane_value(acc[0], lane),
                                          lane_value(acc[NACC - 1], lane));
      } else if (lane == 0) {
#pragma unroll
        for (int cc = 0; cc < NACC; ++cc)
#pragma unroll
          for (int rr = 0; rr < MAXM; ++rr) red[warp][cc][rr] = acc[cc][rr];
      }
    }
    __syncthreads();  // the slot is read, the parts are in `red`
    if (parts > 1 && part == 0 && first < ch.rows && lane < a.m) {
      float v[NACC];
#pragma unroll
      for (int cc = 0; cc < NACC; ++cc) {
        v[cc] = 0.f;
        for (int p = 0; p < parts; ++p) v[cc] += red[warp + p][cc][lane];
      }
      store_out<T, EPI>(a, ch.wi, ch.row + first, lane, v[0], v[NACC - 1]);
    }
    // The slot's next chunk, kBulkSlots chunks on. No proxy fence (it compiled to MEMBAR.ALL.CTA behind warp 0's
    // output stores; leaving it out measured no different, `results/bulk_grid/`): the block barrier orders the
    // slot's reads, whose values the dot products have consumed, before the copy, as a pipeline's `empty`
    // mbarrier does for a TMA refill.
    if (threadIdx.x == 0 && ahead < end) {
      const BulkChunk nx = bulk_chunk<T, EPI>(a, rs, ahead, end, rpc);
      bulk_issue<T, EPI>(a, nx, ring + slot * slot_elems, &full[slot]);
      ahead += nx.rows;
    }
    if (parts > 1) __syncthreads();  // `red` is read before the next chunk writes it
    item += ch.rows;
  }
}

// Chunks per block (SEGKI_GEMV_BULK_CHUNKS, 1-8; default 1, what was measured): more chunks stage x once for all
// of them, the first two requested before the PDL wait, later ones as a slot is read. For the A/B of long rows,
// where x staged per chunk is several times the chunk's weight bytes (4B down_proj at 4 rows: 72 KB per 18 KB).
inline int bulk_chunks_per_block() {
  static const int chunks = (int)env_long("SEGKI_GEMV_BULK_CHUNKS", 1, 1, 8);
  return chunks;
}

// The copy-engine path where it takes the inputs: an sm_90 device, a weight row (the gate and up rows together)
// within one slot, x and two slots within kBulkSmemBytes, every weight 16-byte aligned, and the routing rule
// (SEGKI_GEMV_BULK=1: wherever it can run; =0: nowhere). Returns false otherwise (the register path runs).
// (`dispatch.folds_norm` mirrors this rule: there the norm before a projection is left to it.)
template <typename T, Epilogue EPI>
bool bulk_plan(const GemvArgs<T>& a, int total_rows, BulkPlan& plan, long& smem) {
  static const bool never = env_is("SEGKI_GEMV_BULK", "0"), always = env_is("SEGKI_GEMV_BULK", "1");
  if (never || a.m > kMaxSmallRows || at::cuda::getCurrentDeviceProperties()->major < 9) return false;
  const long row_bytes = (long)a.k * sizeof(T) * (EPI == Epilogue::SiluMul ? 2 : 1);
  if (!always && (long)total_rows * row_bytes > kBulkMaxWeightBytes && (long)a.k * sizeof(T) > kBulkMaxRowBytes)
    return false;
  if (row_bytes > kBulkChunkBytes) return false;
  for (int i = 0; i < a.nw; ++i)
    if (reinterpret_cast<uintptr_t>(a.w[i]) % 16 != 0) return false;
  plan.items = total_rows;
  plan.rows_per_chunk = (int)(kBulkChunkBytes / row_bytes);
  const long x_bytes = ((long)a.m * a.k * sizeof(T) + 127) / 128 * 128;
  plan.x_elems = (int)(x_bytes / sizeof(T));
  smem = x_bytes + kBulkSlots * plan.rows_per_chunk * row_bytes;
  return smem <= kBulkSmemBytes;
}

template <typename T, Epilogue EPI>
bool launch_bulk(const GemvArgs<T>& a, const RowStart& rs, int total_rows) {
  BulkPlan plan;
  long smem = 0;
  if (!bulk_plan<T, EPI>(a, total_rows, plan, smem)) return false;
  const int rows_per_block = plan.rows_per_chunk * bulk_chunks_per_block();
  const int blocks = (total_rows + rows_per_block - 1) / rows_per_block;
  auto stream = at::cuda::getCurrentCUDAStream();
#define SEGKI_BULK_CASE(M)                                                                                  \
  if (a.m <= M) {                                                                                          \
    allow_dynamic_smem<gemv_bulk_kernel<T, M, EPI>>(kBulkSmemBytes);                                       \
    launch_pdl_smem(gemv_bulk_kernel<T, M, EPI>, dim3(blocks), dim3(kWarps * 32), (int)smem, stream, dim3(1), \
                    a, rs, plan);                                                                          \
    return true;                                                                                           \
  }
  SEGKI_BULK_CASE(1) SEGKI_BULK_CASE(2) SEGKI_BULK_CASE(4)
#undef SEGKI_BULK_CASE
  return false;
}

// K slices per group: double while the grid is below 4 blocks per SM and each slice keeps at least two
// rounds of kUnroll k blocks.
int choose_splits(int groups, int kblocks) {
  const int sms = sm_count();
  int splits = 1;
  while (splits < kMaxSplits && groups * splits < 4 * sms && kblocks / (2 * splits) >= 2 * kUnroll) splits *= 2;
  return splits;
}

// Two register stages, except where one measured faster: the GDN input projection (four weights, two of them
// one row per head) at 9-16 rows, on both models (4B 24.4 against 30.6 us, 0.8B 11.1 against 14.1 at 16 rows;
// `gemv_pipe/at_c2dba80.md`; why is not established). SEGKI_GEMV_PIPE=0: one stage everywhere, for the A/B.
template <typename T, int NB, Epilogue EPI>
void launch_mma(const GemvArgs<T>& a, int groups, int splits, bool one_stage_9_to_16, cudaStream_t stream) {
  constexpr int smem = part_bytes<NB, EPI>();
  static_assert(smem <= 48 * 1024, "the split-K partial tiles must fit the default dynamic shared memory");
  static const bool pipe_default = !env_is("SEGKI_GEMV_PIPE", "0");
  const bool pipe = pipe_default && !(one_stage_9_to_16 && NB == 2);
  GemvArgs<T> b = a;
  b.prefetch_blocks = pipe ? first_wave_blocks<gemv_mma_kernel<T, NB, EPI, true>>(kTileWarps * 32, smem)
                           : first_wave_blocks<gemv_mma_kernel<T, NB, EPI, false>>(kTileWarps * 32, smem);
  launch_pdl_smem(pipe ? gemv_mma_kernel<T, NB, EPI, true> : gemv_mma_kernel<T, NB, EPI, false>,
                  dim3(groups, splits), dim3(kTileWarps * 32), smem, stream, dim3(1, splits, 1), b, splits);
}

template <typename T, Epilogue EPI>
void launch_tiles(const GemvArgs<T>& a, int tiles, bool one_stage_9_to_16) {
  const int groups = (tiles + kTileWarps - 1) / kTileWarps;
  const int splits = choose_splits(groups, (a.k + 31) / 32);
  auto stream = at::cuda::getCurrentCUDAStream();
#define SEGKI_GEMV_CASE(NB)                                               \
  if (a.m <= NB * 8) {                                                   \
    launch_mma<T, NB, EPI>(a, groups, splits, one_stage_9_to_16, stream); \
    return;                                                              \
  }
  SEGKI_GEMV_CASE(1) SEGKI_GEMV_CASE(2) SEGKI_GEMV_CASE(4) SEGKI_GEMV_CASE(8)
#undef SEGKI_GEMV_CASE
}

// One launch of the family for at most 64 rows of x: tensor cores from 5 rows, else the copy-engine path where
// it is on and takes the inputs, else the register path.
template <typename T, Epilogue EPI>
void launch_family(const GemvArgs<T>& a, const RowStart& rs, bool one_stage_9_to_16) {
  constexpr bool gated = EPI == Epilogue::SiluMul;
  if (a.m > kMaxSmallRows) {
    launch_tiles<T, EPI>(a, a.tile_start[gated ? 1 : a.nw], one_stage_9_to_16);
    return;
  }
  const int rows = gated ? a.n[0] : rs.v[a.nw];  // outputs per row of x
  if (!launch_bulk<T, EPI>(a, rs, rows)) launch_small<T, EPI>(a, rs, rows);
}

// Validates, allocates outputs [..., N_i], and runs over row chunks of at most 64 rows.
struct ConvArgs {  // gdn_in_proj_conv's conv, applied to weight 0's outputs
  at::Tensor* state;
  const at::Tensor* weight;
  const c10::optional<at::Tensor>* bias;
};

struct NormArgs {  // the RMSNorm applied to x first (the ops' norm_w, norm_eps, norm_unit_offset)
  const c10::optional<at::Tensor>* weight;
  double eps;
  bool unit_offset;
};

// Whether the copy-engine path takes x [m, K] by these weights, where it can run the norm in its x staging.
template <typename T>
bool takes_norm(Epilogue epi, int64_t m, int64_t k, const std::vector<at::Tensor>& ws) {
  if (m > kMaxSmallRows) return false;
  GemvArgs<T> probe{};
  probe.m = (int)m;
  probe.k = (int)k;
  probe.nw = (int)ws.size();
  int rows = 0;
  for (int i = 0; i < probe.nw; ++i) {
    probe.w[i] = reinterpret_cast<const T*>(ws[i].data_ptr());
    rows += (int)ws[i].size(0);
  }
  BulkPlan plan;
  long smem = 0;
  return epi == Epilogue::SiluMul ? bulk_plan<T, Epilogue::SiluMul>(probe, (int)ws[0].size(0), plan, smem)
                                  : bulk_plan<T, Epilogue::Plain>(probe, rows, plan, smem);
}

std::vector<at::Tensor> run_gemv(const char* op, const at::Tensor& x, std::vector<at::Tensor> ws,
                                 std::vector<c10::optional<at::Tensor>> biases, Epilogue epi,
                                 const c10::optional<at::Tensor>& residual = c10::nullopt,
                                 const ConvArgs* conv = nullptr, bool one_stage_9_to_16 = false,
                                 const NormArgs* norm = nullptr) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous(), op, ": x must be a contiguous CUDA tensor");
  const int64_t k = x.size(-1);
  TORCH_CHECK(k % 8 == 0, op, ": the input width ", k, " must be a multiple of 8 (16-byte loads)");
  const int64_t m = x.numel() / k;
  c10::cuda::CUDAGuard guard(x.device());
  const int nout = epi == Epilogue::SiluMul ? 1 : (int)ws.size();
  for (int i = 0; i < (int)ws.size(); ++i) {
    check_cuda_half(ws[i], op, "weight", x.scalar_type());
    TORCH_CHECK(ws[i].dim() == 2 && ws[i].size(1) == k, op, ": weight ", i, " is ", ws[i].sizes(),
                ", expected [N, ", k, "]");
    if (i < (int)biases.size() && biases[i].has_value()) {
      check_cuda_half(*biases[i], op, "bias", x.scalar_type());
      TORCH_CHECK(biases[i]->numel() == ws[i].size(0), op, ": bias ", i, " does not match its weight");
    }
  }
  std::vector<at::Tensor> outs;
  for (int i = 0; i < nout; ++i) {
    auto shape = x.sizes().vec();
    shape.back() = ws[i].size(0);
    outs.push_back(at::empty(shape, x.options()));
  }
  if (residual.has_value()) {
    check_cuda_half(*residual, op, "residual", x.scalar_type());
    TORCH_CHECK(residual->sizes() == outs[0].sizes(), op, ": residual ", residual->sizes(), " must match the output ",
                outs[0].sizes());
  }
  int width = 0;
  if (conv) {
    width = (int)conv->state->size(-1);
    check_cuda_half(*conv->state, op, "conv_state", x.scalar_type());
    check_cuda_half(*conv->weight, op, "conv_weight", x.scalar_type());
    if (conv->bias->has_value()) check_cuda_half(**conv->bias, op, "conv_bias", x.scalar_type());
    TORCH_CHECK(conv->state->dim() == 3 && conv->state->size(0) == m && conv->state->size(1) == ws[0].size(0) &&
                    width >= 1 && width <= kMaxConvWidth, op, ": conv_state ", conv->state->sizes(), " must be [",
                m, ", ", ws[0].size(0), ", W] with W <= ", kMaxConvWidth);
    TORCH_CHECK(conv->weight->sizes() == at::IntArrayRef({ws[0].size(0), width}), op, ": conv_weight ",
                conv->weight->sizes(), " must be [", ws[0].size(0), ", ", width, "]");
    TORCH_CHECK(!conv->bias->has_value() || (*conv->bias)->numel() == ws[0].size(0), op,
                ": conv_bias must have one value per channel");
  }
  const bool normed = norm != nullptr && norm->weight->has_value();
  if (normed) {
    check_cuda_half(**norm->weight, op, "norm_w", x.scalar_type());
    TORCH_CHECK((*norm->weight)->dim() == 1 && (*norm->weight)->size(0) == k, op, ": norm_w ",
                (*norm->weight)->sizes(), " must be [", k, "], one weight per input column");
  }
  if (m == 0) return outs;
  SEGKI_DISPATCH_HALF(x.scalar_type(), op, [&] {
    // the norm in the launch's x staging where the copy-engine path runs, else the norm kernel first
    const bool prologue = normed && takes_norm<T>(epi, m, k, ws);
    const at::Tensor xs = normed && !prologue ? rms_norm_rows(x, **norm->weight, norm->eps, norm->unit_offset) : x;
    for (int64_t r0 = 0; r0 < m; r0 += kMaxRowsPerLaunch) {
      GemvArgs<T> a{};
      a.x = reinterpret_cast<const T*>(xs.data_ptr()) + r0 * k;
      if (prologue) {
        a.norm_w = reinterpret_cast<const T*>((*norm->weight)->data_ptr());
        a.norm_eps = (float)norm->eps;
        a.norm_unit_offset = norm->unit_offset;
      }
      a.m = (int)std::min<int64_t>(kMaxRowsPerLaunch, m - r0);
      a.k = (int)k;
      a.nw = (int)ws.size();
      a.prefetch_cols = prefetch_cols(sizeof(T));
      a.residual =
          residual.has_value() ? reinterpret_cast<const T*>(residual->data_ptr()) + r0 * ws[0].size(0) : nullptr;
      if (conv) {
        a.conv_state = reinterpret_cast<T*>(conv->state->data_ptr()) + r0 * ws[0].size(0) * width;
        a.conv_w = reinterpret_cast<const T*>(conv->weight->data_ptr());
        a.conv_b = conv->bias->has_value() ? reinterpret_cast<const T*>((*conv->bias)->data_ptr()) : nullptr;
        a.conv_width = width;
      }
      for (int i = 0; i < a.nw; ++i) {
        a.w[i] = reinterpret_cast<const T*>(ws[i].data_ptr());
        a.bias[i] = (i < (int)biases.size() && biases[i].has_value())
                        ? reinterpret_cast<const T*>(biases[i]->data_ptr()) : nullptr;
        a.n[i] = (int)ws[i].size(0);
        a.out[i] = i < nout ? reinterpret_cast<T*>(outs[i].data_ptr()) + r0 * a.n[i] : nullptr;
        a.tile_start[i + 1] = a.tile_start[i] + (a.n[i] + 15) / 16;
      }
      RowStart rs{};
      for (int i = 0; i < a.nw; ++i) rs.v[i + 1] = rs.v[i] + a.n[i];
      if (epi == Epilogue::SiluMul) launch_family<T, Epilogue::SiluMul>(a, rs, one_stage_9_to_16);
      else launch_family<T, Epilogue::Plain>(a, rs, one_stage_9_to_16);
    }
  });
  return outs;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b,
                  const c10::optional<at::Tensor>& residual) {
  return run_gemv("segki::linear", x, {w}, {b}, Epilogue::Plain, residual)[0];
}

// The projections that follow a norm in a decoder layer take it as an optional prologue (norm_w, norm_eps,
// norm_unit_offset): x is normalized first, inside the launch where the copy-engine path runs.
#define SEGKI_NORM_PARAMS \
  const c10::optional<at::Tensor>&norm_w, double norm_eps, bool norm_unit_offset

at::Tensor gated_mlp_front(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu, SEGKI_NORM_PARAMS) {
  TORCH_CHECK(wg.sizes() == wu.sizes(), "segki::gated_mlp_front: gate ", wg.sizes(), " and up ", wu.sizes(),
              " weights differ in shape");
  const NormArgs norm{&norm_w, norm_eps, norm_unit_offset};
  return run_gemv("segki::gated_mlp_front", x, {wg, wu}, {}, Epilogue::SiluMul, c10::nullopt, nullptr, false,
                  &norm)[0];
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_proj(
    const at::Tensor& x, const at::Tensor& wq, const at::Tensor& wk, const at::Tensor& wv,
    const c10::optional<at::Tensor>& bq, const c10::optional<at::Tensor>& bk, const c10::optional<at::Tensor>& bv,
    SEGKI_NORM_PARAMS) {
  const NormArgs norm{&norm_w, norm_eps, norm_unit_offset};
  auto o = run_gemv("segki::qkv_proj", x, {wq, wk, wv}, {bq, bk, bv}, Epilogue::Plain, c10::nullopt, nullptr, false,
                    &norm);
  return {o[0], o[1], o[2]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gdn_in_proj(
    const at::Tensor& x, const at::Tensor& wqkv, const at::Tensor& wz, const at::Tensor& wb, const at::Tensor& wa,
    SEGKI_NORM_PARAMS) {
  const NormArgs norm{&norm_w, norm_eps, norm_unit_offset};
  auto o = run_gemv("segki::gdn_in_proj", x, {wqkv, wz, wb, wa}, {}, Epilogue::Plain, c10::nullopt, nullptr, true,
                    &norm);
  return {o[0], o[1], o[2], o[3]};
}

// gdn_in_proj with the Gated-DeltaNet conv token in weight 0's epilogue: returns (SiLU(conv(q|k|v)), z, b, a)
// and shifts conv_state in place -- one launch instead of two, and q|k|v never goes through memory unconvolved.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gdn_in_proj_conv(
    const at::Tensor& x, const at::Tensor& wqkv, const at::Tensor& wz, const at::Tensor& wb, const at::Tensor& wa,
    at::Tensor& conv_state, const at::Tensor& conv_weight, const c10::optional<at::Tensor>& conv_bias,
    SEGKI_NORM_PARAMS) {
  const ConvArgs conv{&conv_state, &conv_weight, &conv_bias};
  const NormArgs norm{&norm_w, norm_eps, norm_unit_offset};
  auto o = run_gemv("segki::gdn_in_proj_conv", x, {wqkv, wz, wb, wa}, {}, Epilogue::Plain, c10::nullopt, &conv, true,
                    &norm);
  return {o[0], o[1], o[2], o[3]};
}
#undef SEGKI_NORM_PARAMS

// ---- SiLU(gate) * up for batches beyond the GEMV range, whose products come from cuBLAS (one over the packed
// gate|up weights, so gate and up are column slices of it, or two): one launch instead of the five (two casts,
// silu, mul, cast back) of the fp32 reference. 8 elements per thread; rows of c8 x 8 values lie g_ld / u_ld
// elements apart in gate / up, out is contiguous.
template <typename T>
__global__ void silu_mul_kernel(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out,
                                int64_t n8, int64_t c8, int64_t g_ld, int64_t u_ld) {
  pdl_start();  // everything below reads what earlier kernels wrote
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n8; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / c8, c = (i - r * c8) * 8;
    float g[8], u[8];
    unpack8<T>(ld_cached(gate + r * g_ld + c), g);
    unpack8<T>(ld_cached(up + r * u_ld + c), u);
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] = silu(g[j]) * u[j];
    *reinterpret_cast<uint4*>(out + i * 8) = pack8<T>(g);
  }
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  const char* op = "segki::silu_mul";
  const int64_t g_ld = check_rows_half(gate, op, "gate", gate.scalar_type());
  const int64_t u_ld = check_rows_half(up, op, "up", gate.scalar_type());
  TORCH_CHECK(gate.sizes() == up.sizes(), op, ": gate ", gate.sizes(), " and up ", up.sizes(), " differ");
  const int64_t cols = gate.dim() == 0 ? 1 : gate.size(-1);
  TORCH_CHECK(cols % 8 == 0 && g_ld % 8 == 0 && u_ld % 8 == 0, op, ": rows of ", cols, " values ", g_ld, " / ",
              u_ld, " apart; each must be a multiple of 8 (16-byte loads)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(gate.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(up.data_ptr()) % 16 == 0,
              op, ": gate and up must start on 16-byte boundaries (16-byte loads)");
  auto out = at::empty(gate.sizes(), gate.options());
  const int64_t n8 = gate.numel() / 8;
  if (n8 == 0) return out;
  c10::cuda::CUDAGuard guard(gate.device());
  const int sms = sm_count();
  const int blocks = (int)std::min<int64_t>((n8 + 255) / 256, 8 * sms);
  SEGKI_DISPATCH_HALF(gate.scalar_type(), op, [&] {
    launch_pdl(silu_mul_kernel<T>, dim3(blocks), dim3(256), at::cuda::getCurrentCUDAStream(), dim3(1),
               reinterpret_cast<const T*>(gate.data_ptr()), reinterpret_cast<const T*>(up.data_ptr()),
               reinterpret_cast<T*>(out.data_ptr()), n8, cols / 8, g_ld, u_ld);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) {
  m.impl("silu_mul", &silu_mul);
  m.impl("linear", &linear);
  m.impl("gated_mlp_front", &gated_mlp_front);
  m.impl("qkv_proj", &qkv_proj);
  m.impl("gdn_in_proj", &gdn_in_proj);
  m.impl("gdn_in_proj_conv", &gdn_in_proj_conv);
}

}  // namespace segki
