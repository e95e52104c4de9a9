// ---- L2 warm-up for the weight of a cuBLAS product (past the native GEMV rows). cuBLAS kernels are launched in
// plain stream order, so each starts its weight stream only after the kernel before it has ended, and at 16-32
// rows over a 4-17 MB weight the launch ramp and tail cost more than the bytes (25-50 % of copy bandwidth). This
// kernel is launched with programmatic dependent launch right before the product: it starts while the previous
// native kernel still runs, asks the copy engines for the weight's first bytes into L2, and ends with the
// stream-order wait, so the product still starts after everything before it.
#include "common.cuh"

namespace segki {
namespace {

constexpr int64_t kPrefetchChunk = 16 << 10;  // bytes per bulk prefetch request

// Chunk c goes to block c % gridDim.x (consecutive chunks on different SMs); `bytes` is a multiple of 16, `p`
// 16-byte aligned.
__global__ void l2_prefetch_kernel(const char* __restrict__ p, int64_t bytes) {
  pdl_launch_dependents();
  const int64_t chunks = (bytes + kPrefetchChunk - 1) / kPrefetchChunk;
  for (int64_t c = blockIdx.x + (int64_t)threadIdx.x * gridDim.x; c < chunks; c += (int64_t)gridDim.x * blockDim.x) {
    const int64_t off = c * kPrefetchChunk;
    const uint32_t n = (uint32_t)(bytes - off < kPrefetchChunk ? bytes - off : kPrefetchChunk);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(n) : "memory");
  }
  pdl_wait();  // complete only after the previous kernel: the product launched next keeps its stream order
}

// Warm L2 with the first `max_bytes` (rounded down to 16) of `w`'s storage; nothing when w is not 16-byte
// aligned or max_bytes < 16. The result of later kernels does not depend on it.
void l2_prefetch(const at::Tensor& w, int64_t max_bytes) {
  TORCH_CHECK(w.is_cuda(), "segki::l2_prefetch: w must be a CUDA tensor");
  TORCH_CHECK(w.is_contiguous(), "segki::l2_prefetch: w must be contiguous (it warms one range of memory)");
  const int64_t bytes = std::min<int64_t>(max_bytes, (int64_t)(w.numel() * w.element_size())) & ~int64_t{15};
  if (bytes < 16 || reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 != 0) return;
  c10::cuda::CUDAGuard guard(w.device());
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t chunks = (bytes + kPrefetchChunk - 1) / kPrefetchChunk;
  const int blocks = (int)std::min<int64_t>(sms, chunks);  // one warp per SM
  launch_pdl(l2_prefetch_kernel, dim3(blocks), dim3(32), at::cuda::getCurrentCUDAStream(), dim3(1),
             reinterpret_cast<const char*>(w.data_ptr()), bytes);
}

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) { m.impl("l2_prefetch", &l2_prefetch); }

}  // namespace segki
