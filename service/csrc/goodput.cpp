#include "goodput.hpp"

#include <algorithm>
#include <cmath>
#include <queue>
#include <utility>

namespace samrollout {

int32_t match_bucket(int64_t match_length) {
  if (match_length <= 0) return 0;
  if (match_length == 1) return 1;
  int32_t octave = 0;
  while ((match_length >> (octave + 1)) != 0) ++octave;  // the leading bit's position
  const auto half = static_cast<int32_t>((match_length >> (octave - 1)) & 1);  // the bit below it
  return std::min(2 * octave + half, kMatchBuckets - 1);
}

double prior_acceptance(int32_t bucket) {
  return bucket == 0 ? 0.0 : 1.0 - 0.65 * std::exp(-static_cast<double>(bucket) / 5.0);
}

AcceptanceModel::AcceptanceModel(int32_t depth)
    : depth_(depth),
      seen_(static_cast<std::size_t>(2 * kKinds * kMatchBuckets * kEvidenceClasses * depth), 0.0),
      accepted_(seen_.size(), 0.0),
      pool_seen_(static_cast<std::size_t>(2 * kMatchBuckets * kEvidenceClasses), 0.0),
      pool_accepted_(pool_seen_.size(), 0.0) {}

std::size_t AcceptanceModel::detail(int32_t sampling, int32_t kind, int32_t bucket, int32_t evidence,
                                    int32_t d) const {
  return static_cast<std::size_t>(
      (((sampling * kKinds + kind) * kMatchBuckets + bucket) * kEvidenceClasses + evidence) * depth_ + d);
}

std::size_t AcceptanceModel::pooled(int32_t sampling, int32_t bucket, int32_t evidence) const {
  return static_cast<std::size_t>((sampling * kMatchBuckets + bucket) * kEvidenceClasses + evidence);
}

void AcceptanceModel::age(std::size_t rows) {
  scale_ *= std::pow(kDecay, static_cast<double>(rows) / 64.0);
  if (scale_ < 1e-150) rescale();
}

void AcceptanceModel::rescale() {
  for (std::vector<double>* counts : {&seen_, &accepted_, &pool_seen_, &pool_accepted_}) {
    for (double& count : *counts) count *= scale_;
  }
  scale_ = 1.0;
}

void AcceptanceModel::observe(bool greedy, int32_t kind, int32_t match, const uint8_t* evidence, int32_t agreed,
                              int32_t observed) {
  const int32_t sampling = greedy ? 0 : 1;
  const int32_t bucket = match_bucket(match);
  const double one = 1.0 / scale_;
  for (int32_t d = 0; d < std::min(observed, depth_); ++d) {
    const int32_t sure = evidence[d];
    const double hit = d < agreed ? one : 0.0;
    const std::size_t cell = detail(sampling, kind, bucket, sure, d);
    seen_[cell] += one;
    accepted_[cell] += hit;
    const std::size_t pool = pooled(sampling, match_bucket(static_cast<int64_t>(match) + d), sure);
    pool_seen_[pool] += one;
    pool_accepted_[pool] += hit;
  }
}

double AcceptanceModel::reach(bool greedy, int32_t kind, int32_t match, const uint8_t* evidence, int32_t limit,
                              double* out) const {
  const int32_t sampling = greedy ? 0 : 1;
  const int32_t bucket = match_bucket(match);
  double chance = 1.0;
  double total = 0.0;
  for (int32_t d = 0; d < std::min(limit, depth_); ++d) {
    const int32_t sure = evidence[d];
    const int32_t continued = match_bucket(static_cast<int64_t>(match) + d);
    const std::size_t pool = pooled(sampling, continued, sure);
    const double pool_rate = (pool_accepted_[pool] * scale_ + kPriorWeight * prior_acceptance(continued)) /
                             (pool_seen_[pool] * scale_ + kPriorWeight);
    const std::size_t cell = detail(sampling, kind, bucket, sure, d);
    const double rate = (accepted_[cell] * scale_ + kDetailWeight * pool_rate) / (seen_[cell] * scale_ + kDetailWeight);
    chance *= rate;
    out[d] = chance;
    total += chance;
  }
  return total;
}

void AcceptanceModel::first_tokens(double* seen, double* accepted) const {
  for (int32_t source = 0; source < kSources; ++source) {
    for (int32_t bucket = 0; bucket < kMatchBuckets; ++bucket) {
      double n = 0.0;
      double a = 0.0;
      for (int32_t sampling = 0; sampling < 2; ++sampling) {
        for (int32_t sure = 0; sure < kEvidenceClasses; ++sure) {
          n += seen_[detail(sampling, source, bucket, sure, 0)];
          a += accepted_[detail(sampling, source, bucket, sure, 0)];
        }
      }
      seen[source * kMatchBuckets + bucket] = n * scale_;
      accepted[source * kMatchBuckets + bucket] = a * scale_;
    }
  }
}

void allocate(const double* values, std::size_t rows, int32_t depth, const double* weights, const double* seconds,
              std::size_t points, int32_t* lengths) {
  std::fill(lengths, lengths + rows, 0);
  if (rows == 0 || depth <= 0 || points == 0) return;
  double produced = 0.0;
  for (std::size_t r = 0; r < rows; ++r) produced += weights[r];
  // The rows' next increments, largest first: each row's values fall with depth, so a merge of the rows
  // gives the increments in order.
  using Next = std::pair<double, std::size_t>;  // (value, row)
  std::priority_queue<Next> heap;
  std::vector<int32_t> taken(rows, 0);
  for (std::size_t r = 0; r < rows; ++r) {
    if (values[r * static_cast<std::size_t>(depth)] > 0.0) heap.emplace(values[r * static_cast<std::size_t>(depth)], r);
  }
  std::vector<std::size_t> order;  // the row of each increment, in the order taken
  double best_rate = produced / seconds[0];
  std::size_t best = 0;
  for (std::size_t n = 1; n < points && !heap.empty(); ++n) {
    const auto [value, r] = heap.top();
    heap.pop();
    order.push_back(r);
    produced += value;
    const int32_t next = ++taken[r];
    if (next < depth) {
      const double following = values[r * static_cast<std::size_t>(depth) + static_cast<std::size_t>(next)];
      if (following > 0.0) heap.emplace(following, r);
    }
    const double rate = produced / seconds[n];
    if (rate > best_rate) {
      best_rate = rate;
      best = n;
    }
  }
  for (std::size_t i = 0; i < best; ++i) ++lengths[order[i]];
}

}  // namespace samrollout
