// Decode GEMV family: y_i = x @ W_i^T for up to four ORIGINAL weight matrices sharing one input, reading
// every weight element exactly once for all (up to MAXM) rows of x. One warp owns one output column
// (one weight row, or the gate/up row pair for the SiLU-gated front) and streams it with 16-byte loads,
// UNROLL loads in flight per lane; x rows come from L1/L2.
#include "common.cuh"

namespace segki {
namespace {

constexpr int kWarps = 8;     // warps per block
constexpr int kUnroll = 4;    // 16-byte weight loads in flight per lane and weight row
constexpr int kMaxW = 4;

enum class Epilogue { Plain, SiluMul };

template <typename T>
struct GemvArgs {
  const T* x;            // [M, K]
  int m, k;
  int nw;                // number of weights
  const T* w[kMaxW];     // [N_i, K]
  const T* bias[kMaxW];  // [N_i] or nullptr
  T* out[kMaxW];         // [M, N_i]
  int n[kMaxW];
  int start[kMaxW + 1];  // cumulative item offsets; SiluMul: one item per output column
};

template <typename T, int MAXM>
__device__ __forceinline__ void dot_rows(const GemvArgs<T>& a, const T* wrow, float acc[MAXM]) {
  const int lane = threadIdx.x & 31;
  const int k = a.k;
  for (int k0 = lane * 8; k0 < k; k0 += 32 * 8 * kUnroll) {
    uint4 wv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int kk = k0 + u * 256;
      wv[u] = kk < k ? ld_stream(wrow + kk) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int kk = k0 + u * 256;
      if (kk >= k) break;
      float wf[8];
      unpack8<T>(wv[u], wf);
#pragma unroll
      for (int r = 0; r < MAXM; ++r) {
        if (r < a.m) {
          float xf[8];
          unpack8<T>(ld_cached(a.x + (size_t)r * k + kk), xf);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[r] = fmaf(wf[i], xf[i], acc[r]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < MAXM; ++r) acc[r] = warp_sum(acc[r]);
}

template <typename T, int MAXM, Epilogue EPI>
__global__ void __launch_bounds__(kWarps * 32) gemv_kernel(const GemvArgs<T> a) {
  const int lane = threadIdx.x & 31;
  const int total = a.start[a.nw];
  for (int item = blockIdx.x * kWarps + (threadIdx.x >> 5); item < total; item += gridDim.x * kWarps) {
    if constexpr (EPI == Epilogue::SiluMul) {
      float g[MAXM] = {}, u[MAXM] = {};
      dot_rows<T, MAXM>(a, a.w[0] + (size_t)item * a.k, g);
      dot_rows<T, MAXM>(a, a.w[1] + (size_t)item * a.k, u);
#pragma unroll
      for (int r = 0; r < MAXM; ++r)
        if (r < a.m && lane == r % 32) {
          const float s = g[r] / (1.f + expf(-g[r]));
          a.out[0][(size_t)r * a.n[0] + item] = from_float<T>(s * u[r]);
        }
    } else {
      int wi = 0;
#pragma unroll
      for (int j = 1; j < kMaxW; ++j) wi += (j < a.nw && item >= a.start[j]) ? 1 : 0;
      const int row = item - a.start[wi];
      float acc[MAXM] = {};
      dot_rows<T, MAXM>(a, a.w[wi] + (size_t)row * a.k, acc);
      const float b = a.bias[wi] ? to_float<T>(a.bias[wi][row]) : 0.f;
#pragma unroll
      for (int r = 0; r < MAXM; ++r)
        if (r < a.m && lane == r % 32) a.out[wi][(size_t)r * a.n[wi] + row] = from_float<T>(acc[r] + b);
    }
  }
}

template <typename T, Epilogue EPI>
void launch_rows(const GemvArgs<T>& a) {
  const int items = a.start[a.nw];
  const int blocks = (items + kWarps - 1) / kWarps;
  auto stream = at::cuda::getCurrentCUDAStream();
#define SEGKI_GEMV_CASE(M)                                                          \
  if (a.m <= M) {                                                                  \
    gemv_kernel<T, M, EPI><<<blocks, kWarps * 32, 0, stream>>>(a);                 \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                \
    return;                                                                        \
  }
  SEGKI_GEMV_CASE(1) SEGKI_GEMV_CASE(2) SEGKI_GEMV_CASE(4) SEGKI_GEMV_CASE(8) SEGKI_GEMV_CASE(16)
#undef SEGKI_GEMV_CASE
}

constexpr int kMaxRowsPerLaunch = 16;

// Validates, allocates outputs [..., N_i], and runs the GEMV over row chunks of at most 16 rows.
std::vector<at::Tensor> run_gemv(const char* op, const at::Tensor& x, std::vector<at::Tensor> ws,
                                 std::vector<c10::optional<at::Tensor>> biases, Epilogue epi) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous(), op, ": x must be a contiguous CUDA tensor");
  const int64_t k = x.size(-1);
  TORCH_CHECK(k % 8 == 0, op, ": the input width ", k, " must be a multiple of 8 (16-byte loads)");
  const int64_t m = x.numel() / k;
  c10::cuda::CUDAGuard guard(x.device());
  std::vector<at::Tensor> outs;
  const int nout = epi == Epilogue::SiluMul ? 1 : (int)ws.size();
  for (int i = 0; i < (int)ws.size(); ++i) {
    check_cuda_half(ws[i], op, "weight", x.scalar_type());
    TORCH_CHECK(ws[i].dim() == 2 && ws[i].size(1) == k, op, ": weight ", i, " is ", ws[i].sizes(),
                ", expected [N, ", k, "]");
    if (i < (int)biases.size() && biases[i].has_value())
      check_cuda_half(*biases[i], op, "bias", x.scalar_type());
  }
  for (int i = 0; i < nout; ++i) {
    auto shape = x.sizes().vec();
    shape.back() = ws[i].size(0);
    outs.push_back(at::empty(shape, x.options()));
  }
  if (m == 0) return outs;
  SEGKI_DISPATCH_HALF(x.scalar_type(), op, [&] {
    for (int64_t r0 = 0; r0 < m; r0 += kMaxRowsPerLaunch) {
      GemvArgs<T> a{};
      a.x = reinterpret_cast<const T*>(x.data_ptr()) + r0 * k;
      a.m = (int)std::min<int64_t>(kMaxRowsPerLaunch, m - r0);
      a.k = (int)k;
      a.nw = (int)ws.size();
      a.start[0] = 0;
      for (int i = 0; i < a.nw; ++i) {
        a.w[i] = reinterpret_cast<const T*>(ws[i].data_ptr());
        a.bias[i] = (i < (int)biases.size() && biases[i].has_value())
                        ? reinterpret_cast<const T*>(biases[i]->data_ptr()) : nullptr;
        a.n[i] = (int)ws[i].size(0);
        a.out[i] = i < nout ? reinterpret_cast<T*>(outs[i].data_ptr()) + r0 * a.n[i] : nullptr;
        a.start[i + 1] = a.start[i] + a.n[i];
      }
      if (epi == Epilogue::SiluMul) {
        a.nw = 2;
        a.start[1] = a.n[0];
        a.start[2] = a.n[0];
        launch_rows<T, Epilogue::SiluMul>(a);
      } else {
        launch_rows<T, Epilogue::Plain>(a);
      }
    }
  });
  return outs;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b) {
  return run_gemv("segki::linear", x, {w}, {b}, Epilogue::Plain)[0];
}

at::Tensor gated_mlp_front(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu) {
  TORCH_CHECK(wg.sizes() == wu.sizes(), "segki::gated_mlp_front: gate ", wg.sizes(), " and up ", wu.sizes(),
              " weights differ in shape");
  return run_gemv("segki::gated_mlp_front", x, {wg, wu}, {}, Epilogue::SiluMul)[0];
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_proj(
    const at::Tensor& x, const at::Tensor& wq, const at::Tensor& wk, const at::Tensor& wv,
    const c10::optional<at::Tensor>& bq, const c10::optional<at::Tensor>& bk, const c10::optional<at::Tensor>& bv) {
  auto o = run_gemv("segki::qkv_proj", x, {wq, wk, wv}, {bq, bk, bv}, Epilogue::Plain);
  return {o[0], o[1], o[2]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gdn_in_proj(
    const at::Tensor& x, const at::Tensor& wqkv, const at::Tensor& wz, const at::Tensor& wb, const at::Tensor& wa) {
  auto o = run_gemv("segki::gdn_in_proj", x, {wqkv, wz, wb, wa}, {}, Epilogue::Plain);
  return {o[0], o[1], o[2], o[3]};
}

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) {
  m.impl("linear", &linear);
  m.impl("gated_mlp_front", &gated_mlp_front);
  m.impl("qkv_proj", &qkv_proj);
  m.impl("gdn_in_proj", &gdn_in_proj);
}

}  // namespace segki
