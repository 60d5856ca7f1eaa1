// Native KeyedJaggedTensor -> SparseCore CSR preprocessing (DESIGN.md, contract 3).
//
// Same output as the numpy reference, tpurec/sparse/preprocess.py (_stack_csr),
// bit for bit:
//   * entries (id + row offset, sample = slot * batch + b, gain) of every
//     feature of the stack, in KJT order;
//   * MOD partitioning by id % P, then within a partition sorted by (id,
//     sample); entries come out of the KJT with samples ascending, so a stable
//     sort by id alone gives that order and keeps duplicates in KJT order;
//   * duplicate (id, sample) pairs merged, gains summed in double exactly the
//     way numpy's np.add.reduceat sums a run (first + pairwise sum of the
//     rest), then rounded to float; a run whose finite sum passes float32's
//     range stays unmerged;
//   * capacity check ("error"), or keeping the first max_unique distinct ids
//     and then the first max_ids entries of each partition ("drop").
//
// The caller (tpurec/sparse/kernels/native/preprocess.py) only sends inputs
// whose structure it has checked (keys, dtypes, shapes). The functions here
// check the data (bag lengths, id ranges) and return a status instead of
// raising; on any failure the caller reruns the numpy reference, which raises
// the documented ValueError / CapacityError. Nothing here keeps state.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include "threads.h"

namespace {

constexpr int32_t kPadId = 2147483647;  // PAD_ID = 2**31 - 1
constexpr int kOk = 0;
constexpr int kInvalid = 1;    // the data breaks a validation rule
constexpr int kOverflow = 2;   // a partition exceeds its capacity (overflow="error")

// Runs fn(i) for i in [0, n) on up to `threads` threads (the caller is one).
template <typename Fn>
void ParallelFor(int64_t n, int threads, Fn fn) {
  threads = static_cast<int>(std::min<int64_t>(threads, n));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::vector<std::thread> workers;
  workers.reserve(threads - 1);
  auto run = [&](int t) {
    for (int64_t i = t; i < n; i += threads) fn(i);
  };
  for (int t = 1; t < threads; ++t) workers.emplace_back(run, t);
  run(0);
  for (auto& w : workers) w.join();
}

// numpy's pairwise summation of n doubles (numpy/_core/src/umath/loops_utils.h.src),
// reproduced operation for operation so sums round identically.
double PairwiseSum(const double* a, int64_t n) {
  if (n < 8) {
    double res = -0.0;  // numpy starts at -0.0 so that a sum of -0.0 stays -0.0
    for (int64_t i = 0; i < n; ++i) res += a[i];
    return res;
  }
  if (n <= 128) {
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    int64_t i = 8;
    for (; i < n - (n % 8); i += 8) {
      for (int j = 0; j < 8; ++j) r[j] += a[i + j];
    }
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
  }
  int64_t n2 = n / 2;
  n2 -= n2 % 8;
  return PairwiseSum(a, n2) + PairwiseSum(a + n2, n - n2);
}

// np.add.reduceat over one run: the first element, plus the pairwise sum of the rest.
double ReduceatSum(const double* a, int64_t n) {
  return n == 1 ? a[0] : a[0] + PairwiseSum(a + 1, n - 1);
}

// Stable LSD radix sort of n packed words by the low `key_bits` bits of their
// upper half; `scratch` holds n words.
void RadixSortByKey(uint64_t* words, uint64_t* scratch, int64_t n, int key_bits) {
  constexpr int kDigitBits = 11;
  constexpr int kBuckets = 1 << kDigitBits;
  uint32_t count[kBuckets];
  uint64_t* from = words;
  uint64_t* to = scratch;
  for (int shift = 0; shift < key_bits; shift += kDigitBits) {
    std::fill(count, count + kBuckets, 0);
    const int s = 32 + shift;
    for (int64_t i = 0; i < n; ++i) ++count[(from[i] >> s) & (kBuckets - 1)];
    uint32_t sum = 0;
    for (int b = 0; b < kBuckets; ++b) {
      const uint32_t c = count[b];
      count[b] = sum;
      sum += c;
    }
    for (int64_t i = 0; i < n; ++i) to[count[(from[i] >> s) & (kBuckets - 1)]++] = from[i];
    std::swap(from, to);
  }
  if (from != words) std::copy(from, from + n, words);
}

// Division and remainder by a runtime constant d of 32-bit values with one
// 128-bit multiply (Lemire, Kaser, Kurz: "Faster remainder by direct
// computation", 2019); exact for every 32-bit n and d >= 1.
struct FastDivider {
  explicit FastDivider(uint32_t d) : d(d), m(~uint64_t{0} / d + 1) {}
  uint32_t Div(uint32_t n) const {
    return d == 1 ? n : static_cast<uint32_t>((static_cast<unsigned __int128>(m) * n) >> 64);
  }
  uint32_t Mod(uint32_t n) const {
    const uint64_t low = m * n;
    return static_cast<uint32_t>((static_cast<unsigned __int128>(low) * d) >> 64);
  }
  uint32_t d;
  uint64_t m;
};

int BitsFor(uint64_t max_value) {
  int bits = 0;
  while (bits < 64 && (max_value >> bits) != 0) ++bits;
  return bits;
}

}  // namespace

extern "C" {

// Validates the bag lengths of a KJT and computes where each key's ids start.
//
// lengths: [num_keys * batch_size]; key_starts: out, [num_keys + 1].
// Returns kInvalid when a length is negative or above num_values (checked
// before summing, so int64 sums cannot wrap) or the lengths do not add up to
// num_values.
int TpurecKjtKeyStarts(const int64_t* lengths, int64_t num_keys, int64_t batch_size, int64_t num_values,
                       int64_t* key_starts) {
  int64_t total = 0;
  key_starts[0] = 0;
  for (int64_t k = 0; k < num_keys; ++k) {
    const int64_t* bag = lengths + k * batch_size;
    for (int64_t b = 0; b < batch_size; ++b) {
      const int64_t len = bag[b];
      if (len < 0 || len > num_values) return kInvalid;
      total += len;  // <= num_values per term and checked below: no wrap
      if (total > num_values) return kInvalid;
    }
    key_starts[k + 1] = total;
  }
  return total == num_values ? kOk : kInvalid;
}

// Builds one stacked table's CSR arrays from a validated KJT layout.
//
// values/weights: the KJT's ids (int64) and float32 weights (nullptr: gain 1).
// lengths, key_starts: as for TpurecKjtKeyStarts.
// slot_*: per feature slot of the stack, in slot order: the KJT key index,
//   the table's row offset, its number of rows and whether it is MEAN-pooled.
// Outputs (preallocated by the caller): row_pointers [P], ids/samples/gains
//   [P * partition_size], counts/unique_counts [P] (before any drop), dropped.
// Returns kOk, kInvalid (an id outside its table) or kOverflow.
int TpurecPreprocessStack(const int64_t* values, const float* weights, const int64_t* lengths,
                          const int64_t* key_starts, int64_t batch_size, int64_t num_slots,
                          const int64_t* slot_key, const int64_t* slot_row_offset,
                          const int64_t* slot_num_embeddings, const int32_t* slot_mean,
                          int64_t num_partitions, int64_t max_ids, int64_t max_unique,
                          int64_t partition_size, int32_t drop, int32_t* row_pointers, int32_t* out_ids,
                          int32_t* out_samples, float* out_gains, int32_t* counts, int32_t* unique_counts,
                          int64_t* dropped) {
  const uint32_t P = static_cast<uint32_t>(num_partitions);
  const FastDivider divider(P);
  // Without weights or MEAN pooling every gain is 1 and a merged gain is the
  // run length (sums of ones are exact), so entries need no gain or position.
  bool unit_gains = weights == nullptr;
  for (int64_t s = 0; s < num_slots; ++s) unit_gains &= slot_mean[s] == 0;

  // 1. Validate ids and count entries per partition.
  int64_t n = 0;
  uint64_t num_rows = 0;
  for (int64_t s = 0; s < num_slots; ++s) {
    n += key_starts[slot_key[s] + 1] - key_starts[slot_key[s]];
    num_rows = std::max<uint64_t>(num_rows, slot_row_offset[s] + slot_num_embeddings[s]);
  }
  std::vector<int64_t> part_begin(P + 1, 0);
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t* ids = values + key_starts[slot_key[s]];
    const int64_t m = key_starts[slot_key[s] + 1] - key_starts[slot_key[s]];
    const uint64_t rows = static_cast<uint64_t>(slot_num_embeddings[s]);
    const uint32_t offset = static_cast<uint32_t>(slot_row_offset[s]);
    bool bad = false;
    for (int64_t i = 0; i < m; ++i) bad |= static_cast<uint64_t>(ids[i]) >= rows;
    if (bad) return kInvalid;
    if (P > 1) {
      for (int64_t i = 0; i < m; ++i) ++part_begin[divider.Mod(static_cast<uint32_t>(ids[i]) + offset) + 1];
    } else {
      part_begin[1] += m;
    }
  }
  for (uint32_t p = 0; p < P; ++p) part_begin[p + 1] += part_begin[p];

  // 2. Scatter the entries to their partitions, keeping KJT order (samples
  // ascending). A word packs (id / P) << 32 (the ids of one partition differ
  // only there) with the sample, or with the entry's position when gains vary.
  std::unique_ptr<uint64_t[]> words(new uint64_t[n]);
  std::unique_ptr<int32_t[]> samples(unit_gains ? nullptr : new int32_t[n]);
  std::unique_ptr<double[]> gains(unit_gains ? nullptr : new double[n]);
  std::vector<int64_t> fill(part_begin.begin(), part_begin.end() - 1);
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t key = slot_key[s];
    const int64_t* ids = values + key_starts[key];
    const float* w = weights ? weights + key_starts[key] : nullptr;
    const int64_t* bag = lengths + key * batch_size;
    const uint32_t offset = static_cast<uint32_t>(slot_row_offset[s]);
    const bool mean = slot_mean[s] != 0;
    int64_t i = 0;
    for (int64_t b = 0; b < batch_size; ++b) {
      const uint32_t sample = static_cast<uint32_t>(s * batch_size + b);
      const int64_t len = bag[b];
      for (int64_t j = 0; j < len; ++j, ++i) {
        const uint32_t id = static_cast<uint32_t>(ids[i]) + offset;
        const uint32_t q = P > 1 ? divider.Div(id) : id;
        const uint32_t p = id - q * P;
        const int64_t at = fill[p]++;
        if (unit_gains) {
          words[at] = (static_cast<uint64_t>(q) << 32) | sample;
        } else {
          words[at] = (static_cast<uint64_t>(q) << 32) | static_cast<uint64_t>(at - part_begin[p]);
          samples[at] = static_cast<int32_t>(sample);
          double g = w ? static_cast<double>(w[i]) : 1.0;
          if (mean) g = g / static_cast<double>(len);  // MEAN divides by the bag length, also weighted
          gains[at] = g;
        }
      }
    }
  }

  // 3. Per partition (independent, so on separate threads): sort by id, merge
  // duplicate (id, sample) runs, and write the kept entries straight into the
  // output buffers. With "drop" a partition keeps its first max_unique distinct
  // ids, then the first max_ids of those entries; with "error" nothing past the
  // capacity is written and the counts decide.
  const int key_bits = BitsFor(num_rows / P);
  std::vector<int64_t> merged_count(P, 0), merged_unique(P, 0), kept_count(P, 0);
  const int threads = n >= (1 << 16) && P > 1 ? tpurec_native::ConfiguredThreads() : 1;
  ParallelFor(P, threads, [&](int64_t p) {
    const int64_t begin = part_begin[p], m = part_begin[p + 1] - begin;
    uint64_t* part = words.get() + begin;
    std::unique_ptr<uint64_t[]> scratch(new uint64_t[m > 0 ? m : 1]);
    RadixSortByKey(part, scratch.get(), m, key_bits);
    int32_t* ids_out = out_ids + p * partition_size;
    int32_t* samples_out = out_samples + p * partition_size;
    float* gains_out = out_gains + p * partition_size;
    std::vector<double> run;
    int64_t merged = 0, distinct = 0, kept = 0;
    uint64_t prev_q = ~uint64_t{0};
    int64_t i = 0;
    while (i < m) {
      const uint64_t w0 = part[i];
      const uint64_t q = w0 >> 32;
      int32_t sample;
      double g;
      int64_t j = i + 1;
      if (unit_gains) {
        while (j < m && part[j] == w0) ++j;
        sample = static_cast<int32_t>(w0 & 0xffffffffu);
        g = static_cast<double>(j - i);
      } else {
        const int32_t* samples_p = samples.get() + begin;
        const double* gains_p = gains.get() + begin;
        sample = samples_p[w0 & 0xffffffffu];
        while (j < m && (part[j] >> 32) == q && samples_p[part[j] & 0xffffffffu] == sample) ++j;
        if (j - i == 1) {
          g = gains_p[w0 & 0xffffffffu];
        } else {
          run.clear();
          for (int64_t k = i; k < j; ++k) run.push_back(gains_p[part[k] & 0xffffffffu]);
          g = ReduceatSum(run.data(), static_cast<int64_t>(run.size()));
        }
      }
      auto emit = [&](float gain) {
        if (q != prev_q) ++distinct;
        prev_q = q;
        ++merged;
        if (distinct <= max_unique && kept < max_ids) {
          ids_out[kept] = static_cast<int32_t>(q * P + p);
          samples_out[kept] = sample;
          gains_out[kept] = gain;
          ++kept;
        }
      };
      if (j - i > 1 && std::isfinite(g) && std::fabs(g) > static_cast<double>(std::numeric_limits<float>::max())) {
        // The summed gain does not fit a float32: keep the run's entries
        // unmerged so the kernel adds finite gain * row products (the
        // reference's rule, as torchrec stays finite).
        const double* gains_p = gains.get() + begin;
        for (int64_t k = i; k < j; ++k) emit(static_cast<float>(gains_p[part[k] & 0xffffffffu]));
      } else {
        emit(static_cast<float>(g));
      }
      i = j;
    }
    for (int64_t k = kept; k < partition_size; ++k) {
      ids_out[k] = kPadId;
      samples_out[k] = kPadId;
      gains_out[k] = 0.0f;
    }
    merged_count[p] = merged;
    merged_unique[p] = distinct;
    kept_count[p] = kept;
  });

  bool over = false;
  int64_t total_dropped = 0;
  for (uint32_t p = 0; p < P; ++p) {
    counts[p] = static_cast<int32_t>(merged_count[p]);
    unique_counts[p] = static_cast<int32_t>(merged_unique[p]);
    row_pointers[p] = static_cast<int32_t>(p * partition_size + kept_count[p]);
    over |= merged_count[p] > max_ids || merged_unique[p] > max_unique;
    total_dropped += merged_count[p] - kept_count[p];
  }
  if (over && !drop) return kOverflow;
  *dropped = total_dropped;
  return kOk;
}

}  // extern "C"
