// What a phase boundary costs (benchmarks/launch_vs_barrier.py), for the plan of one persistent kernel per
// decoder layer: `phases` phases, each streaming its own `n16` 16-byte words of `buf` (a weight's read) over the
// whole grid, separated either by kernel launches (with or without programmatic dependent launch, as every
// native kernel of the decode step is launched) or by grid-wide barriers inside one kernel (hand-rolled on an
// arrival counter, or cooperative groups' grid.sync()), and the arrival-counter kernel again with its loads
// streamed ahead into shared memory by the copy engine across the barriers.
#include <cooperative_groups.h>

#include "bulk.cuh"
#include "common.cuh"

namespace segki_bench {
namespace {

using segki::ld_stream;

constexpr int kThreads = 256;

// Grid-wide barrier of a persistent kernel on bar[0] (arrivals, back to 0 after every barrier) and bar[1] (the
// generation): every block arrives before any leaves, and writes before it are visible after it. All blocks
// must be resident at once (grid <= SMs, one block each), and one kernel at a time may use `bar`.
__device__ __forceinline__ void grid_barrier(unsigned* bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    volatile unsigned* gen = bar + 1;
    const unsigned g = *gen;  // read before arriving: it cannot move before this block has arrived
    __threadfence();          // this block's writes before its arrival
    if (atomicAdd(bar, 1u) == gridDim.x - 1) {
      atomicExch(bar, 0u);
      __threadfence();
      atomicAdd(bar + 1, 1u);
    } else {
      while (*gen == g) {
      }
    }
    __threadfence();
  }
  __syncthreads();
}

// This block's contiguous share of the phase's words, folded into one value (kept by the caller).
__device__ __forceinline__ unsigned stream_share(const uint4* __restrict__ buf, size_t n16) {
  const size_t per = (n16 + gridDim.x - 1) / gridDim.x;
  const size_t lo = min(n16, per * blockIdx.x), hi = min(n16, lo + per);
  unsigned acc = 0;
#pragma unroll 4
  for (size_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const uint4 v = ld_stream(buf + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  return acc;
}

// A value no buffer of zeros folds to: the store never happens, but the compiler must keep the loads.
__device__ __forceinline__ void keep(unsigned acc, unsigned* sink) {
  if (acc == 0x9E3779B9u) sink[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kThreads) phase_kernel(const uint4* __restrict__ buf, size_t n16, unsigned* sink) {
  segki::pdl_launch_dependents();
  segki::pdl_wait();  // a phase reads what the previous one wrote
  keep(stream_share(buf, n16), sink);
}

template <bool COOPERATIVE>
__global__ void __launch_bounds__(kThreads) persistent_kernel(const uint4* __restrict__ buf, size_t n16, int phases,
                                                              unsigned* bar, unsigned* sink) {
  unsigned acc = 0;
  for (int p = 0; p < phases; ++p) {
    if (p > 0) {
      if constexpr (COOPERATIVE) cooperative_groups::this_grid().sync();
      else grid_barrier(bar);
    }
    acc ^= stream_share(buf + (size_t)p * n16, n16);
  }
  keep(acc, sink);
}

// ---- the same persistent kernel with each block's weight share streamed into shared memory by the copy engine
// (cp.async.bulk, completion on an mbarrier per slot) through a ring of kSlots slots of kChunk bytes, issued as
// slots free up regardless of phase: the next phase's first chunks are in flight while the block waits at the
// barrier. What a persistent decode kernel could do, since weights never depend on the previous phase.
constexpr int kSlots = 4;
constexpr int kChunkWords = 2048;  // 32 KB per slot, 128 KB of copies in flight per SM

using segki::bulk_fence_init;
using segki::bulk_fence_reuse;
using segki::mbar_init;
using segki::mbar_wait;

// Copies `bytes` from global `src` to shared `dst`; `bar` completes when they have landed.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  segki::mbar_expect(bar, bytes);
  segki::bulk_load(dst, src, bytes, bar);
}

// A block's contiguous share of each of `phases` phases of `n16` words, streamed through a ring of SLOTS slots
// as one sequence of chunks whatever the phase: a slot is refilled as soon as it is read, so the first chunks of
// phase p + 1 are in flight while the block still computes or waits on phase p.
template <int SLOTS>
struct BulkStream {
  uint4* ring;      // [SLOTS][kChunkWords], shared
  uint64_t* full;   // [SLOTS] mbarriers, shared
  const uint4* buf;
  size_t n16, lo, share;
  int chunks, total;  // per phase, in all

  __device__ BulkStream(uint4* ring_, uint64_t* full_, const uint4* buf_, size_t n16_, int phases)
      : ring(ring_), full(full_), buf(buf_), n16(n16_) {
    const size_t per = (n16 + gridDim.x - 1) / gridDim.x;
    lo = min(n16, per * blockIdx.x);
    share = min(n16, lo + per) - lo;
    chunks = (int)((share + kChunkWords - 1) / kChunkWords);
    total = chunks * phases;
  }
  __device__ unsigned words(int i) const { return (unsigned)min((size_t)kChunkWords, share - (size_t)i * kChunkWords); }
  __device__ void issue(int c) const {  // chunk c: phase c / chunks, part c % chunks
    const int p = c / chunks, i = c % chunks;
    bulk_copy(ring + (c % SLOTS) * kChunkWords, buf + (size_t)p * n16 + lo + (size_t)i * kChunkWords, words(i) * 16,
              &full[c % SLOTS]);
  }
  // The barriers and the first SLOTS chunks (thread 0); every thread must pass a __syncthreads() before consume.
  __device__ void start() const {
    if (threadIdx.x != 0) return;
    for (int s = 0; s < SLOTS; ++s) mbar_init(&full[s]);
    bulk_fence_init();
    for (int c = 0; c < min(SLOTS, total); ++c) issue(c);
  }
  // Phase p's chunks folded into one value, each slot refilled with the chunk SLOTS further on once read.
  __device__ unsigned consume(int p) const {
    unsigned acc = 0;
    for (int i = 0; i < chunks; ++i) {
      const int c = p * chunks + i, slot = c % SLOTS;
      mbar_wait(&full[slot], (unsigned)(c / SLOTS) & 1u);
      const uint4* src = ring + slot * kChunkWords;
      for (unsigned w = threadIdx.x; w < words(i); w += kThreads) {
        const uint4 v = src[w];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
      }
      __syncthreads();  // every thread is done with the slot
      if (threadIdx.x == 0 && c + SLOTS < total) {
        bulk_fence_reuse();  // our reads before the copy engine's write
        issue(c + SLOTS);
      }
    }
    return acc;
  }
};

template <bool COOPERATIVE>
__global__ void __launch_bounds__(kThreads) bulk_persistent_kernel(const uint4* __restrict__ buf, size_t n16,
                                                                   int phases, unsigned* bar, unsigned* sink) {
  extern __shared__ __align__(128) uint4 ring[];  // [kSlots][kChunkWords]
  __shared__ __align__(8) uint64_t full[kSlots];
  const BulkStream<kSlots> s(ring, full, buf, n16, phases);
  s.start();
  __syncthreads();
  unsigned acc = 0;
  for (int p = 0; p < phases; ++p) {
    if (p > 0) {  // the copies issued for this phase stay in flight meanwhile
      if constexpr (COOPERATIVE) cooperative_groups::this_grid().sync();
      else grid_barrier(bar);
    }
    acc ^= s.consume(p);
  }
  keep(acc, sink);
}

// ---- one launch per phase again, each kernel's share streamed through a ring of kPhaseSlots slots whose first
// chunks are issued before the PDL wait: what a decode GEMV could do on its own, since its weights never depend
// on the previous kernel. 96 KB per block, so a block of the next kernel fits on the SM beside one of this
// kernel and starts its copies while this one finishes.
constexpr int kPhaseSlots = 3;

__global__ void __launch_bounds__(kThreads) bulk_phase_kernel(const uint4* __restrict__ buf, size_t n16,
                                                              unsigned* sink) {
  extern __shared__ __align__(128) uint4 ring[];  // [kPhaseSlots][kChunkWords]
  __shared__ __align__(8) uint64_t full[kPhaseSlots];
  const BulkStream<kPhaseSlots> s(ring, full, buf, n16, 1);
  s.start();  // weights only: safe before the wait
  segki::pdl_launch_dependents();
  __syncthreads();
  segki::pdl_wait();
  keep(s.consume(0), sink);
}

void launch(void (*kernel)(const uint4*, size_t, unsigned*), int blocks, bool pdl, int smem, const uint4* buf,
            size_t n16, unsigned* sink, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, buf, n16, sink));
}

void check(const at::Tensor& buf, int64_t phases, int64_t blocks, const at::Tensor& sink) {
  TORCH_CHECK(buf.is_cuda() && buf.is_contiguous() && buf.nbytes() % (16 * phases) == 0,
              "buf must be a contiguous CUDA tensor of phases x 16-byte words");
  TORCH_CHECK(sink.is_cuda() && sink.scalar_type() == at::kInt && sink.numel() >= blocks,
              "sink must be an int32 CUDA tensor of at least `blocks` values");
  TORCH_CHECK(phases >= 1 && blocks >= 1, "phases and blocks must be positive");
}

// `phases` launches of one kernel, each streaming the next slice of buf: plain loads, or (`bulk`) the copy-engine
// ring whose first chunks are issued before the PDL wait (always launched with PDL).
void launches(const at::Tensor& buf, int64_t phases, int64_t blocks, bool pdl, bool bulk, at::Tensor& sink) {
  check(buf, phases, blocks, sink);
  const size_t n16 = buf.nbytes() / 16 / phases;
  const auto* base = reinterpret_cast<const uint4*>(buf.data_ptr());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int smem = bulk ? kPhaseSlots * kChunkWords * 16 : 0;
  if (bulk)
    C10_CUDA_CHECK(cudaFuncSetAttribute(bulk_phase_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  for (int64_t p = 0; p < phases; ++p)
    launch(bulk ? bulk_phase_kernel : phase_kernel, (int)blocks, pdl || bulk, smem, base + p * n16, n16,
           reinterpret_cast<unsigned*>(sink.data_ptr()), stream);
}

// One kernel of `phases` phases, its loads plain or through the bulk-copy ring (`bulk`), its barrier the
// arrival counter or cooperative groups' (`cooperative`); bar: two int32 zeros (left zeroed by every run).
void run_persistent(const at::Tensor& buf, int64_t phases, int64_t blocks, bool bulk, bool cooperative,
                    at::Tensor& bar, at::Tensor& sink) {
  check(buf, phases, blocks, sink);
  TORCH_CHECK(bar.is_cuda() && bar.scalar_type() == at::kInt && bar.numel() >= 2, "bar must be 2 int32 values");
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  TORCH_CHECK(blocks <= sms, "a grid barrier needs every block resident: at most ", sms, " blocks (one per SM)");
  using Kernel = void (*)(const uint4*, size_t, int, unsigned*, unsigned*);
  const Kernel kernel = bulk ? (cooperative ? bulk_persistent_kernel<true> : bulk_persistent_kernel<false>)
                             : (cooperative ? persistent_kernel<true> : persistent_kernel<false>);
  const int smem = bulk ? kSlots * kChunkWords * 16 : 0;
  if (bulk) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)blocks);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = cooperative ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, reinterpret_cast<const uint4*>(buf.data_ptr()),
                                    buf.nbytes() / 16 / phases, (int)phases,
                                    reinterpret_cast<unsigned*>(bar.data_ptr()),
                                    reinterpret_cast<unsigned*>(sink.data_ptr())));
}

void persistent(const at::Tensor& buf, int64_t phases, int64_t blocks, bool cooperative, at::Tensor& bar,
                at::Tensor& sink) {
  run_persistent(buf, phases, blocks, false, cooperative, bar, sink);
}

void persistent_bulk(const at::Tensor& buf, int64_t phases, int64_t blocks, bool cooperative, at::Tensor& bar,
                     at::Tensor& sink) {
  run_persistent(buf, phases, blocks, true, cooperative, bar, sink);
}

}  // namespace

TORCH_LIBRARY(segki_bench, m) {
  m.def("launches(Tensor buf, int phases, int blocks, bool pdl, bool bulk, Tensor(a!) sink) -> ()");
  m.def("persistent(Tensor buf, int phases, int blocks, bool cooperative, Tensor(a!) bar, Tensor(b!) sink) -> ()");
  m.def("persistent_bulk(Tensor buf, int phases, int blocks, bool cooperative, Tensor(a!) bar, Tensor(b!) sink) -> ()");
}

TORCH_LIBRARY_IMPL(segki_bench, CUDA, m) {
  m.impl("launches", &launches);
  m.impl("persistent", &persistent);
  m.impl("persistent_bulk", &persistent_bulk);
}

}  // namespace segki_bench
