// Native XLA:CPU kernels of the tpurec sparse op set (DESIGN.md, contract 4).
//
// Same semantics as tpurec/sparse/kernels/reference.py:
//   * entry i of partition p is valid when p*size <= i < row_pointers[p] and
//     its id is a row of the table (padding id 2**31-1 is never a row);
//   * forward: out[sample] += gain * table[id] over valid entries;
//   * gradient ops: per distinct touched id, g = sum gain * grad_output[sample]
//     over its entries, then the optimizer on that row only.
//
// Threads own partitions (rows are partitioned by id % P), so two threads never
// touch the same row and updates need no atomics, exactly like SparseCores.
// If an input breaks that invariant (an id outside its partition's residue
// class) the update falls back to one thread, which is slower but still right.
//
// Float math follows the reference's operation order; the build uses
// -ffp-contract=off so the compiler does not fuse a*b+c into FMAs that round
// differently from XLA.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_workers.h"

namespace ffi = xla::ffi;

namespace {

using tpurec_native::XlaWorkers;

// ---------------------------------------------------------------------------
// CSR input.

struct Csr {
  const int32_t* row_pointers;
  const int32_t* ids;
  const int32_t* samples;
  const float* gains;
  int64_t partitions;
  int64_t size;  // entries per partition buffer

  // Valid range of partition p: [begin, end).
  int64_t Begin(int64_t p) const { return p * size; }
  int64_t End(int64_t p) const {
    int64_t end = row_pointers[p];
    return std::max(Begin(p), std::min(end, (p + 1) * size));
  }
};

ffi::Error MakeCsr(ffi::Buffer<ffi::S32>& rp, ffi::Buffer<ffi::S32>& ids, ffi::Buffer<ffi::S32>& samples,
                   ffi::Buffer<ffi::F32>& gains, Csr* csr) {
  int64_t p = static_cast<int64_t>(rp.element_count());
  int64_t n = static_cast<int64_t>(ids.element_count());
  if (samples.element_count() != ids.element_count() || gains.element_count() != ids.element_count())
    return ffi::Error::InvalidArgument("embedding_ids, sample_ids and gains must have the same size");
  if (p == 0 ? n != 0 : n % p != 0)
    return ffi::Error::InvalidArgument("embedding_ids size must be a multiple of the number of partitions");
  *csr = Csr{rp.typed_data(), ids.typed_data(), samples.typed_data(), gains.typed_data(), p, p ? n / p : 0};
  return ffi::Error::Success();
}

// Below this many multiply-adds a call runs on one thread (waking workers costs more).
constexpr int64_t kMinParallelWork = 1 << 15;

// ---------------------------------------------------------------------------
// Forward: each thread owns a block of output rows, so output rows are written
// by one thread only (no atomics, no private copies), and every output row sums
// its entries in input order (the reference's order). A thread first collects
// the indices of its valid entries in one branch-free scan, then accumulates
// them in that order: within a partition entries are sorted by id, so table
// reads walk the table forward. Table rows (random reads over a large table)
// and output rows (random over the thread's block) are prefetched a few entries
// ahead.

constexpr int64_t kForwardPrefetch = 16;

template <int kWrite>
void PrefetchLines(const float* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(float)); b += 64) __builtin_prefetch(p + b, kWrite);
}

ffi::Error SparseDenseMatmul(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::S32> rp, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> samples,
                             ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::F32> table,
                             ffi::ResultBuffer<ffi::F32> out) {
  Csr csr;
  if (ffi::Error e = MakeCsr(rp, ids, samples, gains, &csr); e.failure()) return e;
  if (table.dimensions().size() != 2 || out->dimensions().size() != 2)
    return ffi::Error::InvalidArgument("table and output must be 2-D");
  const int64_t rows = table.dimensions()[0], dim = table.dimensions()[1];
  const int64_t batch = out->dimensions()[0];
  if (out->dimensions()[1] != dim) return ffi::Error::InvalidArgument("output dim differs from table dim");
  const float* w = table.typed_data();
  float* o = out->typed_data();

  const int64_t n = csr.partitions * csr.size;
  const XlaWorkers workers(xla_pool);
  const int threads = n * dim < kMinParallelWork ? 1 : workers.Size();
  const int64_t block = (batch + threads - 1) / std::max(threads, 1);
  workers.For(threads, threads, [&](int64_t t) {
    const int64_t lo = t * block, hi = std::min(batch, lo + block);
    if (lo >= hi) return;
    const uint64_t span = static_cast<uint64_t>(hi - lo);
    std::memset(o + lo * dim, 0, sizeof(float) * (hi - lo) * dim);
    thread_local std::vector<int32_t> mine;  // reused across calls (XLA's threads are persistent)
    if (static_cast<int64_t>(mine.size()) < n) mine.resize(n);
    int32_t* __restrict__ m = mine.data();
    const int32_t* __restrict__ all_ids = csr.ids;
    const int32_t* __restrict__ all_samples = csr.samples;
    int64_t k = 0;
    for (int64_t p = 0; p < csr.partitions; ++p) {
      for (int64_t i = csr.Begin(p), end = csr.End(p); i < end; ++i) {
        m[k] = static_cast<int32_t>(i);
        k += (static_cast<uint64_t>(all_samples[i] - lo) < span) &
             (static_cast<uint64_t>(static_cast<int64_t>(all_ids[i])) < static_cast<uint64_t>(rows));
      }
    }
    for (int64_t j = 0; j < std::min(k, kForwardPrefetch); ++j) {
      PrefetchLines<0>(w + all_ids[m[j]] * dim, dim);
      PrefetchLines<1>(o + all_samples[m[j]] * dim, dim);
    }
    for (int64_t j = 0; j < k; ++j) {
      if (j + kForwardPrefetch < k) {
        const int64_t q = m[j + kForwardPrefetch];
        PrefetchLines<0>(w + all_ids[q] * dim, dim);
        PrefetchLines<1>(o + all_samples[q] * dim, dim);
      }
      const int64_t i = m[j];
      const float g = csr.gains[i];
      const float* __restrict__ src = w + all_ids[i] * dim;
      float* __restrict__ dst = o + all_samples[i] * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] += g * src[d];
    }
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Gradient ops: group valid entries by id (per partition), sum the gradient of
// each touched row, apply the optimizer to that row.

struct Optimizer {
  virtual ~Optimizer() = default;
  // g: the summed gradient of row `row` (dim floats; may be modified).
  virtual void Apply(int64_t row, float* g) const = 0;
  // Starts loading the state of a row that will be updated soon.
  virtual void Prefetch(int64_t row) const = 0;
};

// Table rows are random accesses over a large table: fetching a few rows
// ahead hides much of the memory latency.
constexpr int64_t kPrefetchDistance = 8;

void PrefetchRow(const float* base, int64_t row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(base + row * dim);
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(float)); b += 64) __builtin_prefetch(p + b, 1);
}

ffi::Error UpdateTouchedRows(const XlaWorkers& workers, const Csr& csr, const float* grad_output, int64_t batch,
                             int64_t rows, int64_t dim, const Optimizer& opt) {
  const int64_t P = csr.partitions;
  // Valid entry indices, grouped per partition at offset p*size, sorted by id.
  std::vector<int32_t> order(P * csr.size);
  std::vector<int64_t> count(P, 0);
  std::atomic<bool> owned{true};  // every id lives in partition id % P
  auto by_id = [&](int32_t a, int32_t b) {
    return csr.ids[a] != csr.ids[b] ? csr.ids[a] < csr.ids[b] : a < b;
  };
  const int64_t n = P * csr.size;
  const int threads = n * dim < kMinParallelWork ? 1 : workers.Size();

  workers.For(P, threads, [&](int64_t p) {
    int32_t* idx = order.data() + csr.Begin(p);
    int64_t k = 0;
    bool sorted = true, own = true;
    for (int64_t i = csr.Begin(p), end = csr.End(p); i < end; ++i) {
      const int64_t id = csr.ids[i], s = csr.samples[i];
      if (id < 0 || id >= rows || s < 0 || s >= batch) continue;
      if (k > 0 && csr.ids[idx[k - 1]] > id) sorted = false;
      if (id % P != p) own = false;
      idx[k++] = static_cast<int32_t>(i);
    }
    // preprocess_kjt sorts partitions by (id, sample); other producers may not.
    if (!sorted) std::sort(idx, idx + k, by_id);
    count[p] = k;
    if (!own) owned.store(false);
  });

  auto process = [&](const int32_t* idx, int64_t k) {
    std::vector<float> g(dim);
    for (int64_t j = 0; j < k;) {
      const int32_t id = csr.ids[idx[j]];
      std::fill(g.begin(), g.end(), 0.0f);
      for (; j < k && csr.ids[idx[j]] == id; ++j) {
        if (kPrefetchDistance && j + kPrefetchDistance < k) opt.Prefetch(csr.ids[idx[j + kPrefetchDistance]]);
        const float gain = csr.gains[idx[j]];
        const float* __restrict__ go = grad_output + static_cast<int64_t>(csr.samples[idx[j]]) * dim;
        float* __restrict__ acc = g.data();
        for (int64_t d = 0; d < dim; ++d) acc[d] += go[d] * gain;
      }
      opt.Apply(id, g.data());
    }
  };

  if (owned.load()) {
    workers.For(P, threads, [&](int64_t p) { process(order.data() + csr.Begin(p), count[p]); });
  } else {
    // An id may appear in several partitions: merge them and run on one thread.
    std::vector<int32_t> all;
    for (int64_t p = 0; p < P; ++p) all.insert(all.end(), order.data() + csr.Begin(p), order.data() + csr.Begin(p) + count[p]);
    std::sort(all.begin(), all.end(), by_id);
    process(all.data(), static_cast<int64_t>(all.size()));
  }
  return ffi::Error::Success();
}

// Outputs alias the inputs (input_output_aliases); if XLA ever hands us a
// distinct buffer, start it from the input so untouched rows are right.
void CopyIfDistinct(const ffi::Buffer<ffi::F32>& in, ffi::ResultBuffer<ffi::F32>& out) {
  if (out->typed_data() != in.typed_data())
    std::memcpy(out->typed_data(), in.typed_data(), sizeof(float) * in.element_count());
}

struct GradArgs {
  Csr csr;
  int64_t batch = 0, rows = 0, dim = 0;
};

ffi::Error CheckGrad(ffi::Buffer<ffi::S32>& rp, ffi::Buffer<ffi::S32>& ids, ffi::Buffer<ffi::S32>& samples,
                     ffi::Buffer<ffi::F32>& gains, ffi::Buffer<ffi::F32>& grad_output, ffi::Buffer<ffi::F32>& hyper,
                     size_t num_hyper, ffi::Buffer<ffi::F32>& table, GradArgs* args) {
  if (ffi::Error e = MakeCsr(rp, ids, samples, gains, &args->csr); e.failure()) return e;
  if (table.dimensions().size() != 2 || grad_output.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("table and grad_output must be 2-D");
  args->rows = table.dimensions()[0];
  args->dim = table.dimensions()[1];
  args->batch = grad_output.dimensions()[0];
  if (grad_output.dimensions()[1] != args->dim) return ffi::Error::InvalidArgument("grad_output dim differs from table dim");
  if (hyper.element_count() != num_hyper)
    return ffi::Error::InvalidArgument("expected " + std::to_string(num_hyper) + " hyperparameters");
  return ffi::Error::Success();
}

// ----- SGD: w -= lr * g

struct Sgd final : Optimizer {
  float* w;
  int64_t dim;
  float lr;
  void Apply(int64_t row, float* g) const override {
    float* __restrict__ wr = w + row * dim;
    for (int64_t d = 0; d < dim; ++d) wr[d] = wr[d] - lr * g[d];
  }
  void Prefetch(int64_t row) const override { PrefetchRow(w, row, dim); }
};

ffi::Error GradSgd(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::S32> rp, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> samples,
                   ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::F32> grad_output, ffi::Buffer<ffi::F32> hyper,
                   ffi::Buffer<ffi::F32> table, ffi::ResultBuffer<ffi::F32> table_out) {
  GradArgs a;
  if (ffi::Error e = CheckGrad(rp, ids, samples, gains, grad_output, hyper, 1, table, &a); e.failure()) return e;
  CopyIfDistinct(table, table_out);
  Sgd opt;
  opt.w = table_out->typed_data();
  opt.dim = a.dim;
  opt.lr = hyper.typed_data()[0];
  return UpdateTouchedRows(XlaWorkers(xla_pool), a.csr, grad_output.typed_data(), a.batch, a.rows, a.dim, opt);
}

// ----- Adagrad: m += g*g; w -= lr * g / (sqrt(m) + eps)

struct Adagrad final : Optimizer {
  float *w, *m;
  int64_t dim;
  float lr, eps;
  void Apply(int64_t row, float* g) const override {
    float* __restrict__ wr = w + row * dim;
    float* __restrict__ mr = m + row * dim;
    for (int64_t d = 0; d < dim; ++d) {
      mr[d] = mr[d] + g[d] * g[d];
      wr[d] = wr[d] - lr * g[d] / (std::sqrt(mr[d]) + eps);
    }
  }
  void Prefetch(int64_t row) const override {
    PrefetchRow(w, row, dim);
    PrefetchRow(m, row, dim);
  }
};

ffi::Error GradAdagrad(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::S32> rp, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> samples,
                       ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::F32> grad_output, ffi::Buffer<ffi::F32> hyper,
                       ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> acc, ffi::ResultBuffer<ffi::F32> table_out,
                       ffi::ResultBuffer<ffi::F32> acc_out) {
  GradArgs a;
  if (ffi::Error e = CheckGrad(rp, ids, samples, gains, grad_output, hyper, 2, table, &a); e.failure()) return e;
  if (acc.element_count() != table.element_count()) return ffi::Error::InvalidArgument("accumulator must match the table");
  CopyIfDistinct(table, table_out);
  CopyIfDistinct(acc, acc_out);
  Adagrad opt;
  opt.w = table_out->typed_data();
  opt.m = acc_out->typed_data();
  opt.dim = a.dim;
  opt.lr = hyper.typed_data()[0];
  opt.eps = hyper.typed_data()[1];
  return UpdateTouchedRows(XlaWorkers(xla_pool), a.csr, grad_output.typed_data(), a.batch, a.rows, a.dim, opt);
}

// ----- Row-wise Adagrad: g += wd*w; m += mean(g*g); w -= lr / (sqrt(m) + eps) * g

struct RowwiseAdagrad final : Optimizer {
  float *w, *m;
  int64_t dim;
  float lr, eps, wd;
  void Apply(int64_t row, float* g) const override {
    float* __restrict__ wr = w + row * dim;
    for (int64_t d = 0; d < dim; ++d) g[d] = g[d] + wd * wr[d];
    // Eight partial sums: a single running sum is a serial add chain that the
    // compiler may not reorder (no fast-math); XLA's reduction is not serial either.
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8)
      for (int k = 0; k < 8; ++k) part[k] += g[d + k] * g[d + k];
    for (; d < dim; ++d) part[0] += g[d] * g[d];
    const float sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    m[row] = m[row] + sum / static_cast<float>(dim);
    const float scale = lr / (std::sqrt(m[row]) + eps);
    for (d = 0; d < dim; ++d) wr[d] = wr[d] - scale * g[d];
  }
  void Prefetch(int64_t row) const override {
    PrefetchRow(w, row, dim);
    __builtin_prefetch(m + row, 1);
  }
};

ffi::Error GradRowwiseAdagrad(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::S32> rp, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> samples,
                              ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::F32> grad_output,
                              ffi::Buffer<ffi::F32> hyper, ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> acc,
                              ffi::ResultBuffer<ffi::F32> table_out, ffi::ResultBuffer<ffi::F32> acc_out) {
  GradArgs a;
  if (ffi::Error e = CheckGrad(rp, ids, samples, gains, grad_output, hyper, 3, table, &a); e.failure()) return e;
  if (static_cast<int64_t>(acc.element_count()) != a.rows)
    return ffi::Error::InvalidArgument("row-wise accumulator must have one value per row");
  CopyIfDistinct(table, table_out);
  CopyIfDistinct(acc, acc_out);
  RowwiseAdagrad opt;
  opt.w = table_out->typed_data();
  opt.m = acc_out->typed_data();
  opt.dim = a.dim;
  opt.lr = hyper.typed_data()[0];
  opt.eps = hyper.typed_data()[1];
  opt.wd = hyper.typed_data()[2];
  return UpdateTouchedRows(XlaWorkers(xla_pool), a.csr, grad_output.typed_data(), a.batch, a.rows, a.dim, opt);
}

// ----- Adam (lazy, bias-corrected; the bias corrections come precomputed):
// m1 = b1 m1 + (1-b1) g; m2 = b2 m2 + (1-b2) g g;
// w -= lr * (m1/bc1 / (sqrt(m2/bc2) + eps) + wd * w)

struct Adam final : Optimizer {
  float *w, *m1, *m2;
  int64_t dim;
  float lr, b1, one_minus_b1, b2, one_minus_b2, eps, wd, bc1, bc2;
  void Apply(int64_t row, float* g) const override {
    float* __restrict__ wr = w + row * dim;
    float* __restrict__ m1r = m1 + row * dim;
    float* __restrict__ m2r = m2 + row * dim;
    for (int64_t d = 0; d < dim; ++d) {
      m1r[d] = b1 * m1r[d] + one_minus_b1 * g[d];
      m2r[d] = b2 * m2r[d] + one_minus_b2 * g[d] * g[d];
      const float m1_hat = m1r[d] / bc1, m2_hat = m2r[d] / bc2;
      wr[d] = wr[d] - lr * (m1_hat / (std::sqrt(m2_hat) + eps) + wd * wr[d]);
    }
  }
  void Prefetch(int64_t row) const override {
    PrefetchRow(w, row, dim);
    PrefetchRow(m1, row, dim);
    PrefetchRow(m2, row, dim);
  }
};

ffi::Error GradAdam(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::S32> rp, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> samples,
                    ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::F32> grad_output, ffi::Buffer<ffi::F32> hyper,
                    ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> mom1, ffi::Buffer<ffi::F32> mom2,
                    ffi::ResultBuffer<ffi::F32> table_out, ffi::ResultBuffer<ffi::F32> mom1_out,
                    ffi::ResultBuffer<ffi::F32> mom2_out) {
  GradArgs a;
  if (ffi::Error e = CheckGrad(rp, ids, samples, gains, grad_output, hyper, 9, table, &a); e.failure()) return e;
  if (mom1.element_count() != table.element_count() || mom2.element_count() != table.element_count())
    return ffi::Error::InvalidArgument("momentum1/momentum2 must match the table");
  CopyIfDistinct(table, table_out);
  CopyIfDistinct(mom1, mom1_out);
  CopyIfDistinct(mom2, mom2_out);
  const float* h = hyper.typed_data();
  Adam opt;
  opt.w = table_out->typed_data();
  opt.m1 = mom1_out->typed_data();
  opt.m2 = mom2_out->typed_data();
  opt.dim = a.dim;
  opt.lr = h[0];
  opt.b1 = h[1];
  opt.one_minus_b1 = h[2];
  opt.b2 = h[3];
  opt.one_minus_b2 = h[4];
  opt.eps = h[5];
  opt.wd = h[6];
  opt.bc1 = h[7];
  opt.bc2 = h[8];
  return UpdateTouchedRows(XlaWorkers(xla_pool), a.csr, grad_output.typed_data(), a.batch, a.rows, a.dim, opt);
}

}  // namespace

#define CSR_ARGS                        \
  .Arg<ffi::Buffer<ffi::S32>>()         \
      .Arg<ffi::Buffer<ffi::S32>>()     \
      .Arg<ffi::Buffer<ffi::S32>>()     \
      .Arg<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(TpurecSparseDenseMatmul, SparseDenseMatmul,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() CSR_ARGS.Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TpurecGradSgd, GradSgd,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() CSR_ARGS
                                  .Arg<ffi::Buffer<ffi::F32>>()  // grad_output
                                  .Arg<ffi::Buffer<ffi::F32>>()  // hyperparameters
                                  .Arg<ffi::Buffer<ffi::F32>>()  // table
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TpurecGradAdagrad, GradAdagrad,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() CSR_ARGS
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // accumulator
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TpurecGradRowwiseAdagrad, GradRowwiseAdagrad,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() CSR_ARGS
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // accumulator [rows]
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TpurecGradAdam, GradAdam,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() CSR_ARGS
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // momentum1
                                  .Arg<ffi::Buffer<ffi::F32>>()  // momentum2
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
