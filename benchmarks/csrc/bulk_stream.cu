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
//   kStore     kRing where every warp's lane 0 also stores one word to global memory per slot before the block
//              barrier, as the GEMV stores its outputs (the refill's proxy fence compiles to MEMBAR.ALL.CTA: if
//              that waits for the issuing warp's stores, each refill pays a round trip);
//   kStoreNoFence  kStore whose refill has no proxy fence (the block barrier alone orders the reads before it);
//   kLoads     no copy engine: each thread loads 4 x 16 bytes of every chunk (chunk = 16 KB) into registers, all
//              four in flight before it folds them (the register path's rate on the same share, for reference).
#include "bulk.cuh"
#include "common.cuh"

namespace segki_bench {
namespace {

using namespace segki;

constexpr int kThreads = 256;
constexpr int kMaxSlots = 16;
enum Mode { kRing = 0, kPoll = 1, kProducer = 2, kSplit4 = 3, kLoads = 4, kStore = 5, kStoreNoFence = 6 };

__device__ __forceinline__ bool mbar_test(uint64_t* bar, unsigned parity) {
  unsigned done;
  asm volatile(
      "{\n\t.reg .pred p;\n\tmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
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

template <int MODE>
__global__ void __launch_bounds__(kThreads) stream_kernel(const uint4* __restrict__ buf, size_t per_block16,
                                                          int slots, int chunk16, unsigned* sink) {
  extern __shared__ __align__(128) uint4 ring[];  // [slots][chunk16]
  __shared__ __align__(8) uint64_t full[kMaxSlots];
  __shared__ __align__(8) uint64_t empty[kMaxSlots];
  const uint4* src = buf + blockIdx.x * per_block16;
  const int chunks = (int)(per_block16 / chunk16);
  const int warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) {
      mbar_init(&full[s]);
      mbar_init(&empty[s], kThreads / 32 - 1);
    }
    bulk_fence_init();
  }
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
  if (acc == 0x9E3779B9u) sink[blockIdx.x] = acc;  // never for zeros: only keeps the loads
}

// `blocks` blocks each stream `buf.nbytes() / blocks` bytes through `slots` slots of `chunk_bytes`.
void stream(const at::Tensor& buf, int64_t mode, int64_t blocks, int64_t slots, int64_t chunk_bytes,
            at::Tensor& sink) {
  TORCH_CHECK(buf.is_cuda() && buf.is_contiguous(), "buf must be a contiguous CUDA tensor");
  TORCH_CHECK(sink.is_cuda() && sink.scalar_type() == at::kInt && sink.numel() >= blocks * (kThreads / 32) * 2,
              "sink: >= 16 int32 per block");
  TORCH_CHECK(mode >= 0 && mode <= 6 && slots >= 1 && slots <= kMaxSlots && chunk_bytes % 64 == 0,
              "mode 0-6, 1-16 slots, chunk a multiple of 64 bytes");
  TORCH_CHECK(mode != kLoads || chunk_bytes == kThreads * 64, "loads: the chunk is one round, 16 KB");
  const size_t per_block16 = buf.nbytes() / 16 / blocks / (chunk_bytes / 16) * (chunk_bytes / 16);
  TORCH_CHECK(per_block16 > 0, "buf too small for one chunk per block");
  const int smem = mode == kLoads ? 0 : (int)(slots * chunk_bytes);
  using Kernel = void (*)(const uint4*, size_t, int, int, unsigned*);
  const Kernel kernels[] = {stream_kernel<kRing>, stream_kernel<kPoll>, stream_kernel<kProducer>,
                            stream_kernel<kSplit4>, stream_kernel<kLoads>,
                            stream_kernel<kStore>, stream_kernel<kStoreNoFence>};
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
