// ---- The cuBLAS products past the native GEMV rows (2-64 rows), with cuBLASLt's algorithm chosen per shape by
// timing instead of by its heuristic's first pick. At 16 rows the first pick runs the 4B gate|up weight (18 432
// output rows) at 57 % of copy bandwidth: 128-wide tiles make 144 of them on 132 SMs, a second wave of 12. The
// heuristic's other candidates (other tiles, split-K) are timed once per (rows, N, K, dtype, device), each launch
// after an L2 flush (decode reads every weight from DRAM), outside graph capture; under capture an untimed shape
// takes the first pick. Where the build found no cuBLASLt library to link (SEGKI_HAVE_CUBLASLT unset, see
// ops/build.py) the op is cuBLAS's default product, announced once.
// Host code only (cuBLASLt calls), so a C++ source: nvcc's front end fails on these standard containers.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#ifdef SEGKI_HAVE_CUBLASLT
#include <cublasLt.h>
#endif

namespace segki {
namespace {

void check_inputs(const at::Tensor& x, const at::Tensor& w) {
  const char* op = "segki::tuned_linear";
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && x.device() == w.device(), op, ": x and w must be on one CUDA device");
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) && w.scalar_type() == x.scalar_type(),
              op, ": x and w must share bf16 or fp16, got ", x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), op, ": x and w must be contiguous");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), op, ": x ", x.sizes(), " and w ", w.sizes(),
              " must be [M, K] and [N, K]");
  TORCH_CHECK(x.size(1) % 8 == 0 && w.size(0) % 8 == 0, op, ": K and N must be multiples of 8 (16-byte rows), got ",
              x.size(1), ", ", w.size(0));
}

#ifdef SEGKI_HAVE_CUBLASLT

constexpr size_t kWorkspace = 32u << 20;   // split-K partial sums: 64 rows x 18 432 x 4 splits x fp32 fit
constexpr int kCandidates = 16;
constexpr int kTimedRuns = 5;

#define SEGKI_LT_CHECK(expr)                                                                       \
  do {                                                                                             \
    const cublasStatus_t st_ = (expr);                                                             \
    TORCH_CHECK(st_ == CUBLAS_STATUS_SUCCESS, "segki::tuned_linear: ", #expr, " failed (", st_, ")"); \
  } while (0)

// The descriptors of y[M, N] = x[M, K] @ w[N, K]^T in cuBLASLt's column-major terms: D[N, M] = w^T' * x', i.e.
// A = w read as a K x N column-major matrix (transposed), B = x as K x M, C = D = y as N x M.
struct Problem {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  Problem(int64_t m, int64_t n, int64_t k, cudaDataType_t t) {
    SEGKI_LT_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    SEGKI_LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    SEGKI_LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    SEGKI_LT_CHECK(cublasLtMatrixLayoutCreate(&a, t, k, n, k));
    SEGKI_LT_CHECK(cublasLtMatrixLayoutCreate(&b, t, k, m, k));
    SEGKI_LT_CHECK(cublasLtMatrixLayoutCreate(&c, t, n, m, n));
  }
  ~Problem() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
  // The heuristic's candidates for operands aligned to `align_w` / `align_x` bytes (its default assumes 256).
  std::vector<cublasLtMatmulHeuristicResult_t> candidates(cublasLtHandle_t h, uint32_t align_w,
                                                          uint32_t align_x) const {
    cublasLtMatmulPreference_t pref;
    SEGKI_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = kWorkspace;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_w, sizeof(align_w));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_x, sizeof(align_x));
    std::vector<cublasLtMatmulHeuristicResult_t> r(kCandidates);
    int got = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(h, op, a, b, c, c, pref, kCandidates, r.data(), &got);
    cublasLtMatmulPreferenceDestroy(pref);
    r.resize(st == CUBLAS_STATUS_SUCCESS ? got : 0);
    r.erase(std::remove_if(r.begin(), r.end(), [](const auto& c) {
              return c.state != CUBLAS_STATUS_SUCCESS || c.workspaceSize > kWorkspace;
            }), r.end());
    return r;
  }
};

// One workspace per (device, stream): products queued on different streams may run at once.
void* workspace(int device, cudaStream_t stream) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, at::Tensor> held;
  std::lock_guard<std::mutex> lock(mu);
  auto& t = held[{device, stream}];
  if (!t.defined()) {
    t = at::empty({(int64_t)kWorkspace}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
  }
  return t.data_ptr();
}

cublasStatus_t run(cublasLtHandle_t h, const Problem& p, const cublasLtMatmulAlgo_t& algo, const void* x,
                   const void* w, void* y, void* ws, cudaStream_t stream) {
  const float one = 1.f, zero = 0.f;
  return cublasLtMatmul(h, p.op, &one, w, p.a, x, p.b, &zero, y, p.c, y, p.c, &algo, ws, kWorkspace, stream);
}

constexpr float kFailed = std::numeric_limits<float>::infinity();

// Median time of `algo` over kTimedRuns launches, each after a write of `flush` (larger than L2); kFailed if it fails.
float time_algo(cublasLtHandle_t h, const Problem& p, const cublasLtMatmulAlgo_t& algo, const void* x, const void* w,
                void* y, void* ws, at::Tensor& flush, cudaStream_t stream) {
  if (run(h, p, algo, x, w, y, ws, stream) != CUBLAS_STATUS_SUCCESS) return kFailed;
  std::vector<float> ms;
  cudaEvent_t e0, e1;
  C10_CUDA_CHECK(cudaEventCreate(&e0));
  C10_CUDA_CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < kTimedRuns; ++i) {
    C10_CUDA_CHECK(cudaMemsetAsync(flush.data_ptr(), i, flush.numel(), stream));
    C10_CUDA_CHECK(cudaEventRecord(e0, stream));
    run(h, p, algo, x, w, y, ws, stream);
    C10_CUDA_CHECK(cudaEventRecord(e1, stream));
    C10_CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0.f;
    C10_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::nth_element(ms.begin(), ms.begin() + kTimedRuns / 2, ms.end());
  return ms[kTimedRuns / 2];
}

// rows, N, K, dtype, device, alignment of w and of x (bytes)
using Key = std::tuple<int64_t, int64_t, int64_t, int, int, uint32_t, uint32_t>;

// The largest power of two up to 256 that divides the address.
uint32_t alignment(const void* p) {
  uint32_t a = 256;
  while (reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

// y = x @ w^T for x [M, K] (M <= 64) and w [N, K], both contiguous half-precision CUDA tensors of one dtype.
at::Tensor tuned_linear(const at::Tensor& x, const at::Tensor& w) {
  const char* op = "segki::tuned_linear";
  check_inputs(x, w);
  const int64_t m = x.size(0), n = w.size(0), k = x.size(1);
  auto y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  c10::cuda::CUDAGuard guard(x.device());
  const auto t = x.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  const Problem p(m, n, k, t);
  cublasLtHandle_t h = at::cuda::getCurrentCUDABlasLtHandle();
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  void* ws = workspace(x.get_device(), stream);
  static std::mutex mu;
  static std::map<Key, cublasLtMatmulAlgo_t> chosen;
  const uint32_t align_w = alignment(w.data_ptr()), align_x = alignment(x.data_ptr());
  const Key key{m, n, k, (int)x.scalar_type(), x.get_device(), align_w, align_x};
  std::unique_lock<std::mutex> lock(mu);
  auto it = chosen.find(key);
  if (it == chosen.end()) {
    const auto cands = p.candidates(h, align_w, align_x);
    TORCH_CHECK(!cands.empty(), op, ": cuBLASLt offers no algorithm for ", m, " x ", n, " x ", k);
    cudaStreamCaptureStatus capturing;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    if (capturing != cudaStreamCaptureStatusNone) {   // no timing inside a graph: the first pick, not remembered
      lock.unlock();
      SEGKI_LT_CHECK(run(h, p, cands[0].algo, x.data_ptr(), w.data_ptr(), y.data_ptr(), ws, stream));
      return y;
    }
    auto flush = at::empty({(int64_t)(2 * at::cuda::getCurrentDeviceProperties()->l2CacheSize)},
                           x.options().dtype(at::kByte));
    size_t best = 0;
    float best_ms = kFailed;
    for (size_t i = 0; i < cands.size(); ++i) {
      const float ms = time_algo(h, p, cands[i].algo, x.data_ptr(), w.data_ptr(), y.data_ptr(), ws, flush, stream);
      if (ms < best_ms) best = i, best_ms = ms;
    }
    TORCH_CHECK(best_ms < kFailed, op, ": every cuBLASLt candidate failed for ", m, " x ", n, " x ", k);
    it = chosen.emplace(key, cands[best].algo).first;
  }
  const cublasLtMatmulAlgo_t algo = it->second;
  lock.unlock();
  SEGKI_LT_CHECK(run(h, p, algo, x.data_ptr(), w.data_ptr(), y.data_ptr(), ws, stream));
  return y;
}

#else

at::Tensor tuned_linear(const at::Tensor& x, const at::Tensor& w) {
  check_inputs(x, w);
  TORCH_WARN_ONCE("segki: the extension was built without cuBLASLt; tuned_linear runs cuBLAS's default algorithm");
  return at::mm(x, w.t());
}

#endif  // SEGKI_HAVE_CUBLASLT

}  // namespace

TORCH_LIBRARY_IMPL(segki, CUDA, m) { m.impl("tuned_linear", &tuned_linear); }

}  // namespace segki
