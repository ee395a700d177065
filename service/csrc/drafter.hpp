// The drafter: per-request and per-group suffix automata, their lifecycle and
// memory bounds, and the draft policy.  One object serves a whole engine; every
// public call takes the object's lock, so Python threads may share it with the
// GIL released.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "automaton.hpp"

namespace samrollout {

// Which automata a request drafts from.
enum class Source : int32_t { kOwn = 0, kGroup = 1, kBoth = 2 };

// Where one draft came from: the request's own automaton, its group's, or the global index.
enum class DraftSource : int32_t { kOwn = 0, kGroup = 1, kGlobal = 2 };

struct DraftPolicy {
  int32_t vocab_size = 1 << 20;     // token ids must lie in [0, vocab_size)
  int32_t min_match_length = 1;     // shorter matches propose nothing
  double match_scale = 0.0;         // >0: draft at most max(1, scale * match) tokens
  Occurrence occurrence = Occurrence::kFirst;
  double min_probability = 0.0;     // kFrequent: a draft stops where its estimated acceptance falls below
  Source source = Source::kBoth;    // for requests that belong to a group
  int32_t group_margin = 0;         // kBoth: the group's match must be longer by more than this
  int64_t max_request_tokens = int64_t{1} << 22;  // own automaton bound
  int64_t max_group_tokens = int64_t{1} << 24;    // group automaton bound
  int64_t max_global_tokens = 0;  // global index of finished responses (all prompts); 0: off
  int32_t global_margin = 4;      // its match must be longer than the chosen one's by more than this
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

  explicit Drafter(const DraftPolicy& policy);

  // Returns whether the request joined `group` (false: it drafts alone, see add_request in drafter.cpp).
  bool add_request(int64_t request, const int32_t* prompt, std::size_t count, int64_t group);
  void append(int64_t request, const int32_t* tokens, std::size_t count);
  // Writes up to k draft tokens into `out`; returns how many.
  int32_t propose(int64_t request, int32_t k, int32_t* out);
  // One engine step for a batch: rows[i] gets tokens[offsets[i]:offsets[i+1]]
  // appended, then up to k drafts written to drafts[i*k ...], lengths[i] set.
  // Everything is validated before any state changes.
  void step(const int64_t* requests, std::size_t rows, const int32_t* tokens,
            const int64_t* offsets, int32_t k, int32_t* drafts, int32_t* lengths);
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
  // The match length behind each request's last draft (0 where it drafted nothing): how much
  // evidence the draft has, for confidence gating.
  void last_match_lengths(const int64_t* requests, std::size_t count, int32_t* out) const;
  // The source of each request's last draft (a DraftSource value; -1 where it drafted nothing).
  void last_sources(const int64_t* requests, std::size_t count, int32_t* out) const;

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
    mutable int32_t last_match = 0;  // match length behind its last draft (0: no draft)
    mutable int32_t last_source = -1;  // where its last draft came from (DraftSource; -1: no draft)
  };

  Request& find(int64_t request);
  const Request& find(int64_t request) const;
  void check_tokens(const int32_t* tokens, std::size_t count) const;
  void check_k(int32_t k) const;
  void append_locked(Request& r, const int32_t* tokens, std::size_t count);
  int32_t propose_locked(const Request& r, int32_t k, int32_t* out) const;
  int32_t draft_length(int32_t match_length, int32_t k) const;
  int32_t tail_locked(const Request& r, int32_t limit, int32_t* out) const;
  std::vector<int32_t> response_locked(const Request& r) const;

  DraftPolicy policy_;
  mutable std::mutex mutex_;
  std::unordered_map<int64_t, Request> requests_;
  std::unordered_map<int64_t, Group> groups_;
  uint64_t step_stamp_ = 0;
  std::vector<Request*> batch_;  // reused across steps: no allocation per step
  std::unique_ptr<GlobalIndex> global_;  // null when max_global_tokens is 0
};

}  // namespace samrollout
