// The decode GEMVs' arguments and device building blocks shared by gemv.cu (one projection per launch) and
// layer_tail.cu (a decoder layer's output projection and MLP in one launch): the epilogue of an output element,
// the dot products of the CUDA-core and copy-engine paths, and x staged in shared memory with its RMSNorm.
// Several kernels reading the same code is what lets the layer tail give the separate projections' bits.
//
// FRESH: the data was written earlier in the same kernel by other blocks (the layer tail's intermediate rows), so
// it is read through L2 (ld.global.cg) rather than the read-only path, which may serve lines older than the write.
#pragma once

#include "bulk.cuh"
#include "common.cuh"

namespace segki {

// One 16-byte load of activations: the read-only path for a previous kernel's output, L2 for this kernel's.
template <bool FRESH>
__device__ __forceinline__ uint4 ld_act(const void* p) {
  if constexpr (FRESH) {
    uint4 r;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
  } else {
    return ld_cached(p);
  }
}

// One half-precision element, as ld_act.
template <typename T, bool FRESH>
__device__ __forceinline__ float ld_act1(const T* p) {
  if constexpr (FRESH) {
    unsigned short r;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return to_float<T>(*reinterpret_cast<const T*>(&r));
  } else {
    return to_float<T>(*p);
  }
}

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
  int prefetch_blocks;        // blocks (in launch order) that warm L2: the first wave, see first_wave_blocks
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

// One output element from its accumulated value(s): SiLU(gate) * up, or + bias, then + residual with the
// roundings of the unfused model (the projection rounded to T, then the sum), or weight 0's conv token.
// FRESH: the residual was written earlier in the same kernel.
template <typename T, Epilogue EPI, bool FRESH = false>
__device__ __forceinline__ void store_out(const GemvArgs<T>& a, int wi, int row, int col, float v, float up) {
  if (row >= a.n[wi] || col >= a.m) return;
  const size_t o = (size_t)col * a.n[wi] + row;
  if constexpr (EPI == Epilogue::SiluMul) {
    v = silu(v) * up;
  } else {
    if (a.bias[wi]) v += to_float<T>(a.bias[wi][row]);
    if (a.residual) {
      v = round_to<T>(v) + ld_act1<T, FRESH>(a.residual + o);
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

constexpr int kWarps = 8;        // warps per block

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

constexpr int kBulkChunkBytes = 32 * 1024;  // weight bytes per slot, at most

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
// FRESH: x was written earlier in the same kernel.
template <typename T, int MAXM, bool FRESH = false>
__device__ __forceinline__ void stage_x(const GemvArgs<T>& a, T* __restrict__ xs, float (*scratch)[32], uint4 w0) {
  if (a.norm_w == nullptr) {
    for (int i = threadIdx.x; i < a.m * a.k / 8; i += kWarps * 32)
      reinterpret_cast<uint4*>(xs)[i] = ld_act<FRESH>(a.x + (size_t)i * 8);
    return;
  }
  constexpr int kStride = kWarps * 32 * 8;  // columns between a thread's stretches
  const int i0 = threadIdx.x * 8;
  uint4 first[MAXM];  // [row]: the thread's first 8 columns of each row
#pragma unroll
  for (int r = 0; r < MAXM; ++r)
    first[r] = r < a.m && i0 < a.k ? ld_act<FRESH>(a.x + (size_t)r * a.k + i0) : make_uint4(0, 0, 0, 0);
  float ss[MAXM];
#pragma unroll
  for (int r = 0; r < MAXM; ++r) {
    float v[8];
    unpack8<T>(first[r], v);
    ss[r] = add_squares8(v, 0.f);
    if (r < a.m)
      for (int i = i0 + kStride; i < a.k; i += kStride) {  // rows wider than 2048: the rest as they are, for now
        const uint4 u = ld_act<FRESH>(a.x + (size_t)r * a.k + i);
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

}  // namespace segki
