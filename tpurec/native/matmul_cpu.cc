// Batched products of small float32 matrices for XLA:CPU, c[b] = op(a[b]) @ op(b[b]).
//
// XLA:CPU runs a batch of thousands of small products (DLRM's interaction:
// 4096 x [27 x 64] @ [64 x 27]) one small GEMM at a time, several times slower
// than the memory traffic allows, and slower still when an operand is
// transposed. Here the batch is split into tasks shared with XLA's own intra-op
// thread pool (which runs the program's other thunks too), and per batch element:
//   1. pack op(b[b]) into a K x Np panel (Np = N rounded up to 32, zero padded),
//      which also absorbs a transposed b, so the inner loop reads rows (an op(b)
//      that already is such a panel, N a multiple of 32, is read in place);
//   2. for each block of up to 3 rows of op(a[b]) and 32 columns, keep the 3 x 32
//      block of c in 12 vector registers while k runs: per k, 3 broadcasts of a
//      and 4 loads of the panel feed 12 fused multiply-adds (12 independent sums
//      hide the multiply-add latency; with the 4 inputs that fills AVX2's 16 registers).
// op(a) = a or a^T (attribute trans_a), likewise b; a transposed a only changes
// the stride of the broadcasts. Float sums run over k in order, with fused
// multiply-adds on CPUs that have them (AVX2 + FMA, chosen at run time), plain
// multiply-adds elsewhere.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_workers.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TPUREC_X86 1
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTileRows = 3;
constexpr int64_t kTileCols = 32;
// Below this many multiply-adds a call runs on one thread (waking workers costs more).
constexpr int64_t kMinParallelWork = 1 << 16;

struct Problem {
  int64_t m, n, k;
  int64_t a_row, a_col;  // strides of op(a)'s rows (m) and columns (k)
  int64_t b_row, b_col;  // strides of op(b)'s rows (k) and columns (n)
};

// c_tile[r, 0:32] = sum_k a[r, k] * panel[k, 0:32] for r < rows; c_tile's rows are ldc apart.
void TilePortable(const float* a, const Problem& p, const float* panel, int64_t np, int rows, float* c_tile,
                  int64_t ldc) {
  float acc[kTileRows][kTileCols] = {};
  for (int64_t kk = 0; kk < p.k; ++kk) {
    const float* row = panel + kk * np;
    for (int r = 0; r < rows; ++r) {
      const float x = a[r * p.a_row + kk * p.a_col];
      for (int64_t j = 0; j < kTileCols; ++j) acc[r][j] += x * row[j];
    }
  }
  for (int r = 0; r < rows; ++r) std::memcpy(c_tile + r * ldc, acc[r], sizeof(acc[r]));
}

#ifdef TPUREC_X86
template <int R>
__attribute__((target("avx2,fma"))) void TileAvx2(const float* a, const Problem& p, const float* panel, int64_t np,
                                                 float* c_tile, int64_t ldc) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < p.k; ++kk) {
    __m256 x[R];
    for (int r = 0; r < R; ++r) x[r] = _mm256_broadcast_ss(a + r * p.a_row + kk * p.a_col);
    const float* row = panel + kk * np;
    for (int v = 0; v < 4; ++v) {
      const __m256 y = _mm256_loadu_ps(row + 8 * v);
      for (int r = 0; r < R; ++r) acc[r][v] = _mm256_fmadd_ps(x[r], y, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(c_tile + r * ldc + 8 * v, acc[r][v]);
}

bool HasAvx2Fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif

void Tile(const float* a, const Problem& p, const float* panel, int64_t np, int rows, float* c_tile, int64_t ldc) {
#ifdef TPUREC_X86
  if (HasAvx2Fma()) {
    switch (rows) {
      case 3: return TileAvx2<3>(a, p, panel, np, c_tile, ldc);
      case 2: return TileAvx2<2>(a, p, panel, np, c_tile, ldc);
      default: return TileAvx2<1>(a, p, panel, np, c_tile, ldc);
    }
  }
#endif
  TilePortable(a, p, panel, np, rows, c_tile, ldc);
}

// c = op(a) @ op(b) for one batch element; panel and rows_out are the calling thread's scratch.
void Product(const float* a, const float* b, float* c, const Problem& p, std::vector<float>& panel,
             std::vector<float>& rows_out) {
  const int64_t np = (p.n + kTileCols - 1) / kTileCols * kTileCols;
  const float* rows_of_b = b;  // op(b) as K rows of np floats
  if (p.b_col != 1 || p.n != np) {
    panel.resize(p.k * np);
    for (int64_t kk = 0; kk < p.k; ++kk) {
      float* dst = panel.data() + kk * np;
      const float* src = b + kk * p.b_row;
      if (p.b_col == 1) {
        std::memcpy(dst, src, p.n * sizeof(float));
      } else {
        for (int64_t j = 0; j < p.n; ++j) dst[j] = src[j * p.b_col];
      }
      std::fill(dst + p.n, dst + np, 0.0f);
    }
    rows_of_b = panel.data();
  }
  const bool direct = p.n == np;  // c's rows hold whole tiles: write them in place
  rows_out.resize(kTileRows * np);
  for (int64_t i = 0; i < p.m; i += kTileRows) {
    const int rows = static_cast<int>(std::min(kTileRows, p.m - i));
    float* out = direct ? c + i * p.n : rows_out.data();
    for (int64_t j = 0; j < np; j += kTileCols) Tile(a + i * p.a_row, p, rows_of_b + j, np, rows, out + j, np);
    if (!direct)
      for (int r = 0; r < rows; ++r) std::memcpy(c + (i + r) * p.n, rows_out.data() + r * np, p.n * sizeof(float));
  }
}

ffi::Error BatchedMatmul(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                         ffi::ResultBuffer<ffi::F32> c, bool trans_a, bool trans_b) {
  const auto da = a.dimensions();
  const auto db = b.dimensions();
  const auto dc = c->dimensions();
  if (da.size() != 3 || db.size() != 3 || dc.size() != 3)
    return ffi::Error::InvalidArgument("tpurec_batched_matmul takes rank-3 operands");
  const int64_t batch = da[0];
  Problem p;
  p.m = trans_a ? da[2] : da[1];
  p.k = trans_a ? da[1] : da[2];
  p.n = trans_b ? db[1] : db[2];
  const int64_t kb = trans_b ? db[2] : db[1];
  if (db[0] != batch || kb != p.k || dc[0] != batch || dc[1] != p.m || dc[2] != p.n)
    return ffi::Error::InvalidArgument("tpurec_batched_matmul: operand shapes do not match");
  p.a_row = trans_a ? 1 : p.k;
  p.a_col = trans_a ? p.m : 1;
  p.b_row = trans_b ? 1 : p.n;
  p.b_col = trans_b ? p.k : 1;
  const float* pa = a.typed_data();
  const float* pb = b.typed_data();
  float* pc = c->typed_data();
  const int64_t a_size = p.m * p.k, b_size = p.k * p.n, c_size = p.m * p.n;
  if (c_size == 0) return ffi::Error::Success();
  if (p.k == 0) {
    std::fill(pc, pc + batch * c_size, 0.0f);
    return ffi::Error::Success();
  }
  const int64_t work = batch * p.m * p.n * p.k;
  const tpurec_native::XlaWorkers workers(xla_pool);
  const int threads = work < kMinParallelWork ? 1 : workers.Size();
  // A few tasks per thread evens out a thread that starts late.
  const int64_t tasks = std::min<int64_t>(batch, static_cast<int64_t>(threads) * 8);
  workers.For(
      tasks, threads,
      [&](int64_t t) {
        thread_local std::vector<float> panel, rows_out;  // XLA's threads are persistent: reused across calls
        const int64_t begin = batch * t / tasks, end = batch * (t + 1) / tasks;
        for (int64_t i = begin; i < end; ++i)
          Product(pa + i * a_size, pb + i * b_size, pc + i * c_size, p, panel, rows_out);
      });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TpurecBatchedMatmul, BatchedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"));
