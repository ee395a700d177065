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
      g.automaton = std::make_unique<Automaton>(policy_.occurrence, policy_.min_probability,
                                                policy_.proposals == Proposals::kCounted);
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
    // The counted proposals count in the group's automaton, which holds the request's text too.
    r.own = std::make_unique<Automaton>(policy_.occurrence, policy_.min_probability,
                                        policy_.proposals == Proposals::kCounted && r.group < 0);
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

void Drafter::candidates_locked(const Request& r, int32_t k, Proposal* slots, int32_t* out) const {
  const auto width = static_cast<std::size_t>(k);
  for (int32_t slot = 0; slot < kSources; ++slot) slots[slot] = Proposal{};
  // One source's continuation (found tokens, from a match of `match`), cut by the policy's length rule.
  const auto keep = [&](DraftSource source, int32_t found, int32_t match, const Automaton* automaton, int32_t sid) {
    const auto s = static_cast<int32_t>(source);
    Proposal& slot = slots[s];
    slot.found = found;
    slot.match_length = found > 0 ? match : 0;
    slot.length = std::max(0, std::min(found, draft_length(match, k)));
    if (slot.length == 0) return;
    slot.source = s;
    if (automaton != nullptr) slot.certain = automaton->certain(sid, out + static_cast<std::size_t>(s) * width, slot.length);
  };
  const auto row = [&](DraftSource source) { return out + static_cast<std::size_t>(source) * width; };
  if (r.own && !r.own_overflow) {
    int32_t match = 0;
    const int32_t found = r.own->continuation(1, k, row(DraftSource::kOwn), &match);
    keep(DraftSource::kOwn, found, match, r.own.get(), 1);
  }
  if (r.group >= 0 && policy_.source != Source::kOwn) {
    const Group& g = groups_.at(r.group);
    if (!g.overflow) {
      int32_t match = 0;
      const int32_t found = g.automaton->continuation(r.group_sid, k, row(DraftSource::kGroup), &match);
      keep(DraftSource::kGroup, found, match, g.automaton.get(), r.group_sid);
    }
  }
  if (global_) {
    int32_t window[GlobalIndex::kWindow];
    const int32_t w = tail_locked(r, GlobalIndex::kWindow, window);
    int32_t match = 0;
    const int32_t found = global_->propose(window, static_cast<std::size_t>(w), k, row(DraftSource::kGlobal), &match);
    keep(DraftSource::kGlobal, found, match, nullptr, 0);
  }
}

Drafter::Proposal Drafter::propose_locked(const Request& r, int32_t k, int32_t* out) const {
  Proposal slots[kSources];
  std::vector<int32_t>& drafts = candidate_buffer_;
  drafts.resize(static_cast<std::size_t>(kSources) * static_cast<std::size_t>(k));
  candidates_locked(r, k, slots, drafts.data());
  // Prefer the longer match (among the continuations found, before the length rule cuts them); the request's
  // own history wins ties and near-ties, and the global index (other prompts' text) wins only by more than
  // its margin.
  const Proposal* chosen = &slots[static_cast<int32_t>(DraftSource::kOwn)];
  const Proposal& group = slots[static_cast<int32_t>(DraftSource::kGroup)];
  if (group.found > 0 && (chosen->found == 0 || group.match_length > chosen->match_length + policy_.group_margin)) {
    chosen = &group;
  }
  const Proposal& global = slots[static_cast<int32_t>(DraftSource::kGlobal)];
  if (global.found > 0 &&
      (chosen->found == 0 || global.match_length > chosen->match_length + policy_.global_margin)) {
    chosen = &global;
  }
  if (chosen->length == 0) return {};
  const int32_t* from = drafts.data() + static_cast<std::size_t>(chosen->source) * static_cast<std::size_t>(k);
  std::copy(from, from + chosen->length, out);
  return *chosen;
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
  draft.certain = proposal.certain;
  if (proposal.source != kNoDraftSource) draft.source = static_cast<DraftSource>(proposal.source);
  return draft;
}

CountedDraft Drafter::counted(int64_t request, int32_t k) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_k(k);
  const Request& live = find(request);
  const auto width = static_cast<std::size_t>(k);
  std::vector<int32_t> candidates(static_cast<std::size_t>(kCandidateKinds) * width, -1);
  Proposal slots[kCandidateKinds];
  candidates_locked(live, k, slots, candidates.data());
  CountedDraft out;
  int32_t sid = 0;
  int32_t source = kNoDraftSource;
  const Automaton* counter = counter_locked(live, &sid, &source);
  if (counter == nullptr || policy_.proposals != Proposals::kCounted) return out;
  const Match& match = counter->match(sid);
  std::vector<int32_t> main(width), second(width);
  std::vector<TokenEvidence> main_evidence(width), second_evidence(width);
  const CountedPaths paths = counter->counted_paths(match, k, policy_.min_probability,
                                                    candidates.data() + static_cast<std::size_t>(source) * width,
                                                    slots[source].length, main.data(), main_evidence.data(),
                                                    second.data(), second_evidence.data());
  const int32_t allowed = draft_length(paths.match_length, k);
  const auto keep = [&](int32_t length, const std::vector<int32_t>& tokens, const std::vector<TokenEvidence>& ev,
                        std::vector<int32_t>* to, std::vector<int32_t>* counts, std::vector<int32_t>* totals) {
    const int32_t n = std::max(0, std::min(length, allowed));
    for (int32_t d = 0; d < n; ++d) {
      to->push_back(tokens[static_cast<std::size_t>(d)]);
      counts->push_back(ev[static_cast<std::size_t>(d)].count);
      totals->push_back(ev[static_cast<std::size_t>(d)].total);
    }
  };
  keep(paths.main_length, main, main_evidence, &out.main, &out.main_counts, &out.main_totals);
  keep(paths.second_length, second, second_evidence, &out.second, &out.second_counts, &out.second_totals);
  out.match_length = out.main.empty() && out.second.empty() ? 0 : paths.match_length;
  return out;
}

void Drafter::append_batch_locked(const int64_t* requests, std::size_t rows, const int32_t* tokens,
                                  const int64_t* offsets) {
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
}

void Drafter::step(const int64_t* requests, std::size_t rows, const int32_t* tokens, const int64_t* offsets,
                   int32_t k, int32_t* drafts, int32_t* lengths, int32_t* match_lengths, int32_t* sources,
                   int32_t* certain) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_k(k);
  append_batch_locked(requests, rows, tokens, offsets);
  for (std::size_t i = 0; i < rows; ++i) {
    int32_t* row = drafts + i * static_cast<std::size_t>(k);
    const Proposal proposal = propose_locked(*batch_[i], k, row);
    lengths[i] = proposal.length;
    match_lengths[i] = proposal.match_length;
    sources[i] = proposal.source;
    certain[i] = proposal.certain;
    std::fill(row + proposal.length, row + k, -1);
  }
}

void Drafter::step_candidates(const int64_t* requests, std::size_t rows, const int32_t* tokens,
                              const int64_t* offsets, int32_t k, int32_t* drafts, int32_t* lengths,
                              int32_t* match_lengths, int32_t* certain) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_k(k);
  append_batch_locked(requests, rows, tokens, offsets);
  const auto width = static_cast<std::size_t>(k);
  for (std::size_t i = 0; i < rows; ++i) {
    Proposal slots[kSources];
    int32_t* row = drafts + i * kSources * width;
    candidates_locked(*batch_[i], k, slots, row);
    for (int32_t slot = 0; slot < kSources; ++slot) {
      const std::size_t at = i * kSources + static_cast<std::size_t>(slot);
      lengths[at] = slots[slot].length;
      match_lengths[at] = slots[slot].match_length;
      certain[at] = slots[slot].certain;
      std::fill(row + static_cast<std::size_t>(slot) * width + slots[slot].length,
                row + static_cast<std::size_t>(slot + 1) * width, -1);
    }
  }
}

const Automaton* Drafter::counter_locked(const Request& r, int32_t* sid, int32_t* source) const {
  if (r.group >= 0) {
    const Group& g = groups_.at(r.group);
    if (!g.overflow && g.automaton->counts()) {
      *sid = r.group_sid;
      *source = static_cast<int32_t>(DraftSource::kGroup);
      return g.automaton.get();
    }
  }
  if (r.own && !r.own_overflow && r.own->counts()) {
    *sid = 1;
    *source = static_cast<int32_t>(DraftSource::kOwn);
    return r.own.get();
  }
  return nullptr;
}

void Drafter::counted_locked(Request& r, int32_t k, Proposal* slots) const {
  const auto width = static_cast<std::size_t>(k);
  const auto row = [&](int32_t kind) { return r.candidates.data() + static_cast<std::size_t>(kind) * width; };
  const auto marks = [&](int32_t kind) { return r.evidence.data() + static_cast<std::size_t>(kind) * width; };
  for (int32_t kind = kSources; kind < kCandidateKinds; ++kind) slots[kind] = Proposal{};
  int32_t sid = 0;
  const Automaton* counter = counter_locked(r, &sid, &r.counted_source);
  TokenEvidence evidence[kMaxDraftTokens];
  if (counter == nullptr) {  // no counts: the certain prefix is the evidence
    for (int32_t kind = 0; kind < kCandidateKinds; ++kind) {
      uint8_t* out = marks(kind);
      for (int32_t d = 0; d < k; ++d) out[d] = d < slots[kind].certain ? kCertainEvidence : kUnknownEvidence;
    }
    return;
  }
  const Match& match = counter->match(sid);
  for (int32_t kind = 0; kind < kSources; ++kind) {  // the copies' tokens, as the counts saw them
    uint8_t* out = marks(kind);
    const int32_t length = slots[kind].length;
    if (kind != static_cast<int32_t>(DraftSource::kGlobal)) counter->evidence(match, row(kind), length, evidence);
    for (int32_t d = 0; d < k; ++d) {
      out[d] = d < length && kind != static_cast<int32_t>(DraftSource::kGlobal)
                   ? evidence_class(evidence[d].count, evidence[d].total) : kUnknownEvidence;
    }
  }
  if (policy_.proposals != Proposals::kCounted || match.state == 0) return;
  const int32_t prefer_kind = r.counted_source;  // the same automaton's recent copy breaks ties
  TokenEvidence second_evidence[kMaxDraftTokens];
  const CountedPaths paths = counter->counted_paths(match, k, policy_.min_probability, row(prefer_kind),
                                                    slots[prefer_kind].length, row(kCountedKind), evidence,
                                                    row(kSecondKind), second_evidence);
  const int32_t allowed = draft_length(paths.match_length, k);
  const std::pair<int32_t, const TokenEvidence*> made[] = {{paths.main_length, evidence},
                                                           {paths.second_length, second_evidence}};
  for (int32_t j = 0; j < 2; ++j) {
    const int32_t kind = kCountedKind + j;
    Proposal& slot = slots[kind];
    slot.found = made[j].first;
    slot.length = std::max(0, std::min(made[j].first, allowed));
    slot.match_length = slot.length > 0 ? paths.match_length : 0;
    slot.source = slot.length > 0 ? r.counted_source : kNoDraftSource;
    slot.certain = slot.length > 0 ? counter->certain(sid, row(kind), slot.length) : 0;
    uint8_t* out = marks(kind);
    for (int32_t d = 0; d < k; ++d) {
      out[d] = d < slot.length ? evidence_class(made[j].second[d].count, made[j].second[d].total) : kUnknownEvidence;
    }
  }
}

void Drafter::agreement_locked(Request& r, int32_t k, const Proposal* slots) const {
  const auto width = static_cast<std::size_t>(k);
  for (int32_t s = 0; s < kCandidateKinds; ++s) {
    const int32_t length = slots[s].length;
    if (length == 0) continue;
    const int32_t* mine = r.candidates.data() + static_cast<std::size_t>(s) * width;
    uint8_t* marks = r.evidence.data() + static_cast<std::size_t>(s) * width;
    int32_t others = 0;
    int32_t agree[kMaxDraftTokens] = {};  // how many others share the prefix through each depth
    for (int32_t o = 0; o < kCandidateKinds; ++o) {
      if (o == s || slots[o].length == 0) continue;
      ++others;
      const int32_t* theirs = r.candidates.data() + static_cast<std::size_t>(o) * width;
      const int32_t common = std::min(length, slots[o].length);
      for (int32_t d = 0; d < common && theirs[d] == mine[d]; ++d) ++agree[d];
    }
    for (int32_t d = 0; d < length; ++d) {
      const int32_t agreement = others == 0 ? 0 : std::min(agree[d], 2) + 1;
      marks[d] = with_agreement(marks[d], agreement);
    }
  }
}

void Drafter::choose_locked(std::size_t rows, int32_t k, const uint8_t* greedy, const int32_t* limits,
                            const double* weights, int32_t* kinds) {
  const auto width = static_cast<std::size_t>(k);
  values_.assign(rows * width, 0.0);
  std::vector<double> reach(width);
  for (std::size_t i = 0; i < rows; ++i) {  // each row's candidates, and the one expected to go furthest
    Request& r = *batch_[i];
    r.candidates.resize(static_cast<std::size_t>(kCandidateKinds) * width);
    r.evidence.resize(r.candidates.size());
    Proposal slots[kCandidateKinds];
    candidates_locked(r, k, slots, r.candidates.data());
    counted_locked(r, k, slots);
    if (policy_.proposals == Proposals::kCounted) agreement_locked(r, k, slots);  // the copies' model as before
    r.scored = limits[i] > 0;
    int32_t chosen = kNoDraftSource;
    double best = 0.0;
    for (int32_t s = 0; s < kCandidateKinds; ++s) {
      r.candidate_lengths[s] = slots[s].length;
      r.candidate_matches[s] = slots[s].match_length;
      r.candidate_certain[s] = slots[s].certain;
      const int32_t usable = std::min(slots[s].length, limits[i]);
      if (usable <= 0) continue;
      const uint8_t* marks = r.evidence.data() + static_cast<std::size_t>(s) * width;
      const double expected = acceptance_->reach(greedy[i] != 0, s, slots[s].match_length, marks,
                                                 usable, reach.data());
      if (expected > best) {
        best = expected;
        chosen = s;
        for (int32_t d = 0; d < usable; ++d) values_[i * width + static_cast<std::size_t>(d)] = weights[i] * reach[d];
        std::fill(values_.begin() + static_cast<std::ptrdiff_t>(i * width + static_cast<std::size_t>(usable)),
                  values_.begin() + static_cast<std::ptrdiff_t>((i + 1) * width), 0.0);
      }
    }
    kinds[i] = chosen;
  }
}

void Drafter::step_goodput(const int64_t* requests, std::size_t rows, const int32_t* tokens, const int64_t* offsets,
                           int32_t k, const uint8_t* greedy, const int32_t* limits, const double* weights,
                           const double* seconds, std::size_t points, int32_t* drafts, int32_t* lengths,
                           int32_t* match_lengths, int32_t* sources, int32_t* certain) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_k(k);
  if (points == 0) fail("the step's seconds need at least one point");
  append_batch_locked(requests, rows, tokens, offsets);
  if (!acceptance_ || acceptance_->depth() != k) acceptance_ = std::make_unique<AcceptanceModel>(k);
  AcceptanceModel& acceptance = *acceptance_;
  const auto width = static_cast<std::size_t>(k);
  const std::size_t stored = static_cast<std::size_t>(kCandidateKinds) * width;
  acceptance.age(rows);
  for (std::size_t i = 0; i < rows; ++i) {  // score each row's last candidates against what it just got
    Request& r = *batch_[i];
    const int64_t got = offsets[i + 1] - offsets[i];
    if (!r.scored || got == 0 || r.candidates.size() != stored || r.evidence.size() != stored) continue;
    const int32_t* produced = tokens + offsets[i];
    for (int32_t s = 0; s < kCandidateKinds; ++s) {
      const int32_t length = r.candidate_lengths[s];
      if (length == 0) continue;
      const int32_t visible = static_cast<int32_t>(std::min<int64_t>(length, got));
      const int32_t* candidate = r.candidates.data() + static_cast<std::size_t>(s) * width;
      int32_t agreed = 0;
      while (agreed < visible && candidate[agreed] == produced[agreed]) ++agreed;
      acceptance.observe(greedy[i] != 0, s, r.candidate_matches[s],
                         r.evidence.data() + static_cast<std::size_t>(s) * width, agreed,
                         agreed < visible ? agreed + 1 : agreed);
    }
  }
  choose_locked(rows, k, greedy, limits, weights, sources);
  allocate(values_.data(), rows, k, weights, seconds, points, lengths);
  for (std::size_t i = 0; i < rows; ++i) {
    const Request& r = *batch_[i];
    int32_t* row = drafts + i * width;
    const int32_t kind = lengths[i] > 0 ? sources[i] : kNoDraftSource;
    sources[i] = kind < kSources ? kind : r.counted_source;  // a counted path reports its automaton
    match_lengths[i] = kind == kNoDraftSource ? 0 : r.candidate_matches[kind];
    certain[i] = kind == kNoDraftSource ? 0 : r.candidate_certain[kind];
    if (kind != kNoDraftSource) {
      const int32_t* from = r.candidates.data() + static_cast<std::size_t>(kind) * width;
      std::copy(from, from + lengths[i], row);
    }
    std::fill(row + lengths[i], row + k, -1);
  }
}

void Drafter::acceptance_table(double* seen, double* accepted) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (acceptance_) {
    acceptance_->first_tokens(seen, accepted);
  } else {
    std::fill(seen, seen + AcceptanceModel::kSources * kMatchBuckets, 0.0);
    std::fill(accepted, accepted + AcceptanceModel::kSources * kMatchBuckets, 0.0);
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
