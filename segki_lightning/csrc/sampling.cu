// Token selection over a large vocabulary, one block per row, inside a CUDA graph (no host sync): greedy
// argmax, or Gumbel-max sampling of softmax(logits / T) restricted by top-k then top-p. The random numbers
// are the counter-based hash of ops/reference/sampling.py, so native and reference draw the same tokens.
// Thresholds are exact bisections over the order-preserving 32-bit keys of the scaled logits.
#include "common.cuh"

namespace segki {
namespace {

constexpr int kThreads = 1024;

__device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct Best {
  float v;
  int i;
};

__device__ __forceinline__ Best better(Best a, Best b) { return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a; }

__device__ Best block_argmax(Best x, Best* scratch /* [32] */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    x = better(x, Best{__shfl_xor_sync(0xffffffffu, x.v, o), __shfl_xor_sync(0xffffffffu, x.i, o)});
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < (int)(blockDim.x >> 5) ? scratch[lane] : Best{-INFINITY, INT_MAX};
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    x = better(x, Best{__shfl_xor_sync(0xffffffffu, x.v, o), __shfl_xor_sync(0xffffffffu, x.i, o)});
  return x;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) sample_kernel(
    const T* __restrict__ logits, const float* __restrict__ temperature, const int64_t* __restrict__ top_k,
    const float* __restrict__ top_p, const int64_t* __restrict__ seed, const int64_t* __restrict__ offset,
    int64_t* __restrict__ tokens, float* __restrict__ logprobs, int vocab) {
  __shared__ float scratch[32];
  __shared__ Best best_scratch[32];
  const int b = blockIdx.x;
  const T* row = logits + (size_t)b * vocab;
  const float temp = temperature[b];
  const bool greedy = temp <= 0.f;
  const float t_eff = greedy ? 1.f : temp;
  auto scaled = [&](int j) { return to_float<T>(row[j]) / t_eff; };

  Best top{-INFINITY, INT_MAX};
  for (int j = threadIdx.x; j < vocab; j += kThreads) top = better(top, Best{scaled(j), j});
  top = block_argmax(top, best_scratch);
  const float mx = top.v;
  float se = 0.f;
  for (int j = threadIdx.x; j < vocab; j += kThreads) se += expf(scaled(j) - mx);
  const float lse = mx + logf(block_sum(se, scratch));

  int token = top.i;
  if (!greedy) {
    uint32_t lo_key = 0;  // keep tokens whose key >= lo_key (top-k), then key > p_key (top-p)
    const int64_t k = top_k[b];
    if (k > 0 && k < vocab) {
      uint32_t ans = 0;
      for (int bit = 31; bit >= 0; --bit) {
        const uint32_t cand = ans | (1u << bit);
        float cnt = 0.f;
        for (int j = threadIdx.x; j < vocab; j += kThreads) cnt += order_key(scaled(j)) >= cand ? 1.f : 0.f;
        if (block_sum(cnt, scratch) >= (float)k) ans = cand;
      }
      lo_key = ans;
    }
    const float p = top_p[b];
    bool use_p = p < 1.f;
    uint32_t p_key = 0;
    if (use_p) {
      float z = 0.f;
      for (int j = threadIdx.x; j < vocab; j += kThreads) {
        const float s = scaled(j);
        if (order_key(s) >= lo_key) z += expf(s - mx);
      }
      const float target = p * block_sum(z, scratch);
      uint32_t ans = 0;  // largest key whose strictly-above mass still reaches p
      for (int bit = 31; bit >= 0; --bit) {
        const uint32_t cand = ans | (1u << bit);
        float mass = 0.f;
        for (int j = threadIdx.x; j < vocab; j += kThreads) {
          const float s = scaled(j);
          const uint32_t key = order_key(s);
          if (key >= lo_key && key > cand) mass += expf(s - mx);
        }
        if (block_sum(mass, scratch) >= target) ans = cand;
      }
      p_key = ans;
    }
    const uint64_t sd = (uint64_t)seed[b];
    const uint32_t rowh = mix32(mix32((uint32_t)sd) ^ mix32((uint32_t)(sd >> 32)) ^
                                mix32((uint32_t)(uint64_t)offset[b]) * 3u);
    Best pick{-INFINITY, INT_MAX};
    for (int j = threadIdx.x; j < vocab; j += kThreads) {
      const float s = scaled(j);
      const uint32_t key = order_key(s);
      if (key < lo_key || (use_p && key <= p_key)) continue;
      const uint32_t h = mix32(rowh ^ mix32((uint32_t)j + 0x9E3779B9u));
      const float u = ((float)(h >> 8) + 0.5f) * (1.0f / 16777216.0f);
      pick = better(pick, Best{s + -logf(-logf(u)), j});
    }
    token = block_argmax(pick, best_scratch).i;
  }
  if (threadIdx.x == 0) {
    tokens[b] = token;
    logprobs[b] = scaled(token) - lse;
  }
}

std::tuple<at::Tensor, at::Tensor> sample_tokens(const at::Tensor& logits, const at::Tensor& temperature,
                                                 const at::Tensor& top_k, const at::Tensor& top_p,
                                                 const at::Tensor& seed, const at::Tensor& offset) {
  const char* op = "segki::sample_tokens";
  check_cuda_half(logits, op, "logits", logits.scalar_type());
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be [B, V]");
  const int bsz = (int)logits.size(0), vocab = (int)logits.size(1);
  auto per_row = [&](const at::Tensor& t, at::ScalarType dt, const char* name) {
    TORCH_CHECK(t.is_cuda() && t.dim() == 1 && t.size(0) == bsz && t.scalar_type() == dt && t.is_contiguous(), op,
                ": ", name, " must be a contiguous CUDA ", dt, " tensor [B]");
  };
  per_row(temperature, at::kFloat, "temperature");
  per_row(top_k, at::kLong, "top_k");
  per_row(top_p, at::kFloat, "top_p");
  per_row(seed, at::kLong, "seed");
  per_row(offset, at::kLong, "offset");
  auto tokens = at::empty({bsz}, logits.options().dtype(at::kLong));
  auto logprobs = at::empty({bsz}, logits.options().dtype(at::kFloat));
  if (bsz == 0) return {tokens, logprobs};
  c10::cuda::CUDAGuard guard(logits.device());
  SEGKI_DISPATCH_HALF(logits.scalar_type(), op, [&] {
    sample_kernel<T><<<bsz, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const T*>(logits.data_ptr()), temperature.data_ptr<float>(), top_k.data_ptr<int64_t>(),
        top_p.data_ptr<float>(), seed.data_ptr<int64_t>(), offset.data_ptr<int64_t>(), tokens.data_ptr<int64_t>(),
        logprobs.data_ptr<float>(), vocab);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {tokens, logprobs};
}

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) { m.impl("sample_tokens", &sample_tokens); }

}  // namespace segki
