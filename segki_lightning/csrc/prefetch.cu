// ---- L2 warm-up of an upcoming op's operands (`segki::l2_prefetch`). At one row a decode step is a chain of
// ~8 small kernels per layer, each streaming 4-17 MB of weights; each pays its own ramp and tail, during which
// DRAM idles. Launched on a side branch of the captured step (segki_lightning/ops/ahead.py) while the op before
// runs, this kernel asks the copy engines for the next op's bytes, so that op reads them from L2. It writes
// nothing and reads nothing into registers: the results of every kernel are the same with or without it.
#include "common.cuh"

namespace segki {
namespace {

constexpr int64_t kPrefetchChunk = 16 << 10;  // bytes per bulk prefetch request
constexpr int kPrefetchBlocks = 8;           // a few warps issue the requests; the copy engines do the rest

// Chunk c goes to thread c % (blocks x 32); `p` is 16-byte aligned and `bytes` a multiple of 16.
__global__ void l2_prefetch_kernel(const char* __restrict__ p, int64_t bytes) {
  const int64_t chunks = (bytes + kPrefetchChunk - 1) / kPrefetchChunk;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; c < chunks; c += stride) {
    const int64_t off = c * kPrefetchChunk;
    const uint32_t n = (uint32_t)(bytes - off < kPrefetchChunk ? bytes - off : kPrefetchChunk);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(n) : "memory");
  }
}

// Warm L2 with the first `max_bytes` of `t`'s memory (from its first 16-byte boundary, whole 16-byte units), in
// plain stream order on the current stream: the caller chooses the stream (a side branch), so nothing waits on it.
void l2_prefetch(const at::Tensor& t, int64_t max_bytes) {
  TORCH_CHECK(t.is_cuda(), "segki::l2_prefetch: t must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), "segki::l2_prefetch: t must be contiguous (it warms one range of memory)");
  const auto start = reinterpret_cast<uintptr_t>(t.data_ptr());
  const int64_t skip = (int64_t)((16 - start % 16) % 16);
  const int64_t total = (int64_t)(t.numel() * t.element_size()) - skip;
  const int64_t bytes = std::min<int64_t>(max_bytes, total) & ~int64_t{15};
  if (bytes < 16) return;
  c10::cuda::CUDAGuard guard(t.device());
  const int64_t chunks = (bytes + kPrefetchChunk - 1) / kPrefetchChunk;
  const int blocks = (int)std::min<int64_t>(kPrefetchBlocks, (chunks + 31) / 32);
  l2_prefetch_kernel<<<blocks, 32, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const char*>(start + skip), bytes);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) { m.impl("l2_prefetch", &l2_prefetch); }

}  // namespace segki
