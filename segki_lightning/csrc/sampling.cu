// Token selection over a large vocabulary inside a CUDA graph (no host sync): greedy
// argmax, or Gumbel-max sampling of softmax(logits / T) restricted by top-k then top-p. The random numbers
// are the counter-based hash of ops/reference/sampling.py, so native and reference draw the same tokens.
// Unfiltered rows split the vocabulary over many blocks and merge; top-k/top-p rows take one block each,
// with thresholds found by exact bisections over the order-preserving 32-bit keys of the scaled logits.
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


__device__ __forceinline__ uint32_t row_hash(const int64_t* seed, const int64_t* offset, int b) {
  const uint64_t sd = (uint64_t)seed[b];
  return mix32(mix32((uint32_t)sd) ^ mix32((uint32_t)(sd >> 32)) ^ mix32((uint32_t)(uint64_t)offset[b]) * 3u);
}

__device__ __forceinline__ float gumbel(uint32_t rowh, int j) {
  const uint32_t h = mix32(rowh ^ mix32((uint32_t)j + 0x9E3779B9u));
  const float u = ((float)(h >> 8) + 0.5f) * (1.0f / 16777216.0f);
  return -logf(-logf(u));
}

constexpr int kSplitThreads = 256;

// grid (splits, B): per vocabulary slice, the max of logits/T with its index, sum exp(logits/T - max), and
// the Gumbel-perturbed argmax. Partials: [B, splits, 5] floats (indices < 2^24 are exact in fp32).
template <typename T>
__global__ void __launch_bounds__(kSplitThreads) sample_split_kernel(
    const T* __restrict__ logits, const float* __restrict__ temperature, const int64_t* __restrict__ seed,
    const int64_t* __restrict__ offset, float* __restrict__ part, int vocab) {
  pdl_start();  // everything below reads what earlier kernels wrote
  __shared__ float scratch[32];
  __shared__ Best best_scratch[32];
  const int split = blockIdx.x, splits = gridDim.x, b = blockIdx.y;
  const int per = ((vocab + splits - 1) / splits + 7) / 8 * 8;
  const int v0 = min(vocab, split * per), v1 = min(vocab, v0 + per);
  const T* row = logits + (size_t)b * vocab;
  const float temp = temperature[b];
  const bool greedy = temp <= 0.f;
  const float t_eff = greedy ? 1.f : temp;
  const uint32_t rowh = row_hash(seed, offset, b);
  const bool vec = (vocab % 8) == 0;
  Best top{-INFINITY, INT_MAX}, pick{-INFINITY, INT_MAX};
  auto visit = [&](float l, int j) {
    const float s = l / t_eff;
    top = better(top, Best{s, j});
    if (!greedy) pick = better(pick, Best{s + gumbel(rowh, j), j});
  };
  if (vec) {
    for (int j = v0 + threadIdx.x * 8; j < v1; j += kSplitThreads * 8) {
      float f[8];
      unpack8<T>(ld_cached(row + j), f);
#pragma unroll
      for (int i = 0; i < 8; ++i) visit(f[i], j + i);
    }
  } else {
    for (int j = v0 + threadIdx.x; j < v1; j += kSplitThreads) visit(to_float<T>(row[j]), j);
  }
  top = block_argmax(top, best_scratch);
  float se = 0.f;
  if (top.v > -INFINITY) {
    if (vec) {
      for (int j = v0 + threadIdx.x * 8; j < v1; j += kSplitThreads * 8) {
        float f[8];
        unpack8<T>(ld_cached(row + j), f);
#pragma unroll
        for (int i = 0; i < 8; ++i) se += expf(f[i] / t_eff - top.v);
      }
    } else {
      for (int j = v0 + threadIdx.x; j < v1; j += kSplitThreads) se += expf(to_float<T>(row[j]) / t_eff - top.v);
    }
  }
  se = block_sum(se, scratch);
  pick = block_argmax(pick, best_scratch);
  if (threadIdx.x == 0) {
    float* p = part + ((size_t)b * splits + split) * 5;
    p[0] = top.v;
    p[1] = (float)top.i;
    p[2] = se;
    p[3] = pick.v;
    p[4] = (float)pick.i;
  }
}

// grid B, one warp: merge the slices; write token and log-prob (filtered rows are redone exactly later).
template <typename T>
__global__ void sample_merge_kernel(const T* __restrict__ logits, const float* __restrict__ temperature,
                                    const float* __restrict__ part, int splits, int vocab,
                                    int64_t* __restrict__ tokens, float* __restrict__ logprobs) {
  pdl_start();  // everything below reads what earlier kernels wrote
  const int b = blockIdx.x, lane = threadIdx.x;
  Best top{-INFINITY, INT_MAX}, pick{-INFINITY, INT_MAX};
  for (int s = lane; s < splits; s += 32) {
    const float* p = part + ((size_t)b * splits + s) * 5;
    top = better(top, Best{p[0], (int)p[1]});
    pick = better(pick, Best{p[3], (int)p[4]});
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    top = better(top, Best{__shfl_xor_sync(0xffffffffu, top.v, o), __shfl_xor_sync(0xffffffffu, top.i, o)});
    pick = better(pick, Best{__shfl_xor_sync(0xffffffffu, pick.v, o), __shfl_xor_sync(0xffffffffu, pick.i, o)});
  }
  float se = 0.f;
  for (int s = lane; s < splits; s += 32) {
    const float* p = part + ((size_t)b * splits + s) * 5;
    if (p[0] > -INFINITY) se += p[2] * expf(p[0] - top.v);
  }
  se = warp_sum(se);
  if (lane == 0) {
    const float temp = temperature[b];
    const bool greedy = temp <= 0.f;
    const int tok = greedy ? top.i : pick.i;
    tokens[b] = tok;
    logprobs[b] = to_float<T>(logits[(size_t)b * vocab + tok]) / (greedy ? 1.f : temp) - (top.v + logf(se));
  }
}

// The exact top-k / top-p path: one block per row, bisection over keys. Rows without a filter (and greedy
// rows) were finished by the split kernels and return at once.
template <typename T>
__global__ void __launch_bounds__(kThreads) filtered_sample_kernel(
    const T* __restrict__ logits, const float* __restrict__ temperature, const int64_t* __restrict__ top_k,
    const float* __restrict__ top_p, const int64_t* __restrict__ seed, const int64_t* __restrict__ offset,
    int64_t* __restrict__ tokens, float* __restrict__ logprobs, int vocab) {
  pdl_start();  // everything below reads what earlier kernels wrote
  __shared__ float scratch[32];
  __shared__ Best best_scratch[32];
  const int b = blockIdx.x;
  const T* row = logits + (size_t)b * vocab;
  const float temp = temperature[b];
  const bool greedy = temp <= 0.f;
  if (greedy || !((top_k[b] > 0 && top_k[b] < vocab) || top_p[b] < 1.f)) return;
  const float t_eff = temp;
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
    const uint32_t rowh = row_hash(seed, offset, b);
    Best pick{-INFINITY, INT_MAX};
    for (int j = threadIdx.x; j < vocab; j += kThreads) {
      const float s = scaled(j);
      const uint32_t key = order_key(s);
      if (key < lo_key || (use_p && key <= p_key)) continue;
      pick = better(pick, Best{s + gumbel(rowh, j), j});
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
  const int sms = sm_count();
  // ~8 blocks of 256 threads per SM over all rows (at 2 per SM a 32-row batch kept only ~8 KB of logits in
  // flight per SM and left the Gumbel arithmetic short of warps); at most 64 slices per row.
  const int splits = std::max(1, std::min({(8 * sms + bsz - 1) / bsz, 64, (vocab + 2047) / 2048}));
  auto part = at::empty({bsz, splits, 5}, logits.options().dtype(at::kFloat));
  auto stream = at::cuda::getCurrentCUDAStream();
  SEGKI_DISPATCH_HALF(logits.scalar_type(), op, [&] {
    launch_pdl(sample_split_kernel<T>, dim3(splits, bsz), dim3(kSplitThreads), stream, dim3(1),
        reinterpret_cast<const T*>(logits.data_ptr()), temperature.data_ptr<float>(), seed.data_ptr<int64_t>(),
        offset.data_ptr<int64_t>(), part.data_ptr<float>(), vocab);
    launch_pdl(sample_merge_kernel<T>, dim3(bsz), dim3(32), stream, dim3(1),
               reinterpret_cast<const T*>(logits.data_ptr()), temperature.data_ptr<float>(), part.data_ptr<float>(),
               splits, vocab, tokens.data_ptr<int64_t>(), logprobs.data_ptr<float>());
    launch_pdl(filtered_sample_kernel<T>, dim3(bsz), dim3(kThreads), stream, dim3(1),
        reinterpret_cast<const T*>(logits.data_ptr()), temperature.data_ptr<float>(), top_k.data_ptr<int64_t>(),
        top_p.data_ptr<float>(), seed.data_ptr<int64_t>(), offset.data_ptr<int64_t>(), tokens.data_ptr<int64_t>(),
        logprobs.data_ptr<float>(), vocab);
  });
  return {tokens, logprobs};
}

// The decode step's bookkeeping after sampling (ops/reference/sampling.py: record_tokens), one thread per row.
// Columns at or past S are not written (the engine keeps offsets below max_new_tokens <= S).
__global__ void record_tokens_kernel(const int64_t* __restrict__ tok, const float* __restrict__ lp,
                                     bool* __restrict__ finished, int64_t* __restrict__ offset,
                                     int64_t* __restrict__ token, int64_t* __restrict__ out_tokens,
                                     float* __restrict__ out_logprobs, int64_t* __restrict__ out_mask,
                                     const int64_t* __restrict__ eos, int n_eos, int64_t pad,
                                     int64_t* __restrict__ lengths, int bsz, int64_t cols) {
  pdl_start();
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= bsz) return;
  const bool done = finished[b];
  const int64_t t = done ? pad : tok[b];
  const int64_t c = offset[b];
  if (c >= 0 && c < cols) {
    out_tokens[b * cols + c] = t;
    out_logprobs[b * cols + c] = done ? 0.f : lp[b];
    out_mask[b * cols + c] = done ? 0 : 1;
  }
  bool hit = false;
  for (int i = 0; i < n_eos; ++i) hit = hit || t == eos[i];
  finished[b] = done || hit;
  token[b] = t;
  if (lengths != nullptr) {
    offset[b] = c + 1;
    lengths[b] += 1;
  }
}

void record_tokens(const at::Tensor& tok, const at::Tensor& lp, const at::Tensor& finished, const at::Tensor& offset,
                   const at::Tensor& token, const at::Tensor& out_tokens, const at::Tensor& out_logprobs,
                   const at::Tensor& out_mask, const at::Tensor& eos, int64_t pad,
                   const std::optional<at::Tensor>& lengths) {
  const char* op = "segki::record_tokens";
  const int64_t bsz = tok.numel();
  auto check = [&](const at::Tensor& t, at::ScalarType dt, int dim, const char* name, bool per_row = true) {
    TORCH_CHECK(t.is_cuda() && t.scalar_type() == dt && t.is_contiguous() && t.dim() == dim &&
                    (!per_row || t.size(0) == bsz),
                op, ": ", name, " must be a contiguous CUDA ", dt, " tensor of ", dim, " dims",
                per_row ? " with one row per token" : "");
  };
  check(tok, at::kLong, 1, "tok");
  check(lp, at::kFloat, 1, "lp");
  check(finished, at::kBool, 1, "finished");
  check(offset, at::kLong, 1, "offset");
  check(token, at::kLong, 1, "token");
  check(out_tokens, at::kLong, 2, "out_tokens");
  check(out_logprobs, at::kFloat, 2, "out_logprobs");
  check(out_mask, at::kLong, 2, "out_mask");
  check(eos, at::kLong, 1, "eos", false);
  TORCH_CHECK(out_logprobs.size(1) == out_tokens.size(1) && out_mask.size(1) == out_tokens.size(1), op,
              ": out_tokens, out_logprobs and out_mask must have the same columns");
  if (lengths.has_value()) check(*lengths, at::kLong, 1, "lengths");
  if (bsz == 0) return;
  c10::cuda::CUDAGuard guard(tok.device());
  constexpr int kRowThreads = 128;
  launch_pdl(record_tokens_kernel, dim3((unsigned)((bsz + kRowThreads - 1) / kRowThreads)), dim3(kRowThreads),
             at::cuda::getCurrentCUDAStream(), dim3(1), tok.data_ptr<int64_t>(), lp.data_ptr<float>(),
             finished.data_ptr<bool>(), offset.data_ptr<int64_t>(), token.data_ptr<int64_t>(),
             out_tokens.data_ptr<int64_t>(), out_logprobs.data_ptr<float>(), out_mask.data_ptr<int64_t>(),
             eos.data_ptr<int64_t>(), (int)eos.numel(), pad,
             lengths.has_value() ? lengths->data_ptr<int64_t>() : nullptr, (int)bsz, out_tokens.size(1));
}

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) {
  m.impl("sample_tokens", &sample_tokens);
  m.impl("record_tokens", &record_tokens);
}

}  // namespace segki
