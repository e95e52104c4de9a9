// Copies from global to shared memory by the copy engine (sm_90 cp.async.bulk), each completing on an mbarrier:
// a block can have a weight's bytes in flight without a register per load, and before the PDL wait, since
// weights do not depend on the previous kernel. And back (bulk_store): a block's result leaves shared memory
// without a store instruction per element (the GDN recurrence's state). Measured: a block streaming a long
// share through a ring of 16-32 KB slots reaches 104-110 % of copy bandwidth, one to eight blocks per SM alike
// (`results/bulk_grid/stream/`); a GEMV built as one block per SM over such a ring did not
// (`results/bulk_gemv/`), one built as one block per chunk requested before the PDL wait wins on the 0.8B shapes
// (`results/bulk_grid/`).
#pragma once

#include <cstdint>

namespace segki {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// An mbarrier whose phase completes after `arrivals` arrivals (one: the thread that issues the copies) plus the
// bytes they expect. Make it visible to the copy engine with bulk_fence_init() before the first copy.
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned arrivals = 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
#endif
}

__device__ __forceinline__ void bulk_fence_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// Blocks until phase `parity` of `bar` has completed (all its bytes landed). CLUSTER: acquiring at cluster scope
// what other blocks of the cluster stored onto it (st.async), not only the copy engine's bytes.
template <bool CLUSTER = false>
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned done = 0;
  while (!done) {
    if constexpr (CLUSTER) {
      asm volatile(
          "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
          "selp.u32 %0, 1, 0, p;\n\t}"
          : "=r"(done)
          : "r"(smem_addr(bar)), "r"(parity)
          : "memory");
    } else {
      asm volatile(
          "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
          : "=r"(done)
          : "r"(smem_addr(bar)), "r"(parity)
          : "memory");
    }
  }
#endif
}

// Arrives on `bar` (a consumer done with a slot, on the barrier its producer waits on before refilling it).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
#endif
}

// Arrives on `bar` expecting `bytes` more: the total of the copies that follow on it for this phase.
__device__ __forceinline__ void mbar_expect(uint64_t* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global `src` to shared `dst`, counted
// on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
#endif
}

// An L2 policy for bytes read once per step (the weights): evicted first, so that streaming ~1-2 GB of them a step
// does not push out of L2 what the step reads again -- the kernels' code, activations, states, cache rows. On the
// skinny product's copies: 0.8B decode b=1 +3.5 %, b=4 +2.7 %, 4B b=1 +1.5 % (results/evict_first/).
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t policy = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
#endif
  return policy;
}

// bulk_load with an L2 policy (from l2_evict_first()).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, uint64_t* bar, uint64_t policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
#endif
}

// Orders this thread's earlier accesses of shared memory (after a __syncthreads(), the block's) before the copy
// engine's: a copy that writes the same bytes, or one that reads what the thread wrote.
__device__ __forceinline__ void bulk_fence_reuse() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from shared `src` to global `dst` by the copy
// engine, in this thread's current bulk group. The block's writes of `src` must be made visible to the copy
// engine first: each writer's bulk_fence_reuse(), then a barrier.
__device__ __forceinline__ void bulk_store(void* dst, const void* src, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_addr(src)),
               "r"(bytes)
               : "memory");
#endif
}

// Closes this thread's current bulk group of stores.
__device__ __forceinline__ void bulk_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}

// Blocks until this thread's committed bulk groups have finished reading their shared memory (it may be
// overwritten), or with `writes` until their global writes are done too (needed before the block exits).
template <bool writes>
__device__ __forceinline__ void bulk_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (writes) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  else asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
#endif
}

}  // namespace segki
