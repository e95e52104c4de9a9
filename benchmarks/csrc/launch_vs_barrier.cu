// What a phase boundary costs (benchmarks/launch_vs_barrier.py), for the plan of one persistent kernel per
// decoder layer: `phases` phases, each streaming its own `n16` 16-byte words of `buf` (a weight's read) over the
// whole grid, separated either by kernel launches (with or without programmatic dependent launch, as every
// native kernel of the decode step is launched) or by grid-wide barriers inside one kernel (hand-rolled on an
// arrival counter, or cooperative groups' grid.sync()), and the arrival-counter kernel again with its loads
// streamed ahead into shared memory by the copy engine across the barriers.
#include <cooperative_groups.h>

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

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  unsigned done = 0;
  while (!done) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  }
}

// Copies `bytes` (a multiple of 16) from global `src` to shared `dst`; `bar` completes when they have landed.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

template <bool COOPERATIVE>
__global__ void __launch_bounds__(kThreads) bulk_persistent_kernel(const uint4* __restrict__ buf, size_t n16,
                                                                   int phases, unsigned* bar, unsigned* sink) {
  extern __shared__ __align__(128) uint4 ring[];  // [kSlots][kChunkWords]
  __shared__ __align__(8) uint64_t full[kSlots];
  const size_t per = (n16 + gridDim.x - 1) / gridDim.x;
  const size_t lo = min(n16, per * blockIdx.x), share = min(n16, lo + per) - lo;  // this block's words per phase
  const int chunks = (int)((share + kChunkWords - 1) / kChunkWords);              // per phase
  const int total = chunks * phases;
  auto words_of = [&](int i) { return (unsigned)min((size_t)kChunkWords, share - (size_t)i * kChunkWords); };
  auto issue = [&](int c) {  // chunk c of the block's stream: phase c / chunks, part c % chunks
    const int p = c / chunks, i = c % chunks;
    bulk_copy(ring + (c % kSlots) * kChunkWords, buf + (size_t)p * n16 + lo + (size_t)i * kChunkWords,
              words_of(i) * 16, &full[c % kSlots]);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kSlots; ++s) mbar_init(&full[s]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int c = 0; c < min(kSlots, total); ++c) issue(c);
  }
  __syncthreads();
  unsigned acc = 0;
  for (int p = 0; p < phases; ++p) {
    if (p > 0) {  // the copies issued for this phase stay in flight meanwhile
      if constexpr (COOPERATIVE) cooperative_groups::this_grid().sync();
      else grid_barrier(bar);
    }
    for (int i = 0; i < chunks; ++i) {
      const int c = p * chunks + i, slot = c % kSlots;
      mbar_wait(&full[slot], (unsigned)(c / kSlots) & 1u);
      const uint4* src = ring + slot * kChunkWords;
      for (unsigned w = threadIdx.x; w < words_of(i); w += kThreads) {
        const uint4 v = src[w];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
      }
      __syncthreads();  // every thread is done with the slot
      if (threadIdx.x == 0 && c + kSlots < total) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // our reads before the copy engine's write
        issue(c + kSlots);
      }
    }
  }
  keep(acc, sink);
}

void launch(void (*kernel)(const uint4*, size_t, unsigned*), int blocks, bool pdl, const uint4* buf, size_t n16,
            unsigned* sink, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kThreads);
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

// `phases` launches of one kernel, each streaming the next slice of buf.
void launches(const at::Tensor& buf, int64_t phases, int64_t blocks, bool pdl, at::Tensor& sink) {
  check(buf, phases, blocks, sink);
  const size_t n16 = buf.nbytes() / 16 / phases;
  const auto* base = reinterpret_cast<const uint4*>(buf.data_ptr());
  auto stream = at::cuda::getCurrentCUDAStream();
  for (int64_t p = 0; p < phases; ++p)
    launch(phase_kernel, (int)blocks, pdl, base + p * n16, n16, reinterpret_cast<unsigned*>(sink.data_ptr()),
           stream);
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
  m.def("launches(Tensor buf, int phases, int blocks, bool pdl, Tensor(a!) sink) -> ()");
  m.def("persistent(Tensor buf, int phases, int blocks, bool cooperative, Tensor(a!) bar, Tensor(b!) sink) -> ()");
  m.def("persistent_bulk(Tensor buf, int phases, int blocks, bool cooperative, Tensor(a!) bar, Tensor(b!) sink) -> ()");
}

TORCH_LIBRARY_IMPL(segki_bench, CUDA, m) {
  m.impl("launches", &launches);
  m.impl("persistent", &persistent);
  m.impl("persistent_bulk", &persistent_bulk);
}

}  // namespace segki_bench
