// The adaptive drafting policy's hot part: what a draft is worth, learned online, and each row's draft
// length chosen for the batch's expected tokens per second.
//
// What a draft is worth.  Every step every decoding row gets a draft candidate from each source (its own
// automaton, its group's, the global index).  The next step shows the tokens the row really got (the
// accepted drafts and the bonus token), so every candidate is scored against them, drafted or not: its
// first `agreed` tokens matched, and the one after was seen to differ (`observed` = agreed + 1) unless the
// step revealed no more.  Scoring a candidate against the tokens produced is exact for acceptance: a draft
// token x is accepted with probability p(x) under the target distribution, and the token produced at that
// position is x with that same probability whether x was drafted or not (after a rejection vLLM resamples
// from the residual, which never gives x).
//
// The statistics are conditional acceptance rates c(d) = P(token d accepted | tokens 1..d-1 accepted),
// counted per cell of (sampling: greedy or not, candidate kind: each source's copy, the counted path or the
// second path, match-length bucket, token d's evidence class: its count share and support, or where no
// counts are kept whether d lies in the candidate's certain prefix, depth).  A depth is observed only when the tokens before it were accepted and
// the step revealed it, a censoring that does not depend on the outcome there, so accepted / observed is
// unbiased.  Deep cells see few observations, so each is shrunk toward a pooled cell (sampling, bucket of
// the match the token continues: a draft's d-th token continues a match of m + d - 1 tokens once the
// first d - 1 are accepted, evidence class), which is shrunk toward a prior that rises with the match.
// Counts decay with every step (lazily, by a growing scale), so the statistics follow text that changes
// as the policy trains.
//
// The choice.  Row r's candidate is the source with the largest expected accepted length (the sum of its
// reach, reach[d] = c(1) ... c(d)).  With seconds[n] the step's time when n draft tokens are verified in
// all, the lengths k_r maximise  sum_r w_r (1 + reach_r[1] + ... + reach_r[k_r]) / seconds[sum k_r]; since
// reach falls with depth, the best n tokens are the n largest values w_r reach_r[d], taken in order by a
// merge of the rows (a heap), and every n is tried.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace samrollout {

constexpr int32_t kMatchBuckets = 24;  // 0 (no match), then half octaves 1, 2, 3, 4-5, 6-7, 8-11, ...

// A draft token's evidence class, a cell dimension of the acceptance model: 0 nothing known, 1 in the certain
// prefix (every earlier occurrence continued so; used where the automaton keeps no counts), then from counts
// (Automaton::evidence): 2 + 3 * share bin + support bin, the share of the context's continuations that took
// the token (all, at least half, less) and their number (1, 2-3, 4+).
constexpr int32_t kCountEvidenceClasses = 11;
// A draft token's agreement, the other part of its evidence class: how many of the row's other candidates
// propose the same tokens up to and including it (0: the row has no other candidate, 1: none, 2: one, 3: two
// or more).  Candidates that agree where others diverge are likelier to be right.
constexpr int32_t kAgreementClasses = 4;
constexpr int32_t kEvidenceClasses = kCountEvidenceClasses * kAgreementClasses;

// The evidence class of a token whose count evidence is `counted` (evidence_class) and whose agreement is
// `agreement` (kAgreementClasses).
inline uint8_t with_agreement(uint8_t counted, int32_t agreement) {
  return static_cast<uint8_t>(counted + kCountEvidenceClasses * agreement);
}
constexpr uint8_t kUnknownEvidence = 0;
constexpr uint8_t kCertainEvidence = 1;

// The evidence class of a token `count` of `total` continuations took (total 0: unknown).
inline uint8_t evidence_class(int64_t count, int64_t total) {
  if (total <= 0 || count <= 0) return kUnknownEvidence;
  const int share = count >= total ? 0 : (2 * count >= total ? 1 : 2);
  const int support = total <= 1 ? 0 : (total <= 3 ? 1 : 2);
  return static_cast<uint8_t>(2 + 3 * share + support);
}

// The half-octave bucket of a match length (0 for none); every match of about 2,900 tokens or more is in the last.
int32_t match_bucket(int64_t match_length);

// The prior conditional acceptance of a token continuing a match in `bucket` (0 for bucket 0).
double prior_acceptance(int32_t bucket);

// The kinds of candidate the adaptive policy scores apart: the recent-occurrence copies of the three sources
// (DraftSource's values), then the counted main path and the counted second path (Automaton::counted_paths).
constexpr int32_t kCandidateKinds = 5;
constexpr int32_t kCountedKind = 3;
constexpr int32_t kSecondKind = 4;

class AcceptanceModel {
 public:
  static constexpr int32_t kSources = 3;  // the sources acceptance_table reports (the copies' kinds)
  static constexpr int32_t kKinds = kCandidateKinds;
  static constexpr double kDecay = 0.999;         // per step of 64 rows: about a thousand steps of memory
  static constexpr double kDetailWeight = 8.0;    // observations a detailed cell needs to count as its pool
  static constexpr double kPriorWeight = 2.0;     // pseudo-observations of the prior in a pooled cell

  explicit AcceptanceModel(int32_t depth);
  int32_t depth() const { return depth_; }

  // Counts age by one step of `rows` scored rows.
  void age(std::size_t rows);
  // One scored candidate of `kind` (see the file comment); evidence[d]: its token d's evidence class.
  void observe(bool greedy, int32_t kind, int32_t match, const uint8_t* evidence, int32_t agreed, int32_t observed);
  // reach[d] = P(the first d + 1 tokens accepted) for d < limit (limit <= depth); returns their sum.
  double reach(bool greedy, int32_t kind, int32_t match, const uint8_t* evidence, int32_t limit, double* out) const;
  // First-token observations and acceptances per (source, bucket), summed over sampling and certainty.
  void first_tokens(double* seen, double* accepted) const;

 private:
  std::size_t detail(int32_t sampling, int32_t kind, int32_t bucket, int32_t evidence, int32_t d) const;
  std::size_t pooled(int32_t sampling, int32_t bucket, int32_t evidence) const;
  void rescale();

  int32_t depth_;
  double scale_ = 1.0;  // stored counts times scale_ are the decayed counts
  std::vector<double> seen_, accepted_, pool_seen_, pool_accepted_;
};

// Each row's draft length maximising weighted expected tokens per second (see the file comment).
// values: rows x depth, row-major, w_r * reach_r[d], non-increasing within a row, 0 past its usable depth;
// weights: per row; seconds[n]: the step's seconds with n draft tokens verified, n = 0 .. points - 1.
void allocate(const double* values, std::size_t rows, int32_t depth, const double* weights, const double* seconds,
              std::size_t points, int32_t* lengths);

}  // namespace samrollout
