// Batched products of small float32 matrices for XLA:CPU, c[b] = op(a[b]) @ op(b[b]).
//
// XLA:CPU runs a batch of thousands of small products (DLRM's interaction:
// 4096 x [27 x 64] @ [64 x 27]) one small GEMM at a time, several times slower
// than the memory traffic allows, and slower still when an operand is
// transposed. Here the batch is split into tasks shared with XLA's own intra-op
// thread pool (which runs the program's other thunks too), and per batch element:
//   1. pack op(b[b]) into a K x Np panel (Np = N rounded up to 32, zero padded),
//      which also absorbs a transposed b (8 x 8 blocks transposed in registers),
//      so the inner loop reads rows (an op(b) that already is such a panel, N a
//      multiple of 32, is read in place);
//   2. for each block of up to 3 rows of op(a[b]) and 32 columns, keep the 3 x 32
//      block of c in 12 vector registers while k runs: per k, 3 broadcasts of a
//      and 4 loads of the panel feed 12 fused multiply-adds (12 independent sums
//      hide the multiply-add latency; with the 4 inputs that fills AVX2's 16 registers).
//      The 12 sums are named variables, not an array: GCC 12 spilled an array of
//      them to the stack on every k, which halved the speed.
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
// rows < 3 reads row 0 in place of the missing rows and does not store them.
__attribute__((target("avx2,fma"))) void TileAvx2(const float* a, const Problem& p, const float* panel, int64_t np,
                                                 int rows, float* c_tile, int64_t ldc) {
  const int64_t k = p.k, a_col = p.a_col;
  const float* a0 = a;
  const float* a1 = rows > 1 ? a + p.a_row : a;
  const float* a2 = rows > 2 ? a + 2 * p.a_row : a;
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00;
  __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00;
  __m256 c20 = c00, c21 = c00, c22 = c00, c23 = c00;
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* row = panel + kk * np;
    const __m256 y0 = _mm256_loadu_ps(row), y1 = _mm256_loadu_ps(row + 8);
    const __m256 y2 = _mm256_loadu_ps(row + 16), y3 = _mm256_loadu_ps(row + 24);
    const int64_t at = kk * a_col;
    __m256 x = _mm256_broadcast_ss(a0 + at);
    c00 = _mm256_fmadd_ps(x, y0, c00); c01 = _mm256_fmadd_ps(x, y1, c01);
    c02 = _mm256_fmadd_ps(x, y2, c02); c03 = _mm256_fmadd_ps(x, y3, c03);
    x = _mm256_broadcast_ss(a1 + at);
    c10 = _mm256_fmadd_ps(x, y0, c10); c11 = _mm256_fmadd_ps(x, y1, c11);
    c12 = _mm256_fmadd_ps(x, y2, c12); c13 = _mm256_fmadd_ps(x, y3, c13);
    x = _mm256_broadcast_ss(a2 + at);
    c20 = _mm256_fmadd_ps(x, y0, c20); c21 = _mm256_fmadd_ps(x, y1, c21);
    c22 = _mm256_fmadd_ps(x, y2, c22); c23 = _mm256_fmadd_ps(x, y3, c23);
  }
  _mm256_storeu_ps(c_tile, c00); _mm256_storeu_ps(c_tile + 8, c01);
  _mm256_storeu_ps(c_tile + 16, c02); _mm256_storeu_ps(c_tile + 24, c03);
  if (rows < 2) return;
  c_tile += ldc;
  _mm256_storeu_ps(c_tile, c10); _mm256_storeu_ps(c_tile + 8, c11);
  _mm256_storeu_ps(c_tile + 16, c12); _mm256_storeu_ps(c_tile + 24, c13);
  if (rows < 3) return;
  c_tile += ldc;
  _mm256_storeu_ps(c_tile, c20); _mm256_storeu_ps(c_tile + 8, c21);
  _mm256_storeu_ps(c_tile + 16, c22); _mm256_storeu_ps(c_tile + 24, c23);
}

bool HasAvx2Fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

// panel[kk, j] = b[j * k + kk] for j < n8 = n rounded down to 8, in 8 x 8 blocks
// transposed in registers; the scalar pack does the rest.
__attribute__((target("avx2,fma"))) void PackTransposedAvx2(const float* b, int64_t n8, int64_t k8, int64_t k,
                                                           float* panel, int64_t np) {
  for (int64_t j = 0; j < n8; j += 8) {
    const float* src = b + j * k;
    for (int64_t kk = 0; kk < k8; kk += 8) {
      __m256 r0 = _mm256_loadu_ps(src + 0 * k + kk), r1 = _mm256_loadu_ps(src + 1 * k + kk);
      __m256 r2 = _mm256_loadu_ps(src + 2 * k + kk), r3 = _mm256_loadu_ps(src + 3 * k + kk);
      __m256 r4 = _mm256_loadu_ps(src + 4 * k + kk), r5 = _mm256_loadu_ps(src + 5 * k + kk);
      __m256 r6 = _mm256_loadu_ps(src + 6 * k + kk), r7 = _mm256_loadu_ps(src + 7 * k + kk);
      __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
      __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
      __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
      __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
      r0 = _mm256_shuffle_ps(t0, t2, 0x44); r1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      r2 = _mm256_shuffle_ps(t1, t3, 0x44); r3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      r4 = _mm256_shuffle_ps(t4, t6, 0x44); r5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      r6 = _mm256_shuffle_ps(t5, t7, 0x44); r7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float* dst = panel + kk * np + j;
      _mm256_storeu_ps(dst + 0 * np, _mm256_permute2f128_ps(r0, r4, 0x20));
      _mm256_storeu_ps(dst + 1 * np, _mm256_permute2f128_ps(r1, r5, 0x20));
      _mm256_storeu_ps(dst + 2 * np, _mm256_permute2f128_ps(r2, r6, 0x20));
      _mm256_storeu_ps(dst + 3 * np, _mm256_permute2f128_ps(r3, r7, 0x20));
      _mm256_storeu_ps(dst + 4 * np, _mm256_permute2f128_ps(r0, r4, 0x31));
      _mm256_storeu_ps(dst + 5 * np, _mm256_permute2f128_ps(r1, r5, 0x31));
      _mm256_storeu_ps(dst + 6 * np, _mm256_permute2f128_ps(r2, r6, 0x31));
      _mm256_storeu_ps(dst + 7 * np, _mm256_permute2f128_ps(r3, r7, 0x31));
    }
  }
}
#endif

void Tile(const float* a, const Problem& p, const float* panel, int64_t np, int rows, float* c_tile, int64_t ldc) {
#ifdef TPUREC_X86
  if (HasAvx2Fma()) return TileAvx2(a, p, panel, np, rows, c_tile, ldc);
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
    int64_t n_done = 0, k_done = 0;  // op(b)[0:k_done, 0:n_done] packed by the vector code
#ifdef TPUREC_X86
    if (p.b_row == 1 && p.b_col == p.k && HasAvx2Fma()) {  // op(b) = b^T, b [n, k] row major
      n_done = p.n / 8 * 8;
      k_done = p.k / 8 * 8;
      PackTransposedAvx2(b, n_done, k_done, p.k, panel.data(), np);
    }
#endif
    for (int64_t kk = 0; kk < p.k; ++kk) {
      float* dst = panel.data() + kk * np;
      const float* src = b + kk * p.b_row;
      if (p.b_col == 1) {
        std::memcpy(dst, src, p.n * sizeof(float));
      } else {
        for (int64_t j = kk < k_done ? n_done : 0; j < p.n; ++j) dst[j] = src[j * p.b_col];
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
