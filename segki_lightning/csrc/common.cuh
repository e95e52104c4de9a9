// Shared device helpers: 16-byte vector loads, bf16/fp16 <-> fp32, warp/block reductions, the m16n8k16 tensor-core
// product, launch checks, programmatic dependent launch.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>

namespace segki {

// 8 half-precision values in one 16-byte register quad.
template <typename T>
struct Pack8 {
  uint4 raw;
};

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }

// Round an fp32 value through T (what a PyTorch op producing a T tensor does).
template <typename T>
__device__ __forceinline__ float round_to(float v) { return to_float<T>(from_float<T>(v)); }

// Streaming 16-byte load that bypasses L1 (weights are read once per step).
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ uint4 ld_cached(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

template <typename T>
__device__ __forceinline__ void unpack8(uint4 u, float f[8]) {
  const T* h = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = to_float<T>(h[i]);
}

template <typename T>
__device__ __forceinline__ uint4 pack8(const float f[8]) {
  uint4 u;
  T* h = reinterpret_cast<T*>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) h[i] = from_float<T>(f[i]);
  return u;
}

// The activations as PyTorch computes them in fp32 (a division, not a multiply by the reciprocal).
__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// Qwen3.5's conv width, 4 values of one channel in 8 bytes: the dot product of the taps with the window after the
// shift (the old window's last three values, then x), and that new window. conv_token's arithmetic, apart for the
// GDN step that reads a window in several blocks and rewrites it in one once all have read it.
template <typename T>
__device__ __forceinline__ float conv4_sum(uint2 window, uint2 taps, float x) {
  alignas(8) T s[4], k[4];
  *reinterpret_cast<uint2*>(s) = window;
  *reinterpret_cast<uint2*>(k) = taps;
  const float v[4] = {to_float<T>(s[1]), to_float<T>(s[2]), to_float<T>(s[3]), x};
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) acc += v[i] * to_float<T>(k[i]);
  return acc;
}

template <typename T>
__device__ __forceinline__ uint2 conv4_shifted(uint2 window, T x) {
  alignas(8) T s[4];
  *reinterpret_cast<uint2*>(s) = window;
  s[0] = s[1];
  s[1] = s[2];
  s[2] = s[3];
  s[3] = x;
  return *reinterpret_cast<const uint2*>(s);
}

// One causal depthwise-conv token of one channel (Gated-DeltaNet): shifts the channel's conv state
// st[0..width) left by one, appends x (the projection's value, already rounded to T), returns
// SiLU(window . w + bias). Shared by the standalone conv kernel and the in-projection's epilogue, so both
// give the same bits. width <= kMaxConvWidth.
constexpr int kMaxConvWidth = 8;
template <typename T>
__device__ __forceinline__ float conv_token(T* __restrict__ st, const T* __restrict__ w, const T* __restrict__ bias,
                                            int c, float x, int width) {
  const T* wc = w + (size_t)c * width;
  float acc = 0.f;
  if (width == 4 && ((reinterpret_cast<uintptr_t>(st) | reinterpret_cast<uintptr_t>(wc)) & 7) == 0) {
    // Qwen3.5's width: the window and the weights as one 8-byte load each, the new window as one store (scalar
    // 2-byte accesses left the standalone conv at ~1 TB/s); the same sums in the same order, so the same bits
    const uint2 window = *reinterpret_cast<const uint2*>(st);
    acc = conv4_sum<T>(window, *reinterpret_cast<const uint2*>(wc), x);
    *reinterpret_cast<uint2*>(st) = conv4_shifted<T>(window, from_float<T>(x));
  } else {
#pragma unroll
    for (int i = 0; i < kMaxConvWidth; ++i) {  // unrolled and predicated: no indexed local array
      if (i < width) {
        const float v = i + 1 < width ? to_float<T>(st[i + 1]) : x;  // st[i + 1] is read before it is rewritten
        st[i] = from_float<T>(v);
        acc += v * to_float<T>(wc[i]);
      }
    }
  }
  if (bias) acc += to_float<T>(bias[c]);
  return silu(acc);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// c += a (16 x 16, row-major) . b (16 x 8, column-major): T in, fp32 sums (fragments as PTX's mma.m16n8k16).
template <typename T>
__device__ __forceinline__ void mma16816(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

struct BlockSync {
  __device__ __forceinline__ void operator()() const { __syncthreads(); }
};

// N sums over the whole block at once (blockDim.x a multiple of 32, at most 1024), each in block_sum's order, with
// one pair of barriers; every thread gets every result. A kernel whose first `nwarps` warps sum without the rest
// passes their count and a barrier of theirs (`sync`); the same order for the same warp count.
template <int N, typename Sync = BlockSync>
__device__ __forceinline__ void block_sums(float (&v)[N], float (*scratch)[32] /* [N][32] */, int nwarps = 0,
                                           Sync sync = {}) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (nwarps == 0) nwarps = blockDim.x >> 5;
#pragma unroll
  for (int n = 0; n < N; ++n) v[n] = warp_sum(v[n]);
  sync();
  if (lane == 0)
#pragma unroll
    for (int n = 0; n < N; ++n) scratch[n][warp] = v[n];
  sync();
#pragma unroll
  for (int n = 0; n < N; ++n) v[n] = warp_sum(lane < nwarps ? scratch[n][lane] : 0.f);
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch /* [32] */) {
  float s[1] = {v};
  block_sums<1>(s, reinterpret_cast<float(*)[32]>(scratch));
  return s[0];
}

// v[j] = the `parts` fp32 values `stride` apart from p[j], added in part order from zero (N a multiple of 4): the
// deferred segments of K of a skinny product (skinny.cu) as its sum kernel and the norm that takes them (norm.cu) add
// them, so that both give the same bits. AT_ONCE parts are requested before the first is added (one round trip for
// them, not one per part: the loop over a launch argument kept one load in flight).
template <int N, int AT_ONCE>
__device__ __forceinline__ void sum_parts(const float* __restrict__ p, int parts, size_t stride, float (&v)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = 0.f;
  for (int s0 = 0; s0 < parts; s0 += AT_ONCE) {
    float4 q[AT_ONCE][N / 4];
#pragma unroll
    for (int s = 0; s < AT_ONCE; ++s)
#pragma unroll
      for (int j = 0; j < N; j += 4)
        q[s][j / 4] = s0 + s < parts ? __ldcg(reinterpret_cast<const float4*>(p + (s0 + s) * stride + j))
                                     : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < AT_ONCE; ++s) {
      if (s0 + s >= parts) break;
#pragma unroll
      for (int j = 0; j < N; j += 4)
        v[j] += q[s][j / 4].x, v[j + 1] += q[s][j / 4].y, v[j + 2] += q[s][j / 4].z, v[j + 3] += q[s][j / 4].w;
    }
  }
}

// RMSNorm's arithmetic, shared by the norm kernels (norm.cu) and the GEMVs' norm prologue (gemv.cu) so that both
// give the same bits: a thread's sum of squares over its 8 values, a row's inverse RMS from the block's sum, and
// one normalized value in either weight form (unit_offset: Qwen3.5's 1 + w, from the live weight).
__device__ __forceinline__ float add_squares8(const float (&v)[8], float ss) {
#pragma unroll
  for (int j = 0; j < 8; ++j) ss = fmaf(v[j], v[j], ss);
  return ss;
}

__device__ __forceinline__ float rms_inverse(float sum_squares, int width, float eps) {
  return rsqrtf(sum_squares / width + eps);
}

template <typename T>
__device__ __forceinline__ float rms_scaled(float v, float inv, float w, bool unit_offset) {
  return unit_offset ? v * inv * (1.f + w) : w * round_to<T>(v * inv);
}

__device__ __forceinline__ float block_max(float v, float* scratch /* [32] */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : -INFINITY;
  return warp_max(v);
}

// The native RMSNorm of x's rows (norm.cu): what an op with a norm prologue runs first where its own kernel cannot
// take the norm.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps, bool unit_offset);

// Map a torch half dtype to its CUDA type and run the body with `T` bound to it.
#define SEGKI_DISPATCH_HALF(dtype, NAME, ...)                                              \
  [&] {                                                                                    \
    if ((dtype) == at::kBFloat16) {                                                        \
      using T = __nv_bfloat16;                                                             \
      return __VA_ARGS__();                                                                \
    } else if ((dtype) == at::kHalf) {                                                     \
      using T = __half;                                                                    \
      return __VA_ARGS__();                                                                \
    }                                                                                      \
    TORCH_CHECK(false, NAME, ": native kernels take bfloat16 or float16, got ", (dtype),   \
                "; fp32 models run the reference path");                                  \
  }()

// Run `f(std::integral_constant<int, D>{})` for a head dimension D in {64, 128, 256} (checked by the caller).
template <typename F>
void with_head_dim(int d, F&& f) {
  if (d == 64) f(std::integral_constant<int, 64>{});
  else if (d == 128) f(std::integral_constant<int, 128>{});
  else f(std::integral_constant<int, 256>{});
}

// Whether the environment variable `name` is set to `value` (read on every call).
inline bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string(v) == value;
}

// The integer in environment variable `name` clamped to [lo, hi], or `fallback` when it is unset (the values
// were checked when the extension loaded: ops/switches.py).
inline long env_long(const char* name, long fallback, long lo, long hi) {
  const char* v = std::getenv(name);
  return v == nullptr ? fallback : std::min(hi, std::max(lo, std::atol(v)));
}

inline void check_cuda_dtype(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " has dtype ", t.scalar_type(), ", expected ", dtype);
}

inline void check_cuda_half(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype) {
  check_cuda_dtype(t, op, name, dtype);
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// A half-precision CUDA matrix whose rows may lie apart (a column slice of a wider product: the outputs of one
// product over packed weights); returns its row stride in elements. Contiguous tensors of any rank count as
// rows of their last dimension.
inline int64_t check_rows_half(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype) {
  check_cuda_dtype(t, op, name, dtype);
  if (t.is_contiguous()) return t.dim() == 0 ? 1 : t.size(-1);
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.stride(0) >= t.size(1), op, ": ", name,
              " must be contiguous or a matrix of contiguous rows (strides ", t.strides(), ")");
  return t.stride(0);
}

// ---- Programmatic dependent launch (sm_90): every kernel here is launched with `launch_pdl`, so it may start
// while the kernel before it in the stream is still finishing, and the next one may start while it finishes.
// Contract of each kernel: call pdl_launch_dependents() first, then do only work that reads nothing another
// kernel writes (an L2 prefetch of weights), then pdl_wait() -- which returns once the previous kernel has
// completed and its writes are visible -- before reading activations or writing anything. The prefetch is
// safe even right after an in-place weight update: L2 is where writes land, a prefetch only warms it.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// For kernels with nothing to do before their inputs exist: let the next kernel launch, then wait.
__device__ __forceinline__ void pdl_start() {
  pdl_launch_dependents();
  pdl_wait();
}

// The current device's bit in a per-device set of flags (0 past the first 64 devices: never recorded). A kernel's
// attributes belong to it as loaded on one device, so they are set once per device a process launches on.
inline uint64_t device_bit() {
  const int dev = c10::cuda::current_device();
  return dev < 64 ? 1ull << dev : 0;
}

// Lets `kernel` take up to `bytes` of dynamic shared memory on the current device.
template <auto kernel>
void allow_dynamic_smem(int bytes) {
  static std::atomic<uint64_t> done{0};  // bit d: set on device d
  const uint64_t bit = device_bit();
  if (bit != 0 && (done.load(std::memory_order_relaxed) & bit) != 0) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done.fetch_or(bit, std::memory_order_relaxed);
}

// The current device's SMs (the grids of the kernels that keep one block an SM, and the rules that count on them).
inline int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// Blocks of `Kernel` resident at once on the device: its first wave (found on the first call). Only these can start
// beside the previous kernel under PDL (gemv.cu: only they warm L2 before the wait), and a grid past them runs a
// second wave that costs a whole block's time (attention.cu sizes its splits to one wave).
template <auto Kernel>
int first_wave_blocks(int threads, int smem) {
  static const int blocks = [&] {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, threads, smem));
    return per_sm * sm_count();
  }();
  return blocks;
}

// Asks L2 for the 128-byte line at p (no register written, nothing waited for).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// The warp prefetches `rows` rows of a row-major [*, ld] half matrix, columns [k0, k1), into L2.
template <typename T>
__device__ __forceinline__ void prefetch_rows_l2(const T* p, int rows, size_t ld, int k0, int k1) {
  constexpr int kLine = 128 / sizeof(T);  // elements per 128-byte line
  const int lines = (k1 - k0 + kLine - 1) / kLine;
  for (int i = threadIdx.x & 31; i < rows * lines; i += 32) {
    prefetch_l2(p + (size_t)(i / lines) * ld + k0 + (i % lines) * kLine);
  }
}

// SEGKI_PDL=0 in the environment launches every kernel in plain stream order (the wait/trigger instructions
// are then no-ops): a switch for debugging and for comparing timings.
inline bool pdl_enabled() {
  static const bool enabled = !env_is("SEGKI_PDL", "0");
  return enabled;
}

// Launch `kernel` on `stream` with programmatic stream serialization, `smem` bytes of dynamic shared memory
// and, when `cluster` has more than one block, that thread-block cluster shape.
template <typename... KernelArgs, typename... Args>
void launch_pdl_smem(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                     dim3 cluster, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x;
    attr[n].val.clusterDim.y = cluster.y;
    attr[n++].val.clusterDim.z = cluster.z;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

template <typename... KernelArgs, typename... Args>
void launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, cudaStream_t stream, dim3 cluster,
                Args&&... args) {
  launch_pdl_smem(kernel, grid, block, 0, stream, cluster, std::forward<Args>(args)...);
}

}  // namespace segki
