// How fast one block streams a long contiguous share through the copy engine (benchmarks/bulk_stream.py): the
// steady state the copy-engine GEMV met (`results/bulk_gemv/`: one slot per ~1.5 us whatever the slot or ring
// size), apart from any dot product. Each block streams its share through a ring of `slots` slots of `chunk16`
// 16-byte words, its threads folding every word into one value; the modes differ in who waits and who refills:
//   kRing      thread 0 issues one copy per slot; everyone waits (try_wait), reads, meets at a block barrier;
//              thread 0 refills the slot (the GEMV's order);
//   kPoll      the same, waiting with test_wait polls instead of try_wait;
//   kProducer  warp 0 only issues: it refills a slot as soon as the 7 reading warps have arrived on the slot's
//              `empty` barrier, with no block barrier (the warp-specialized pipeline);
//   kSplit4    kRing with each slot filled by four copies from four lanes;
//   kRows      kRing with each slot filled as the removed tensor-core layer tail filled one (results/mma_ring/):
//              16 copies from lanes 0-15, each one row's part of a tile -- the share read as rows of 4 parts of
//              chunk / 16 bytes, slot c holding part c % 4 of rows 16 (c / 4) .. 16 (c / 4) + 15 (at 20 KB slots,
//              the 4B gate|up's 1280-byte copies at a 5120-byte row stride);
//   kStore     kRing where every warp's lane 0 also stores one word to global memory per slot before the block
//              barrier, as the GEMV stores its outputs (the refill's proxy fence compiles to MEMBAR.ALL.CTA: if
//              that waits for the issuing warp's stores, each refill pays a round trip);
//   kStoreNoFence  kStore whose refill has no proxy fence (the block barrier alone orders the reads before it);
//   kLoads     no copy engine: each thread loads 4 x 16 bytes of every chunk (chunk = 16 KB) into registers, all
//              four in flight before it folds them (the register path's rate on the same share, for reference);
//   kDotRow    kRing whose readers do the one-row GEMV's work instead of the fold: the slot holds bf16 rows of
//              kDotK = 2560 (the 4B hidden size), each warp takes whole rows (warp, warp + 8, ...) and sums
//              row . x (x staged in shared memory) lane by lane, 8 dependent FMAs per 16 bytes, then warp-sums
//              and stores it, as gemv_bulk_kernel did with 6 rows per 30 KB slot;
//   kDotSpread the same products with every warp on every row (warp w takes the row's stretches w, w + 8, ...),
//              the 8 warps' parts summed through shared memory: one row's chain split eight ways;
//   kDotMma    the one-row GEMV on the tensor cores: a 32 KB slot is one 16-row tile of kMmaK = 1024 columns, each
//              warp takes an eighth of the columns as mma.m16n8k16 steps (x the one useful column of B), and the
//              warps' partial rows meet in shared memory: ~20 instructions per warp and slot where kDotRow issues
//              ~250, so whether the per-slot work or the copies bound a one-block-per-SM ring shows here.
// If kDotRow costs ~1.5 us per slot and kDotSpread does not, the GEMV's per-slot cost was its per-warp row chain.
#include "bulk.cuh"
#include "common.cuh"

namespace segki_bench {
namespace {

using namespace segki;

constexpr int kThreads = 256;
constexpr int kMaxSlots = 16;
enum Mode {
  kRing = 0, kPoll = 1, kProducer = 2, kSplit4 = 3, kLoads = 4, kStore = 5, kStoreNoFence = 6, kDotRow = 7,
  kDotSpread = 8, kDotMma = 9, kRows = 10
};
constexpr int kDotK = 2560;
constexpr int kDotMaxRows = 8;  // rows per slot in the dot modes: a slot of at most 40 KB
constexpr int kMmaK = 1024;     // kDotMma: a 32 KB slot is 16 rows of 1024 bf16 (the 0.8B projections' K)

// The columns of x a mode stages in shared memory after the ring (none for the modes without products).
constexpr int x_cols(int mode) {
  return mode == kDotRow || mode == kDotSpread ? kDotK : mode == kDotMma ? kMmaK : 0;
}

__device__ __forceinline__ bool mbar_test(uint64_t* bar, unsigned parity) {
  unsigned done;
  asm volatile(
      "{\n\t.reg .pred p;\n\tmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Chunk c of the block's share into its slot: one copy, or (kSplit4) four from lanes 0-3 of the calling warp
// (lane 0 arms the barrier for all four first).
template <int MODE>
__device__ __forceinline__ void issue(uint4* ring, uint64_t* full, const uint4* src, int c, int slots, int chunk16) {
  const int slot = c % slots;
  uint4* dst = ring + (size_t)slot * chunk16;
  const uint4* from = src + (size_t)c * chunk16;
  const int lane = threadIdx.x & 31;
  if constexpr (MODE == kSplit4) {
    const int q = chunk16 / 4;
    if (lane == 0) mbar_expect(&full[slot], chunk16 * 16);
    __syncwarp();
    if (lane < 4) bulk_load(dst + lane * q, from + lane * q, q * 16, &full[slot]);
  } else if constexpr (MODE == kRows) {
    const int piece = chunk16 / 16, row16 = 4 * piece;  // 16-byte words per copy and per row
    const uint4* tile = src + (size_t)(c / 4) * 16 * row16 + (c % 4) * piece;
    if (lane == 0) mbar_expect(&full[slot], chunk16 * 16);
    __syncwarp();
    if (lane < 16) bulk_load(dst + lane * piece, tile + (size_t)lane * row16, piece * 16, &full[slot]);
  } else if (lane == 0) {
    mbar_expect(&full[slot], chunk16 * 16);
    bulk_load(dst, from, chunk16 * 16, &full[slot]);
  }
}

__device__ __forceinline__ unsigned fold(const uint4* p, int n16, int first, int stride) {
  unsigned acc = 0;
  for (int w = first; w < n16; w += stride) {
    const uint4 v = p[w];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  return acc;
}

// row . x over the 16-byte words first, first + stride, ... of a kDotK row, one lane's part, in order.
__device__ __forceinline__ float dot_part(const uint4* row, const uint4* x, int first, int stride) {
  float a = 0.f;
#pragma unroll 4
  for (int w = first; w < kDotK / 8; w += stride) {
    float wf[8], xf[8];
    unpack8<__nv_bfloat16>(row[w], wf);
    unpack8<__nv_bfloat16>(x[w], xf);
#pragma unroll
    for (int e = 0; e < 8; ++e) a = fmaf(wf[e], xf[e], a);
  }
  return a;
}

// The dot modes' work on one slot of `rows` rows; lane 0 of a warp that finishes a row stores it.
template <int MODE>
__device__ __forceinline__ void dot_slot(const uint4* slot, const uint4* x, int rows, float (*red)[2 * kDotMaxRows],
                                         unsigned* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if constexpr (MODE == kDotRow) {
    for (int r = warp; r < rows; r += kThreads / 32) {
      const float a = warp_sum(dot_part(slot + (size_t)r * (kDotK / 8), x, lane, 32));
      if (lane == 0) out[warp] = __float_as_uint(a);
    }
  } else {
    for (int r = 0; r < rows; ++r) {
      const float a = warp_sum(dot_part(slot + (size_t)r * (kDotK / 8), x, warp * 32 + lane, kThreads));
      if (lane == 0) red[warp][r] = a;
    }
    __syncthreads();
    if (warp == 0 && lane < rows) {
      float a = 0.f;
      for (int w = 0; w < kThreads / 32; ++w) a += red[w][lane];
      out[lane] = __float_as_uint(a);
    }
  }
}

// kDotMma's work on one slot: rows g and g + 8 of the tile, 8 consecutive columns per lane and 32-column block,
// in the fragment slots {2t, 2t+1, 2t+8, 2t+9} of two k-steps with x permuted alike (gemv.cu's tensor-core
// order); C's column 0 (lanes t == 0) holds the rows' partial sums. Lane r of warp 0 stores row r.
__device__ __forceinline__ void mma_slot(const uint4* slot, const uint4* x, float (*red)[2 * kDotMaxRows],
                                         unsigned* out) {
  constexpr int kWords = kMmaK / 8;                     // 16-byte words per row
  constexpr int kBlocks = kMmaK / 32 / (kThreads / 32);  // 32-column blocks per warp
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int kb = 0; kb < kBlocks; ++kb) {
    const int w = (warp * kBlocks + kb) * 4 + t;
    const uint4 lo = slot[g * kWords + w], hi = slot[(g + 8) * kWords + w];
    const uint4 xv = g == 0 ? x[w] : make_uint4(0, 0, 0, 0);
    mma16816<__nv_bfloat16>(c, lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
    mma16816<__nv_bfloat16>(c, lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
  }
  if (t == 0) {
    red[warp][g] = c[0];
    red[warp][g + 8] = c[2];
  }
  __syncthreads();
  if (warp == 0 && lane < 16) {
    float a = 0.f;
    for (int v = 0; v < kThreads / 32; ++v) a += red[v][lane];
    out[lane] = __float_as_uint(a);
  }
}

template <int MODE>
__global__ void __launch_bounds__(kThreads) stream_kernel(const uint4* __restrict__ buf, size_t per_block16,
                                                          int slots, int chunk16, unsigned* sink) {
  extern __shared__ __align__(128) uint4 ring[];  // [slots][chunk16], then x [x_cols(MODE) / 8]
  __shared__ __align__(8) uint64_t full[kMaxSlots];
  __shared__ float red[kThreads / 32][2 * kDotMaxRows];
  __shared__ __align__(8) uint64_t empty[kMaxSlots];
  const uint4* src = buf + blockIdx.x * per_block16;
  const int chunks = (int)(per_block16 / chunk16) / (MODE == kRows ? 4 : 1) * (MODE == kRows ? 4 : 1);  // kRows: whole tiles
  const int warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) {
      mbar_init(&full[s]);
      mbar_init(&empty[s], kThreads / 32 - 1);
    }
    bulk_fence_init();
  }
  constexpr bool kDot = MODE == kDotRow || MODE == kDotSpread;
  uint4* xs = ring + (size_t)slots * chunk16;
  for (int i = threadIdx.x; i < x_cols(MODE) / 8; i += kThreads) xs[i] = src[i];
  __syncthreads();
  unsigned acc = 0;
  if constexpr (MODE == kLoads) {
    for (int c = 0; c < chunks; ++c) {
      const uint4* p = src + (size_t)c * chunk16 + threadIdx.x;
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = __ldg(p + u * kThreads);
#pragma unroll
      for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  } else if constexpr (MODE == kProducer) {
    if (warp == 0) {
      for (int c = 0; c < chunks; ++c) {
        if (c >= slots) mbar_wait(&empty[c % slots], (unsigned)(c / slots - 1) & 1u);
        bulk_fence_reuse();
        issue<MODE>(ring, full, src, c, slots, chunk16);
      }
    } else {
      for (int c = 0; c < chunks; ++c) {
        const int slot = c % slots;
        mbar_wait(&full[slot], (unsigned)(c / slots) & 1u);
        acc ^= fold(ring + (size_t)slot * chunk16, chunk16, threadIdx.x - 32, kThreads - 32);
        __syncwarp();
        if ((threadIdx.x & 31) == 0) mbar_arrive(&empty[slot]);
      }
    }
  } else {
    if (warp == 0)
      for (int c = 0; c < min(slots, chunks); ++c) issue<MODE>(ring, full, src, c, slots, chunk16);
    for (int c = 0; c < chunks; ++c) {
      const int slot = c % slots;
      const unsigned parity = (unsigned)(c / slots) & 1u;
      if constexpr (MODE == kPoll) {
        while (!mbar_test(&full[slot], parity)) {
        }
      } else {
        mbar_wait(&full[slot], parity);
      }
      if constexpr (kDot)
        dot_slot<MODE>(ring + (size_t)slot * chunk16, xs, chunk16 * 8 / kDotK, red,
                       sink + (size_t)blockIdx.x * (kThreads / 32) * 2);
      else if constexpr (MODE == kDotMma)
        mma_slot(ring + (size_t)slot * chunk16, xs, red, sink + (size_t)blockIdx.x * (kThreads / 32) * 2);
      else
        acc ^= fold(ring + (size_t)slot * chunk16, chunk16, threadIdx.x, kThreads);
      if constexpr (MODE == kStore || MODE == kStoreNoFence)
        if ((threadIdx.x & 31) == 0) sink[(blockIdx.x * (kThreads / 32) + warp) * 2 + (c & 1)] = acc;
      __syncthreads();  // every thread is done with the slot
      if (warp == 0 && c + slots < chunks) {
        if constexpr (MODE != kStoreNoFence) bulk_fence_reuse();
        issue<MODE>(ring, full, src, c + slots, slots, chunk16);
      }
    }
  }
  if (acc == 0x9E3779B9u) sink[blockIdx.x] = acc;  // (almost) never: only keeps the loads
}

// `blocks` blocks each stream `buf.nbytes() / blocks` bytes through `slots` slots of `chunk_bytes`.
void stream(const at::Tensor& buf, int64_t mode, int64_t blocks, int64_t slots, int64_t chunk_bytes,
            at::Tensor& sink) {
  TORCH_CHECK(buf.is_cuda() && buf.is_contiguous(), "buf must be a contiguous CUDA tensor");
  TORCH_CHECK(sink.is_cuda() && sink.scalar_type() == at::kInt && sink.numel() >= blocks * (kThreads / 32) * 2,
              "sink: >= 16 int32 per block");
  TORCH_CHECK(mode >= 0 && mode <= 10 && slots >= 1 && slots <= kMaxSlots && chunk_bytes % 64 == 0,
              "mode 0-10, 1-16 slots, chunk a multiple of 64 bytes");
  TORCH_CHECK(mode != kDotMma || chunk_bytes == 16 * kMmaK * 2, "dot_mma: the chunk is 16 rows of ", kMmaK, " bf16");
  TORCH_CHECK(mode != kRows || chunk_bytes % 256 == 0, "rows: the chunk is 16 copies of a multiple of 16 bytes");
  TORCH_CHECK(mode != kLoads || chunk_bytes == kThreads * 64, "loads: the chunk is one round, 16 KB");
  const bool dot = mode == kDotRow || mode == kDotSpread;
  TORCH_CHECK(!dot || (chunk_bytes % (kDotK * 2) == 0 && chunk_bytes / (kDotK * 2) <= kDotMaxRows),
              "dot modes: the chunk is 1-8 whole rows of ", kDotK, " bf16");
  const size_t per_block16 = buf.nbytes() / 16 / blocks / (chunk_bytes / 16) * (chunk_bytes / 16);
  TORCH_CHECK(per_block16 > 0, "buf too small for one chunk per block");
  const int smem = mode == kLoads ? 0 : (int)(slots * chunk_bytes) + x_cols((int)mode) * 2;
  using Kernel = void (*)(const uint4*, size_t, int, int, unsigned*);
  const Kernel kernels[] = {stream_kernel<kRing>, stream_kernel<kPoll>, stream_kernel<kProducer>,
                            stream_kernel<kSplit4>, stream_kernel<kLoads>,
                            stream_kernel<kStore>, stream_kernel<kStoreNoFence>, stream_kernel<kDotRow>,
                            stream_kernel<kDotSpread>, stream_kernel<kDotMma>, stream_kernel<kRows>};
  const Kernel kernel = kernels[mode];
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<(unsigned)blocks, kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint4*>(buf.data_ptr()), per_block16, (int)slots, (int)(chunk_bytes / 16),
      reinterpret_cast<unsigned*>(sink.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY(segki_bulk_stream, m) {
  m.def("stream(Tensor buf, int mode, int blocks, int slots, int chunk_bytes, Tensor(a!) sink) -> ()");
}

TORCH_LIBRARY_IMPL(segki_bulk_stream, CUDA, m) { m.impl("stream", &stream); }

}  // namespace segki_bench
