// The drafter: per-request and per-group suffix automata, their lifecycle and
// memory bounds, and the draft policy.  One object serves a whole engine; every
// public call takes the object's lock, so Python threads may share it with the
// GIL released.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "automaton.hpp"
#include "goodput.hpp"

namespace samrollout {

// Which automata a request drafts from.
enum class Source : int32_t { kOwn = 0, kGroup = 1, kBoth = 2 };

// Where one draft came from: the request's own automaton, its group's, or the global index.
enum class DraftSource : int32_t { kOwn = 0, kGroup = 1, kGlobal = 2 };

// What the adaptive policy's candidates are: each source's copy of the recent occurrence, or also the counted
// paths (Automaton::counted_paths: the majority continuation and a second path where the counts split) with
// every token's count share and support as the acceptance model's evidence.  Only step_goodput proposes
// counted paths; kCounted makes the automata keep occurrence counts.
enum class Proposals : int32_t { kCopies = 0, kCounted = 1 };

// Where step() writes the source of a row that drafted nothing.
constexpr int32_t kNoDraftSource = -1;

// How drafts are chosen: the one definition of a draft policy's knobs, their defaults and their
// checks.  Python's DraftPolicy (samrollout/drafter.py) sets these fields by name through the
// binding and calls validate(), so a knob is a field here, its check in validate(), one def_rw
// line in binding.cpp and one field of the Python dataclass.  What each knob does and why its
// default: DraftPolicy's docstring and docs/tuning.md.
struct DraftPolicy {
  static constexpr int64_t kMaxTokens = int64_t{1} << 30;  // positions are 32-bit

  int32_t vocab_size = 1 << 20;     // token ids must lie in [0, vocab_size)
  int32_t min_match_length = 1;     // shorter matches propose nothing
  double match_scale = 0.0;         // >0: draft at most max(1, scale * match) tokens
  Occurrence occurrence = Occurrence::kRecent;
  double min_probability = 0.0;     // kFrequent: a draft stops where its estimated acceptance falls below
  Source source = Source::kBoth;    // for requests that belong to a group
  int32_t group_margin = 4;         // kBoth: the group's match must be longer by more than this
  int64_t max_request_tokens = int64_t{1} << 22;  // own automaton bound
  int64_t max_group_tokens = int64_t{1} << 24;    // group automaton bound
  int64_t max_global_tokens = 0;  // global index of finished responses (all prompts); 0: off
  int32_t global_margin = 4;      // its match must be longer than the chosen one's by more than this
  Proposals proposals = Proposals::kCopies;  // the adaptive policy's candidates

  // Throws std::invalid_argument naming the first field out of its range.
  void validate() const {
    check_int("vocab_size", vocab_size, 1, std::numeric_limits<int32_t>::max());
    check_int("min_match_length", min_match_length, 1, kMaxTokens);
    if (!std::isfinite(match_scale) || !(match_scale >= 0.0)) {
      fail_number("match_scale", "must be a finite number >= 0", match_scale);
    }
    if (occurrence != Occurrence::kFirst && occurrence != Occurrence::kRecent &&
        occurrence != Occurrence::kFrequent) {
      throw std::invalid_argument("occurrence must be first, recent or frequent");
    }
    if (!(min_probability >= 0.0 && min_probability <= 1.0)) {
      fail_number("min_probability", "must be a number in [0, 1]", min_probability);
    }
    if (source != Source::kOwn && source != Source::kGroup && source != Source::kBoth) {
      throw std::invalid_argument("source must be own, group or both");
    }
    check_int("group_margin", group_margin, 0, kMaxTokens);
    check_int("max_request_tokens", max_request_tokens, 1, kMaxTokens);
    check_int("max_group_tokens", max_group_tokens, 1, kMaxTokens);
    check_int("max_global_tokens", max_global_tokens, 0, kMaxTokens);
    check_int("global_margin", global_margin, 0, kMaxTokens);
    if (proposals != Proposals::kCopies && proposals != Proposals::kCounted) {
      throw std::invalid_argument("proposals must be copies or counted");
    }
  }

 private:
  static void check_int(const char* name, int64_t value, int64_t low, int64_t high) {
    if (value < low || value > high) {
      throw std::invalid_argument(std::string(name) + " must be an integer between " + std::to_string(low) +
                                  " and " + std::to_string(high) + ", got " + std::to_string(value));
    }
  }
  [[noreturn]] static void fail_number(const char* name, const char* rule, double value) {
    std::ostringstream text;
    text << name << ' ' << rule << ", got " << value;
    throw std::invalid_argument(text.str());
  }
};

// One request's draft: its tokens, the length of the match behind them (its evidence) and the
// automaton they came from; match_length 0 and no source where it drafted nothing.
struct Draft {
  std::vector<int32_t> tokens;
  int32_t match_length = 0;
  std::optional<DraftSource> source;
  int32_t certain = 0;  // leading tokens that every earlier occurrence continued with (Automaton::certain_prefix)
};

// One request's counted proposals (Drafter::counted, for inspection): the main and the second path, the
// context length behind them and each token's evidence (counts of the token and of all continuations).
struct CountedDraft {
  std::vector<int32_t> main, second;
  int32_t match_length = 0;
  std::vector<int32_t> main_counts, main_totals, second_counts, second_totals;
};

// Finished responses of every prompt, for drafting where a request's own text and its
// group's have no match (the start of a response, phrases common across prompts).  Bounded
// by two generations of half the budget each: when the newer is full, the older is dropped
// and the newer becomes the older, so the newest responses are always held and memory
// never passes the budget.  A running request is looked up by its last `kWindow` tokens.
class GlobalIndex {
 public:
  static constexpr int32_t kWindow = 32;

  GlobalIndex(int64_t max_tokens, Occurrence occurrence, double min_probability);
  // Indexes one finished response; returns false (nothing indexed) when it is empty or
  // longer than a generation (half the budget).
  bool add(const int32_t* tokens, std::size_t count);
  // Up to `limit` tokens that followed the longest match of `window`'s suffix; sets the match length.
  int32_t propose(const int32_t* window, std::size_t count, int32_t limit, int32_t* out,
                  int32_t* match_length) const;
  int64_t tokens() const { return newer_tokens_ + older_tokens_; }
  std::size_t memory_bytes() const;

 private:
  int64_t generation_tokens_;
  Occurrence occurrence_;
  double min_probability_;
  std::unique_ptr<Automaton> newer_;
  std::unique_ptr<Automaton> older_;
  int64_t newer_tokens_ = 0;
  int64_t older_tokens_ = 0;
};

// What the drafter knows about one request, for stats and tests.
struct RequestInfo {
  int64_t num_tokens = 0;   // prompt + output indexed for this request
  int32_t match_length = 0; // length of the match the next draft comes from
  bool own_overflow = false;
  bool group_overflow = false;
  int64_t group = -1;
};

class Drafter {
 public:
  static constexpr int32_t kMaxDraftTokens = 64;
  static constexpr int32_t kSources = 3;  // own, group, global: DraftSource's values

  explicit Drafter(const DraftPolicy& policy);

  // Returns whether the request joined `group` (false: it drafts alone, see add_request in drafter.cpp).
  bool add_request(int64_t request, const int32_t* prompt, std::size_t count, int64_t group);
  void append(int64_t request, const int32_t* tokens, std::size_t count);
  // Up to k draft tokens for the request's next positions, with their match and source.
  Draft propose(int64_t request, int32_t k);
  // The request's counted paths of up to k tokens (Automaton::counted_paths, as step_goodput makes them; empty
  // unless the policy's proposals are counted).
  CountedDraft counted(int64_t request, int32_t k) const;
  // One engine step for a batch: rows[i] gets tokens[offsets[i]:offsets[i+1]] appended, then
  // up to k drafts written to drafts[i*k ...] (padded with -1), lengths[i] set, and the match
  // behind the draft and its source in match_lengths[i] (0 where it drafted nothing) and
  // sources[i] (a DraftSource value; kNoDraftSource where it drafted nothing), and in certain[i] how many
  // leading draft tokens every earlier occurrence agreed on (0 from the global index).
  // Everything is validated before any state changes.
  void step(const int64_t* requests, std::size_t rows, const int32_t* tokens, const int64_t* offsets,
            int32_t k, int32_t* drafts, int32_t* lengths, int32_t* match_lengths, int32_t* sources,
            int32_t* certain);
  // One engine step for a batch, every source's draft kept: rows[i] gets its tokens appended as in step(),
  // then for each source s (a DraftSource value, kSources of them) the draft from s alone is written to
  // drafts[(i * kSources + s) * k ...] (padded with -1), with its length, match and certain prefix at
  // [i * kSources + s] (length 0 where s has nothing).  The drafting policy picks one per row.
  void step_candidates(const int64_t* requests, std::size_t rows, const int32_t* tokens, const int64_t* offsets,
                       int32_t k, int32_t* drafts, int32_t* lengths, int32_t* match_lengths, int32_t* certain);
  // One engine step of the adaptive policy (goodput.hpp): rows[i] gets its tokens appended; every source's
  // candidate of its previous step is scored against them (when that step allowed it a draft); then each row
  // gets the source whose candidate is expected to be accepted longest, cut to the length that maximises the
  // batch's weighted expected tokens per second.  greedy[i]: whether the row samples greedily (its acceptance
  // is counted apart); limits[i]: the most draft tokens it may get (0: none, and it is not scored next step);
  // weights[i]: its weight; seconds[n]: the step's seconds with n draft tokens in all, n = 0 .. points - 1.
  // Writes drafts[i * k ...] (padded with -1), lengths[i], and the chosen candidate's match_lengths[i],
  // sources[i] (kNoDraftSource where it drafts nothing) and certain[i].
  void step_goodput(const int64_t* requests, std::size_t rows, const int32_t* tokens, const int64_t* offsets,
                    int32_t k, const uint8_t* greedy, const int32_t* limits, const double* weights,
                    const double* seconds, std::size_t points, int32_t* drafts, int32_t* lengths,
                    int32_t* match_lengths, int32_t* sources, int32_t* certain);
  // The adaptive policy's first-token observations and acceptances per (source, match bucket), kSources x
  // kMatchBuckets each (zeros before its first step).
  void acceptance_table(double* seen, double* accepted) const;
  void remove_request(int64_t request);
  // Indexes a finished response to the group's prompt (an earlier rollout's) as one more
  // string of the live group `group`; siblings draft from it from their next token on.
  // Returns false, changing nothing, when it would take the group past max_group_tokens
  // or the group's automaton is gone (overflowed).
  bool add_to_group(int64_t group, const int32_t* tokens, std::size_t count);
  // Indexes a finished response (an earlier rollout's, any prompt) into the global index, as if
  // a request that wrote it had finished here.  Returns false (nothing indexed) when the index is
  // off, or the response is empty or longer than a generation.
  bool add_to_global(const int32_t* tokens, std::size_t count);
  // The request's response so far (empty when every automaton holding it overflowed).
  std::vector<int32_t> response(int64_t request) const;

  bool has_request(int64_t request) const;
  RequestInfo info(int64_t request) const;
  std::size_t num_requests() const;
  std::size_t num_groups() const;
  std::size_t memory_bytes() const;
  // Tokens held by the global index (0 when it is off).
  int64_t global_tokens() const;
  const DraftPolicy& policy() const { return policy_; }

 private:
  struct Group {
    std::unique_ptr<Automaton> automaton;
    int32_t members = 0;
    bool overflow = false;
    int64_t tokens = 0;  // prompt once plus every member's output
  };
  struct Request {
    std::unique_ptr<Automaton> own;  // null when drafting only from the group
    bool own_overflow = false;
    int64_t group = -1;
    int32_t group_sid = 0;
    int64_t num_tokens = 0;
    uint64_t last_step = 0;  // stamp of the last batch step that named it
    // The adaptive policy: every candidate kind's draft at the request's last step (goodput.hpp's kinds: the
    // sources' copies, the counted paths), its tokens' evidence classes, scored at its next step.
    std::vector<int32_t> candidates;  // kCandidateKinds x the step's k
    std::vector<uint8_t> evidence;    // the same shape
    int32_t candidate_lengths[kCandidateKinds] = {};
    int32_t candidate_matches[kCandidateKinds] = {};
    int32_t candidate_certain[kCandidateKinds] = {};
    int32_t counted_source = kNoDraftSource;  // the automaton the counted paths came from (a DraftSource)
    bool scored = false;  // whether its candidates are scored at the next step
  };
  // What propose_locked wrote: how many tokens, the match behind them and their source.
  struct Proposal {
    int32_t length = 0;        // draft tokens kept (the policy's length rule applied)
    int32_t match_length = 0;
    int32_t source = kNoDraftSource;
    int32_t certain = 0;
    int32_t found = 0;         // continuation tokens found, before the length rule
  };

  Request& find(int64_t request);
  const Request& find(int64_t request) const;
  void check_tokens(const int32_t* tokens, std::size_t count) const;
  void check_k(int32_t k) const;
  void append_locked(Request& r, const int32_t* tokens, std::size_t count);
  Proposal propose_locked(const Request& r, int32_t k, int32_t* out) const;
  // Every source's draft for the request: slots[s] and out[s * k ...] for DraftSource s (length 0: none).
  void candidates_locked(const Request& r, int32_t k, Proposal* slots, int32_t* out) const;
  // The counted kinds' candidates (Automaton::counted_paths) and every kind's evidence classes, into r's
  // candidate arrays after candidates_locked filled the copies' (slots[0 .. kSources)).
  void counted_locked(Request& r, int32_t k, Proposal* slots) const;
  // Each candidate token's agreement with the row's other candidates (kAgreementClasses), folded into its
  // evidence class in r's evidence array, after counted_locked; counted proposals only (on the copies alone it
  // cost 0.2-0.4% MAL at equal k on the real traces, where with the counted paths it gained 0.6-1.3%).
  void agreement_locked(Request& r, int32_t k, const Proposal* slots) const;
  // The row's automaton that keeps counts (its group's, else its own) and its string id there; null if none.
  const Automaton* counter_locked(const Request& r, int32_t* sid, int32_t* source) const;
  // step_goodput's choice: each row's candidate kind expected to be accepted longest, and its values.
  void choose_locked(std::size_t rows, int32_t k, const uint8_t* greedy, const int32_t* limits,
                     const double* weights, int32_t* kinds);
  // Validates a step's rows and appends their tokens (step, step_candidates); batch_ holds the rows.
  void append_batch_locked(const int64_t* requests, std::size_t rows, const int32_t* tokens,
                           const int64_t* offsets);
  int32_t draft_length(int32_t match_length, int32_t k) const;
  int32_t tail_locked(const Request& r, int32_t limit, int32_t* out) const;
  std::vector<int32_t> response_locked(const Request& r) const;

  DraftPolicy policy_;
  mutable std::mutex mutex_;
  std::unordered_map<int64_t, Request> requests_;
  std::unordered_map<int64_t, Group> groups_;
  uint64_t step_stamp_ = 0;
  std::vector<Request*> batch_;  // reused across steps: no allocation per step
  mutable std::vector<int32_t> candidate_buffer_;  // propose_locked's candidates, under the lock
  std::unique_ptr<GlobalIndex> global_;  // null when max_global_tokens is 0
  std::unique_ptr<AcceptanceModel> acceptance_;  // the adaptive policy's, made at its first step (its k)
  std::vector<double> values_;  // step_goodput's per-row values, reused across steps
};

}  // namespace samrollout
