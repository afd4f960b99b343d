// The docs/contract.md §5 subsampler: k_r pairs of row r, uniform without replacement, by Floyd's algorithm.
//
// Floyd's algorithm draws a uniform k-subset of {0, ..., n-1} with exactly k random draws; the flat
// index of a pair counts pairs in (i, j) order, so scanning the chosen indices in order yields the
// pairs sorted. Each row has its own generator seeded from (seed, row): the draw is reproducible and
// independent of how rows are scheduled: rows are drawn in parallel (at::parallel_for), each into
// its own slice of the output, so the result does not depend on the thread count.
//
// Memory: the chosen set is a byte per pair (n bytes, a linear scan) while k is at least n / 64,
// else a hash set of the k indices, sorted (8k bytes and k log k): a few pairs of a long row
// (T = 32k holds 5e8 pairs) take kilobytes for the set, not half a gigabyte. Both record the same
// draws. Beside the set, a row's walk keeps 24 bytes per prefix position (its first pair's flat
// index, i and j: 0.8 MB at T = 32k), so a thread's memory grows with its row's length, not with k:
// belief_state_loss's rows are bounded by f's L; a raw call with lengths near 2^31 asks for ~48 GB.
#include "bst_fast.h"

#include <ATen/Parallel.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <limits>
#include <random>
#include <unordered_set>
#include <utility>

namespace bst_fast {
namespace {

constexpr int64_t kMaxLength = int64_t{1} << 31;

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> sample_pairs(const at::Tensor& lengths_in,
                                                            const at::Tensor& prefix_start_in,
                                                            int64_t min_gap, int64_t max_gap,
                                                            const at::Tensor& k_in, int64_t seed) {
  TORCH_CHECK(lengths_in.dim() == 1 && lengths_in.scalar_type() == at::kLong && lengths_in.device().is_cpu(),
              "lengths must be an int64 CPU vector, got ", lengths_in.sizes(), " ", lengths_in.scalar_type(),
              " on ", lengths_in.device());
  const int64_t B = lengths_in.size(0);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"prefix_start", &prefix_start_in},
                                 {"k", &k_in}}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == B && t->scalar_type() == at::kLong && t->device().is_cpu(),
                name, " must be int64 CPU (", B, ",), got ", t->sizes(), " ", t->scalar_type(), " on ",
                t->device());
  }
  // min_gap = 1 lists the pairs with j - i = 1 too (docs/contract.md §8: their labels are the loss's business)
  TORCH_CHECK(min_gap >= 1, "min_gap must be >= 1, got ", min_gap);
  TORCH_CHECK(max_gap >= min_gap, "max_gap must be >= min_gap (", min_gap, "), got ", max_gap);
  const auto lengths = lengths_in.contiguous(), prefix_start = prefix_start_in.contiguous(), k = k_in.contiguous();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* start = prefix_start.data_ptr<int64_t>();
  const int64_t* kk = k.data_ptr<int64_t>();

  // Pass 1, serial: check every row and size its output (|P_r| counts the row's prefixes, O(len)),
  // so that a bad row is reported the same way whatever the thread count, and each row's slice of
  // the output is known before any row is drawn.
  std::vector<int64_t> offset(B + 1, 0);
  for (const auto r : c10::irange(B)) {
    // A row of 2^31 tokens has 2^61 pairs: the counts below stay far from overflow.
    TORCH_CHECK_VALUE(len[r] >= 0 && len[r] <= kMaxLength, "lengths[", r, "] must lie in [0, 2^31], got ", len[r]);
    TORCH_CHECK_VALUE(start[r] >= 0, "prefix_start[", r, "] must be >= 0, got ", start[r]);
    int64_t n = 0;
    for_each_prefix(len[r], start[r], min_gap, max_gap, [&](int64_t, int64_t, int64_t count) { n += count; });
    TORCH_CHECK_VALUE(kk[r] >= 0 && kk[r] <= n, "k[", r, "] must lie in [0, |P_r| = ", n, "], got ", kk[r]);
    // each k[r] <= |P_r| <= 2^61, but their sum can pass 2^63: a wrapped offset would place a row's
    // slice outside the output
    TORCH_CHECK_VALUE(kk[r] <= std::numeric_limits<int64_t>::max() - offset[r], "the sum of k must fit in int64: ",
                      "k[0..", r, "] passes 2^63 - 1");
    offset[r + 1] = offset[r] + kk[r];
  }
  auto out_r = at::empty({offset[B]}, at::kLong), out_i = at::empty({offset[B]}, at::kLong),
       out_j = at::empty({offset[B]}, at::kLong);
  int64_t* o_r = out_r.data_ptr<int64_t>();
  int64_t* o_i = out_i.data_ptr<int64_t>();
  int64_t* o_j = out_j.data_ptr<int64_t>();
  // Pass 2, rows in parallel: a row's draw depends on (seed, r) alone and lands in its own slice,
  // so the result is the same for any thread count and schedule. (At the paper's batch of 256 rows
  // of 258 the serial loop took about 14 ms of host time after the encoders' sync.)
  at::parallel_for(0, B, 1, [&](int64_t r_begin, int64_t r_end) {
    std::vector<int64_t> first, first_i, first_j;  // per prefix of the row: flat index, i, first j
    std::vector<char> chosen;
    std::unordered_set<int64_t> picked;
    std::vector<int64_t> sorted;
    for (int64_t r = r_begin; r < r_end; ++r) {
      // a row asked for no pair lists nothing, however long it is
      if (kk[r] == 0) continue;
      first.clear(), first_i.clear(), first_j.clear();
      int64_t n = 0;
      for_each_prefix(len[r], start[r], min_gap, max_gap, [&](int64_t i, int64_t j0, int64_t count) {
        first.push_back(n), first_i.push_back(i), first_j.push_back(j0);
        n += count;
      });
      std::mt19937_64 gen(splitmix64(static_cast<uint64_t>(seed) ^ splitmix64(static_cast<uint64_t>(r))));
      sorted.clear();
      if (kk[r] >= n / 64) {
        chosen.assign(n, 0);
        for (int64_t t = n - kk[r]; t < n; ++t) {
          const int64_t v = std::uniform_int_distribution<int64_t>(0, t)(gen);
          chosen[chosen[v] ? t : v] = 1;
        }
        for (int64_t p = 0; p < n; ++p) {
          if (chosen[p]) sorted.push_back(p);
        }
      } else {
        picked.clear();
        picked.reserve(kk[r]);
        for (int64_t t = n - kk[r]; t < n; ++t) {
          const int64_t v = std::uniform_int_distribution<int64_t>(0, t)(gen);
          picked.insert(picked.count(v) ? t : v);
        }
        sorted.assign(picked.begin(), picked.end());
        std::sort(sorted.begin(), sorted.end());
      }
      int64_t s = 0;  // index into `first`: the prefix of the current flat index
      int64_t at = offset[r];
      for (const int64_t p : sorted) {
        while (s + 1 < static_cast<int64_t>(first.size()) && first[s + 1] <= p) ++s;
        o_r[at] = r, o_i[at] = first_i[s], o_j[at] = first_j[s] + (p - first[s]);
        ++at;
      }
    }
  });
  return {out_r, out_i, out_j};
}

}  // namespace bst_fast
