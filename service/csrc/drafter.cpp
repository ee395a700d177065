#include "drafter.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace samrollout {

namespace {

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

}  // namespace

GlobalIndex::GlobalIndex(int64_t max_tokens, Occurrence occurrence, double min_probability)
    : generation_tokens_(max_tokens / 2), occurrence_(occurrence), min_probability_(min_probability),
      newer_(std::make_unique<Automaton>(occurrence, min_probability)) {
  newer_->set_prompt(nullptr, 0);
}

bool GlobalIndex::add(const int32_t* tokens, std::size_t count) {
  const auto length = static_cast<int64_t>(count);
  if (length == 0 || length > generation_tokens_) return false;
  if (newer_tokens_ + length > generation_tokens_) {
    older_ = std::move(newer_);
    older_tokens_ = newer_tokens_;
    newer_ = std::make_unique<Automaton>(occurrence_, min_probability_);
    newer_->set_prompt(nullptr, 0);
    newer_tokens_ = 0;
  }
  newer_->add_string(tokens, count);
  newer_tokens_ += length;
  return true;
}

int32_t GlobalIndex::propose(const int32_t* window, std::size_t count, int32_t limit, int32_t* out,
                             int32_t* match_length) const {
  int32_t n = newer_->continuation_of(newer_->find(window, count), limit, out, match_length);
  if (older_) {
    int32_t older_draft[Drafter::kMaxDraftTokens];
    int32_t older_match = 0;
    const int32_t m = older_->continuation_of(older_->find(window, count), limit, older_draft, &older_match);
    if (m > 0 && (n == 0 || older_match > *match_length)) {  // the newer wins ties
      std::copy(older_draft, older_draft + m, out);
      *match_length = older_match;
      n = m;
    }
  }
  return n;
}

std::size_t GlobalIndex::memory_bytes() const {
  return newer_->memory_bytes() + (older_ ? older_->memory_bytes() : 0);
}

Drafter::Drafter(const DraftPolicy& policy) : policy_(policy) {
  policy.validate();
  if (policy.max_global_tokens > 0) {
    global_ = std::make_unique<GlobalIndex>(policy.max_global_tokens, policy.occurrence, policy.min_probability);
  }
}

Drafter::Request& Drafter::find(int64_t request) {
  auto it = requests_.find(request);
  if (it == requests_.end()) throw std::out_of_range("unknown request id " + std::to_string(request));
  return it->second;
}

const Drafter::Request& Drafter::find(int64_t request) const {
  auto it = requests_.find(request);
  if (it == requests_.end()) throw std::out_of_range("unknown request id " + std::to_string(request));
  return it->second;
}

void Drafter::check_tokens(const int32_t* tokens, std::size_t count) const {
  for (std::size_t i = 0; i < count; ++i) {
    if (tokens[i] < 0 || tokens[i] >= policy_.vocab_size) {
      fail("token id " + std::to_string(tokens[i]) + " at index " + std::to_string(i) +
           " is outside the vocabulary [0, " + std::to_string(policy_.vocab_size) + ")");
    }
  }
}

void Drafter::check_k(int32_t k) const {
  if (k < 1 || k > kMaxDraftTokens) {
    fail("k must be between 1 and " + std::to_string(kMaxDraftTokens) + ", got " + std::to_string(k));
  }
}

bool Drafter::add_request(int64_t request, const int32_t* prompt, std::size_t count, int64_t group) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (requests_.count(request)) fail("request id " + std::to_string(request) + " is already active");
  check_tokens(prompt, count);
  const auto length = static_cast<int64_t>(count);

  Request r;
  r.num_tokens = length;
  if (group >= 0) {
    auto [it, created] = groups_.try_emplace(group);
    Group& g = it->second;
    if (created) {
      g.automaton = std::make_unique<Automaton>(policy_.occurrence, policy_.min_probability);
      g.tokens = length;
      if (length > policy_.max_group_tokens) {
        g.overflow = true;
      } else {
        g.automaton->set_prompt(prompt, count);
      }
    }
    // A member's prompt starts with the group's: a sibling's, or a sibling's continued elsewhere
    // (prompt + what it generated), whose extra tokens become its response so far.  Anything else,
    // or a continuation that would pass the group's token bound, drafts alone.
    const std::size_t shared = g.overflow ? 0 : g.automaton->prompt_size();
    const auto extra = static_cast<int64_t>(count - std::min(count, shared));
    if (!g.overflow && (!g.automaton->extends_prompt(prompt, count) ||
                        g.tokens + extra > policy_.max_group_tokens)) {
      if (created) groups_.erase(it);
    } else {
      r.group = group;
      r.group_sid = g.overflow ? 0 : g.automaton->add_member();
      g.members += 1;
      if (!g.overflow && extra > 0) {
        g.tokens += extra;
        for (std::size_t i = shared; i < count; ++i) g.automaton->append(r.group_sid, prompt[i]);
      }
    }
  }
  if (r.group < 0 || policy_.source != Source::kGroup) {
    r.own = std::make_unique<Automaton>(policy_.occurrence, policy_.min_probability);
    if (length > policy_.max_request_tokens) {
      r.own_overflow = true;
      r.own.reset();
    } else {
      r.own->set_prompt(prompt, count);
      r.own->add_member();
    }
  }
  const bool joined = r.group >= 0;
  requests_.emplace(request, std::move(r));
  return joined;
}

void Drafter::append_locked(Request& r, const int32_t* tokens, std::size_t count) {
  r.num_tokens += static_cast<int64_t>(count);
  if (r.own && !r.own_overflow) {
    if (r.num_tokens > policy_.max_request_tokens) {
      r.own_overflow = true;
      r.own.reset();  // the bound is hard: free what was indexed
    } else {
      for (std::size_t i = 0; i < count; ++i) r.own->append(1, tokens[i]);
    }
  }
  if (r.group >= 0) {
    Group& g = groups_.at(r.group);
    if (!g.overflow) {
      g.tokens += static_cast<int64_t>(count);
      if (g.tokens > policy_.max_group_tokens) {
        g.overflow = true;
        g.automaton.reset();
      } else {
        for (std::size_t i = 0; i < count; ++i) g.automaton->append(r.group_sid, tokens[i]);
      }
    }
  }
}

void Drafter::append(int64_t request, const int32_t* tokens, std::size_t count) {
  std::lock_guard<std::mutex> lock(mutex_);
  Request& r = find(request);
  check_tokens(tokens, count);
  append_locked(r, tokens, count);
}

int32_t Drafter::draft_length(int32_t match_length, int32_t k) const {
  if (match_length < policy_.min_match_length) return 0;
  if (policy_.match_scale <= 0.0) return k;
  const double scaled = std::floor(policy_.match_scale * match_length);
  const int32_t limit = scaled < 1.0 ? 1 : (scaled > k ? k : static_cast<int32_t>(scaled));
  return std::min(limit, k);
}

Drafter::Proposal Drafter::propose_locked(const Request& r, int32_t k, int32_t* out) const {
  int32_t own_draft[kMaxDraftTokens];
  int32_t own_match = 0;
  int32_t own_count = 0;
  if (r.own && !r.own_overflow) own_count = r.own->continuation(1, k, own_draft, &own_match);

  int32_t group_match = 0;
  int32_t group_count = 0;
  int32_t group_draft[kMaxDraftTokens];
  if (r.group >= 0 && policy_.source != Source::kOwn) {
    const Group& g = groups_.at(r.group);
    if (!g.overflow) group_count = g.automaton->continuation(r.group_sid, k, group_draft, &group_match);
  }

  // Prefer the longer match; the request's own history wins ties and near-ties.
  const bool use_group =
      group_count > 0 && (own_count == 0 || group_match > own_match + policy_.group_margin);
  const int32_t* source = use_group ? group_draft : own_draft;
  int32_t match = use_group ? group_match : own_match;
  int32_t available = use_group ? group_count : own_count;
  int32_t which = static_cast<int32_t>(use_group ? DraftSource::kGroup : DraftSource::kOwn);

  // The global index is asked only where its match (at most kWindow long) could win.
  int32_t global_draft[kMaxDraftTokens];
  if (global_ && (available == 0 || match + policy_.global_margin < GlobalIndex::kWindow)) {
    int32_t window[GlobalIndex::kWindow];
    const int32_t w = tail_locked(r, GlobalIndex::kWindow, window);
    int32_t global_match = 0;
    const int32_t global_count = global_->propose(window, static_cast<std::size_t>(w), k, global_draft,
                                                  &global_match);
    if (global_count > 0 && (available == 0 || global_match > match + policy_.global_margin)) {
      source = global_draft;
      match = global_match;
      available = global_count;
      which = static_cast<int32_t>(DraftSource::kGlobal);
    }
  }
  const int32_t n = std::min(available, draft_length(match, k));
  std::copy(source, source + n, out);
  if (n == 0) return {};
  return {n, match, which};
}

int32_t Drafter::tail_locked(const Request& r, int32_t limit, int32_t* out) const {
  if (r.own && !r.own_overflow) return r.own->tail(1, limit, out);
  if (r.group >= 0) {
    const Group& g = groups_.at(r.group);
    if (!g.overflow) return g.automaton->tail(r.group_sid, limit, out);
  }
  return 0;
}

Draft Drafter::propose(int64_t request, int32_t k) {
  int32_t out[kMaxDraftTokens];
  Proposal proposal;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    check_k(k);
    proposal = propose_locked(find(request), k, out);
  }
  Draft draft;
  draft.tokens.assign(out, out + proposal.length);
  draft.match_length = proposal.match_length;
  if (proposal.source != kNoDraftSource) draft.source = static_cast<DraftSource>(proposal.source);
  return draft;
}

void Drafter::step(const int64_t* requests, std::size_t rows, const int32_t* tokens, const int64_t* offsets,
                   int32_t k, int32_t* drafts, int32_t* lengths, int32_t* match_lengths, int32_t* sources) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_k(k);
  if (offsets[0] != 0) fail("offsets[0] must be 0");
  std::vector<Request*>& batch = batch_;
  batch.resize(rows);
  const uint64_t stamp = ++step_stamp_;
  for (std::size_t i = 0; i < rows; ++i) {
    if (offsets[i + 1] < offsets[i]) fail("offsets must be non-decreasing");
    batch[i] = &find(requests[i]);
    if (batch[i]->last_step == stamp) {
      fail("request id " + std::to_string(requests[i]) + " appears twice in one step");
    }
    batch[i]->last_step = stamp;
  }
  check_tokens(tokens, static_cast<std::size_t>(offsets[rows]));
  for (std::size_t i = 0; i < rows; ++i) {
    append_locked(*batch[i], tokens + offsets[i], static_cast<std::size_t>(offsets[i + 1] - offsets[i]));
  }
  for (std::size_t i = 0; i < rows; ++i) {
    int32_t* row = drafts + i * static_cast<std::size_t>(k);
    const Proposal proposal = propose_locked(*batch[i], k, row);
    lengths[i] = proposal.length;
    match_lengths[i] = proposal.match_length;
    sources[i] = proposal.source;
    std::fill(row + proposal.length, row + k, -1);
  }
}

void Drafter::remove_request(int64_t request) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = requests_.find(request);
  if (it == requests_.end()) throw std::out_of_range("unknown request id " + std::to_string(request));
  const int64_t group = it->second.group;
  if (global_) {  // its response drafts for every later request
    const std::vector<int32_t> tokens = response_locked(it->second);
    global_->add(tokens.data(), tokens.size());
  }
  requests_.erase(it);
  if (group >= 0) {
    auto g = groups_.find(group);
    if (--g->second.members == 0) groups_.erase(g);  // the last sibling frees the group
  }
}

bool Drafter::add_to_group(int64_t group, const int32_t* tokens, std::size_t count) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = groups_.find(group);
  if (it == groups_.end()) throw std::out_of_range("unknown group id " + std::to_string(group));
  check_tokens(tokens, count);
  Group& g = it->second;
  if (g.overflow || g.tokens + static_cast<int64_t>(count) > policy_.max_group_tokens) return false;
  g.tokens += static_cast<int64_t>(count);
  const int32_t sid = g.automaton->add_member();
  for (std::size_t i = 0; i < count; ++i) g.automaton->append(sid, tokens[i]);
  return true;
}

bool Drafter::add_to_global(const int32_t* tokens, std::size_t count) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_tokens(tokens, count);
  return global_ ? global_->add(tokens, count) : false;
}

std::vector<int32_t> Drafter::response(int64_t request) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return response_locked(find(request));
}

std::vector<int32_t> Drafter::response_locked(const Request& r) const {
  if (r.own && !r.own_overflow) return r.own->response(1);
  if (r.group >= 0) {
    const Group& g = groups_.at(r.group);
    if (!g.overflow) return g.automaton->response(r.group_sid);
  }
  return {};
}

bool Drafter::has_request(int64_t request) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return requests_.count(request) != 0;
}

RequestInfo Drafter::info(int64_t request) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Request& r = find(request);
  RequestInfo out;
  out.num_tokens = r.num_tokens;
  out.own_overflow = r.own_overflow;
  out.group = r.group;
  if (r.own && !r.own_overflow) out.match_length = r.own->match(1).length;
  if (r.group >= 0) {
    const Group& g = groups_.at(r.group);
    out.group_overflow = g.overflow;
    if (!g.overflow) out.match_length = std::max(out.match_length, g.automaton->match(r.group_sid).length);
  }
  return out;
}

std::size_t Drafter::num_requests() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return requests_.size();
}

std::size_t Drafter::num_groups() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return groups_.size();
}

std::size_t Drafter::memory_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t total = 0;
  for (const auto& [id, r] : requests_) {
    if (r.own) total += r.own->memory_bytes();
  }
  for (const auto& [id, g] : groups_) {
    if (g.automaton) total += g.automaton->memory_bytes();
  }
  if (global_) total += global_->memory_bytes();
  return total;
}

int64_t Drafter::global_tokens() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return global_ ? global_->tokens() : 0;
}

}  // namespace samrollout
