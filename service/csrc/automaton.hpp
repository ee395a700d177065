// Online generalized suffix automaton over one prompt and the responses that
// continue it.
//
// A request's own automaton is the one-member case: the prompt followed by the
// request's output.  A group automaton indexes the prompt once and then every
// sibling's response, each sibling extending its own string from the prompt's
// end state; states and transitions are shared, so a sibling that is behind
// finds the text a sibling ahead of it already wrote.
//
// Appending a token is amortized O(1) (the classic online construction, with
// the two extra cases that make it correct for several strings); the longest
// suffix of a member's string that occurs elsewhere in the automaton comes out
// of the same step, so drafting costs O(1) plus the draft length.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "flat_map.hpp"

namespace samrollout {

// Which occurrence of the matched suffix supplies the draft.  kFrequent follows no single
// occurrence: from the matched state it takes, token by token, the continuation seen most often
// after the context (the automaton as a variable-order Markov model, backing off to shorter
// contexts where the longest has no continuation yet), which needs occurrence counts per state.
enum class Occurrence : int32_t { kFirst = 0, kRecent = 1, kFrequent = 2 };

// What a draft token's context had seen (Automaton::counted_paths, Automaton::evidence): how many earlier
// occurrences of the context continued with the token (`count`) out of all that continued (`total`, the
// support).  total 0: unknown (the draft ran past every occurrence, or the automaton keeps no counts).
struct TokenEvidence {
  int32_t count = 0;
  int32_t total = 0;
};

// Counted proposals from one matched context (Automaton::counted_paths): the majority path and the second
// path, which leaves the majority where the counts split most, each with its tokens' evidence.
struct CountedPaths {
  int32_t match_length = 0;  // the context length the first token was drafted from (0: nothing)
  int32_t main_length = 0;
  int32_t second_length = 0;
};

// Where a string position lives: member `sid` (0 is the shared prompt) at
// logical position `pos` of prompt + that member's response.
struct Position {
  int32_t sid = -1;
  int32_t pos = -1;
};

// The longest earlier match found for a member's current suffix.
struct Match {
  int32_t state = 0;   // automaton state of the matched suffix (0: none)
  int32_t length = 0;  // number of tokens matched
  Position anchor;     // where the chosen occurrence of the match ends
};

class Automaton {
 public:
  // `min_probability` (kFrequent only): a draft stops where the estimated probability that all of
  // it is accepted (the product of each token's share of its context's continuations) falls below.
  // `counts`: keep occurrence counts (always under kFrequent) for counted_paths and evidence, along at most
  // kMaxCountedHops suffix links per token (kMaxCountHops under kFrequent).
  explicit Automaton(Occurrence occurrence, double min_probability = 0.0, bool counts = false)
      : occurrence_(occurrence), min_probability_(min_probability),
        count_hops_(occurrence == Occurrence::kFrequent ? kMaxCountHops : (counts ? kMaxCountedHops : 0)) {
    new_state(0, -1, Position{}, Position{});
  }

  // Indexes the shared prompt; call once, before any member is added.
  void set_prompt(const int32_t* tokens, std::size_t count) {
    prompt_.assign(tokens, tokens + count);
    int32_t last = 0;
    for (std::size_t i = 0; i < count; ++i) {
      Position at{0, static_cast<int32_t>(i)};
      last = extend(last, tokens[i], at, &prompt_match_);
    }
    prompt_end_ = last;
  }

  // Whether `tokens` starts with the indexed prompt: a sibling's prompt, or a continuation of
  // a response to it (the prompt plus tokens generated elsewhere).
  bool extends_prompt(const int32_t* tokens, std::size_t count) const {
    return count >= prompt_.size() && std::equal(prompt_.begin(), prompt_.end(), tokens);
  }

  std::size_t prompt_size() const { return prompt_.size(); }

  // Adds a member whose string starts as the prompt; returns its string id.
  int32_t add_member() {
    members_.push_back(Member{prompt_end_, {}, prompt_match_});
    return static_cast<int32_t>(members_.size());  // sid 0 is the prompt
  }

  // Appends one token to member `sid` and updates its match.
  void append(int32_t sid, int32_t token) {
    Member& m = members_[sid - 1];
    Position at{sid, static_cast<int32_t>(prompt_.size() + m.tokens.size())};
    m.tokens.push_back(token);
    m.last = extend(m.last, token, at, &m.match);
  }

  const Match& match(int32_t sid) const { return members_[sid - 1].match; }

  // Member `sid`'s response so far (its string without the prompt).
  const std::vector<int32_t>& response(int32_t sid) const { return members_[sid - 1].tokens; }

  // Number of tokens member `sid`'s string holds (prompt included).
  std::size_t length(int32_t sid) const {
    return prompt_.size() + members_[sid - 1].tokens.size();
  }

  // Writes up to `limit` tokens that followed the member's match into `out`;
  // returns how many.  When the occurrence lies in the member's own string, its
  // continuation runs into the suffix being matched, so the draft continues
  // periodically (a loop of period p drafts all `limit` tokens, not p).  When the
  // chosen occurrence has no continuation yet (it ends where a sibling's string
  // ends), shorter matches are tried, at most `kMaxFallbackHops` suffix links up,
  // keeping drafting O(1).
  int32_t continuation(int32_t sid, int32_t limit, int32_t* out, int32_t* match_length) const {
    return continuation_from(members_[sid - 1].match, sid, limit, out, match_length);
  }

  // `certain_prefix` of member `sid`'s current match.
  int32_t certain(int32_t sid, const int32_t* draft, int32_t count) const {
    return certain_prefix(members_[sid - 1].match, draft, count);
  }

  // Adds a whole string (a finished response) as a new member; returns its string id.
  // Used by the global index, whose automaton has an empty prompt.
  int32_t add_string(const int32_t* tokens, std::size_t count) {
    const int32_t sid = add_member();
    for (std::size_t i = 0; i < count; ++i) append(sid, tokens[i]);
    return sid;
  }

  // The longest suffix of `window` that occurs in the automaton (for a string that is not
  // a member: a running request looked up in the global index).  O(count) amortized.
  Match find(const int32_t* window, std::size_t count) const {
    int32_t state = 0;
    int32_t length = 0;
    for (std::size_t i = 0; i < count; ++i) {
      int32_t target = next(state, window[i]);
      while (target == -1 && state != 0) {
        state = states_[state].link;
        length = states_[state].len;
        target = next(state, window[i]);
      }
      if (target == -1) {
        length = 0;  // the token occurs nowhere: start again at the root
      } else {
        state = target;
        length += 1;
      }
    }
    Match match;
    match.state = length > 0 ? state : 0;
    match.length = length;
    match.anchor = occurrence_ == Occurrence::kFirst ? states_[match.state].first : states_[match.state].recent;
    return match;
  }

  // Writes up to `limit` tokens that followed `match` (from `find`) into `out`; returns how
  // many, with the length of the match they come from (as `continuation`, for a string that
  // is not a member).
  int32_t continuation_of(const Match& match, int32_t limit, int32_t* out, int32_t* match_length) const {
    return continuation_from(match, kNoMember, limit, out, match_length);
  }

  // How many leading tokens of `draft` (the continuation of `match`) were the only continuation ever
  // seen: walking from the matched state along the draft, the count of states passed that have exactly
  // one outgoing transition, up to the first that has several (or none: the draft ran past every
  // occurrence).  Evidence for the drafting policy: a token that every earlier occurrence agreed on is
  // likelier to be accepted than one taken from the latest of several that disagree.
  int32_t certain_prefix(const Match& match, const int32_t* draft, int32_t count) const {
    int32_t state = match.state;
    int32_t certain = 0;
    while (certain < count && state > 0) {
      const State& s = states_[state];
      if (s.token0 == EdgeTable::kMissing || s.head != EdgeTable::kMissing) break;  // none, or several
      if (s.token0 != draft[certain]) break;
      state = s.target0;
      ++certain;
    }
    return certain;
  }

  // Copies the last at most `limit` tokens of member `sid`'s string (prompt included) to
  // `out`; returns how many.
  int32_t tail(int32_t sid, int32_t limit, int32_t* out) const {
    const auto total = static_cast<int64_t>(length(sid));
    const int64_t n = total < limit ? total : limit;
    for (int64_t i = 0; i < n; ++i) out[i] = token_at(sid, static_cast<int32_t>(total - n + i));
    return static_cast<int32_t>(n);
  }

  // Whether this automaton keeps occurrence counts (counted_paths and evidence need them).
  bool counts() const { return count_hops_ > 0; }

  // Each token's evidence along `draft` from `match`'s state: how often the context continued with it, of how
  // often it continued at all.  Where the context never continued with the token, shorter contexts are tried
  // (at most kMaxFallbackHops suffix links); where none did, that token and the rest are unknown (total 0).
  void evidence(const Match& match, const int32_t* draft, int32_t count, TokenEvidence* out) const {
    int32_t state = match.state;
    int32_t d = 0;
    for (int hop = 0; d < count && state > 0;) {
      const EdgeScan scan = scan_edges(state, draft[d]);
      if (scan.too_wide) break;
      if (scan.wanted_target < 0) {
        if (++hop > kMaxFallbackHops) break;
        state = states_[state].link;
        continue;
      }
      out[d++] = TokenEvidence{static_cast<int32_t>(scan.wanted_count), static_cast<int32_t>(scan.total)};
      state = scan.wanted_target;
    }
    for (; d < count; ++d) out[d] = TokenEvidence{};
  }

  // Counted proposals after `match`, as SuffixDecoding's tree proposes by frequency: the main path takes at each
  // depth the continuation counted most often after the context (ties go to `prefer`'s token while the path
  // still follows `prefer`, the recent copy), and stops where the product of its tokens' shares (their
  // probability estimate) falls below `min_probability`, at `limit`, or at a context too wide to scan.  The
  // second path leaves the main one at the depth where taking the runner-up there is likeliest (the main
  // prefix's probability times the runner-up's share) and goes on by majority.  A context that never continued
  // backs off along its suffix link, at most kMaxFallbackHops times.  Needs counts().
  CountedPaths counted_paths(const Match& match, int32_t limit, double min_probability, const int32_t* prefer,
                             int32_t prefer_count, int32_t* main, TokenEvidence* main_evidence, int32_t* second,
                             TokenEvidence* second_evidence) const {
    CountedPaths paths;
    Branch branch;
    paths.main_length = majority_walk(match.state, match.length, 1.0, 0, limit, min_probability, prefer,
                                      prefer_count, main, main_evidence, &branch, &paths.match_length);
    if (branch.target < 0) return paths;
    std::copy(main, main + branch.depth, second);
    std::copy(main_evidence, main_evidence + branch.depth, second_evidence);
    second[branch.depth] = branch.token;
    second_evidence[branch.depth] = branch.evidence;
    int32_t unused = 0;
    paths.second_length = majority_walk(branch.target, branch.length, branch.probability, branch.depth + 1, limit,
                                        min_probability, nullptr, 0, second, second_evidence, nullptr, &unused);
    return paths;
  }

  std::size_t memory_bytes() const {
    std::size_t bytes = prompt_.capacity() * sizeof(int32_t) + edges_.memory_bytes() +
                        states_.capacity() * sizeof(State) +
                        (edge_token_.capacity() + edge_target_.capacity() + edge_next_.capacity()) *
                            sizeof(int32_t);
    for (const Member& m : members_) bytes += m.tokens.capacity() * sizeof(int32_t);
    return bytes + members_.capacity() * sizeof(Member);
  }

  static constexpr int kMaxFallbackHops = 8;
  // Occurrence counts are added along at most this many suffix links per appended token (the
  // path is about the text's repeat depth: a loop of period p over n tokens gives n / p hops);
  // past it the shortest contexts' counts are undercounted, which only touches drafts that back
  // off that far.
  static constexpr int kMaxCountHops = 256;
  // The same bound where counts only feed counted proposals and evidence: on a loop the path grows by one
  // link per period, and counting along all of it cost up to 7x the drafter time; past this many links only
  // contexts far shorter than the match are undercounted.
  static constexpr int kMaxCountedHops = 24;
  // A frequent draft stops at a context with more continuations than this (a short, common
  // context: scanning it would cost more than its draft is worth).
  static constexpr int kMaxScanEdges = 64;

 private:
  struct Member {
    int32_t last;                 // state of the member's whole string
    std::vector<int32_t> tokens;  // the member's response so far
    Match match;                  // longest match of its current suffix
  };

  static constexpr int32_t kNoMember = -1;

  // The draft after `match` of the string `self` (a member's sid, or kNoMember).  An occurrence
  // in the prompt continues into `self`'s own string, and one there continues periodically.
  int32_t continuation_from(const Match& match, int32_t self, int32_t limit, int32_t* out,
                            int32_t* match_length) const {
    if (occurrence_ == Occurrence::kFrequent) return frequent_continuation(match, limit, out, match_length);
    int32_t state = match.state;
    Position anchor = match.anchor;
    int32_t length = match.length;
    for (int hop = 0; state > 0 && hop <= kMaxFallbackHops; ++hop) {
      const int32_t source = anchor.sid == 0 && self != kNoMember ? self : anchor.sid;
      const int32_t available = source < 0 ? 0 : static_cast<int32_t>(length_of(source)) - 1 - anchor.pos;
      if (available > 0) {
        const int32_t n = source == self ? limit : (available < limit ? available : limit);
        for (int32_t i = 0; i < n; ++i) {
          out[i] = i < available ? token_at(source, anchor.pos + 1 + i) : out[i - available];
        }
        *match_length = length;
        return n;
      }
      state = states_[state].link;
      length = states_[state].len;
      anchor = states_[state].first;
    }
    *match_length = 0;
    return 0;
  }

  // The most frequent continuation after `match`, one token at a time: each token is the
  // context's most counted next token, and the context grows by it; a context with no
  // continuation yet (it ends where a string ends, e.g. the member's own) backs off along its
  // suffix link, at most kMaxFallbackHops times.  A token's probability is its count over the
  // count of all the context's continuations; the draft stops at `limit`, at a context with
  // more than kMaxScanEdges continuations, or where the running product of its tokens'
  // probabilities falls below min_probability_.  `match_length` is the context length the
  // first token was drafted from.  Ties are broken by edge order (deterministic).
  int32_t frequent_continuation(const Match& match, int32_t limit, int32_t* out, int32_t* match_length) const {
    int32_t state = match.state;
    int32_t length = match.length;
    double confidence = 1.0;
    int32_t n = 0;
    int hops = 0;
    *match_length = 0;
    while (n < limit && state > 0) {
      const State& s = states_[state];
      int32_t best_token = -1;
      int32_t best_target = -1;
      int64_t best_count = 0;
      int64_t total = 0;
      int scanned = 0;
      for (int32_t e = s.head; e != EdgeTable::kMissing; e = edge_next_[e]) {
        if (++scanned > kMaxScanEdges) return n;
        const int64_t count = states_[edge_target_[e]].count;
        total += count;
        if (count > 0 && count >= best_count) {
          best_count = count;
          best_token = edge_token_[e];
          best_target = edge_target_[e];
        }
      }
      if (s.token0 != EdgeTable::kMissing) {  // the inline edge, the state's first: it wins ties
        const int64_t count = states_[s.target0].count;
        total += count;
        if (count > 0 && count >= best_count) {
          best_count = count;
          best_token = s.token0;
          best_target = s.target0;
        }
      }
      if (best_count == 0) {  // no continuation yet: a shorter context
        if (++hops > kMaxFallbackHops) break;
        state = s.link;
        length = states_[state].len;
        continue;
      }
      confidence *= static_cast<double>(best_count) / static_cast<double>(total);
      if (confidence < min_probability_) break;
      if (n == 0) *match_length = length;
      out[n++] = best_token;
      state = best_target;
      length += 1;
    }
    return n;
  }

  // One state's out-edges: their counted continuations (an edge whose count was cut off by the counting bound
  // counts once), the two most counted, and the count of `wanted`'s edge.
  struct EdgeScan {
    int64_t total = 0;
    int32_t best_token = -1, best_target = -1;
    int64_t best_count = 0;
    int32_t second_token = -1, second_target = -1;
    int64_t second_count = 0;
    int32_t wanted_target = -1;
    int64_t wanted_count = 0;
    bool too_wide = false;  // more than kMaxScanEdges continuations: not scanned
  };

  EdgeScan scan_edges(int32_t state, int32_t wanted, int32_t preferred = -1) const {
    EdgeScan scan;
    const State& s = states_[state];
    const auto visit = [&](int32_t token, int32_t target) {
      const int64_t count = std::max<int64_t>(1, states_[target].count);
      scan.total += count;
      if (token == wanted) {
        scan.wanted_target = target;
        scan.wanted_count = count;
      }
      const bool wins = count > scan.best_count || (count == scan.best_count && token == preferred);
      if (wins) {
        scan.second_token = scan.best_token;
        scan.second_target = scan.best_target;
        scan.second_count = scan.best_count;
        scan.best_token = token;
        scan.best_target = target;
        scan.best_count = count;
      } else if (count > scan.second_count) {
        scan.second_token = token;
        scan.second_target = target;
        scan.second_count = count;
      }
    };
    if (s.token0 != EdgeTable::kMissing) visit(s.token0, s.target0);
    int scanned = 1;
    for (int32_t e = s.head; e != EdgeTable::kMissing; e = edge_next_[e]) {
      if (++scanned > kMaxScanEdges) {
        scan.too_wide = true;
        return scan;
      }
      visit(edge_token_[e], edge_target_[e]);
    }
    return scan;
  }

  // Where a counted second path leaves the main one (target -1: nowhere).
  struct Branch {
    int32_t depth = 0;
    int32_t token = -1;
    int32_t target = -1;
    int32_t length = 0;  // the context length after the branch token
    double probability = 0.0;
    TokenEvidence evidence;
  };

  // The majority walk of counted_paths from `state` (context `length`), writing out[from ...] up to `limit`
  // with `probability` the estimate so far; records the best branch point when `branch` is given.  Returns the
  // path's end (its length).
  int32_t majority_walk(int32_t state, int32_t length, double probability, int32_t from, int32_t limit,
                        double min_probability, const int32_t* prefer, int32_t prefer_count, int32_t* out,
                        TokenEvidence* evidence, Branch* branch, int32_t* match_length) const {
    int32_t n = from;
    bool following = prefer != nullptr;  // the path so far equals prefer's prefix
    for (int hops = 0; n < limit && state > 0;) {
      const int32_t preferred = following && n < prefer_count ? prefer[n] : -1;
      const EdgeScan scan = scan_edges(state, -1, preferred);
      if (scan.too_wide) break;
      if (scan.best_target < 0) {  // the context never continued: a shorter one
        if (++hops > kMaxFallbackHops) break;
        state = states_[state].link;
        length = states_[state].len;
        continue;
      }
      const double total = static_cast<double>(scan.total);
      if (branch != nullptr && scan.second_target >= 0) {
        const double chance = probability * static_cast<double>(scan.second_count) / total;
        if (chance >= min_probability && chance > branch->probability) {
          *branch = Branch{n, scan.second_token, scan.second_target, length + 1, chance,
                           TokenEvidence{static_cast<int32_t>(scan.second_count), static_cast<int32_t>(scan.total)}};
        }
      }
      probability *= static_cast<double>(scan.best_count) / total;
      if (probability < min_probability) break;
      if (n == from) *match_length = length;
      following = following && scan.best_token == preferred;
      evidence[n] = TokenEvidence{static_cast<int32_t>(scan.best_count), static_cast<int32_t>(scan.total)};
      out[n++] = scan.best_token;
      state = scan.best_target;
      length += 1;
    }
    return n;
  }

  std::size_t length_of(int32_t sid) const {
    return sid == 0 ? prompt_.size() : length(sid);
  }

  int32_t token_at(int32_t sid, int32_t pos) const {
    const auto p = static_cast<std::size_t>(pos);
    return p < prompt_.size() ? prompt_[p] : members_[sid - 1].tokens[p - prompt_.size()];
  }

  // One automaton state.  Its first out-edge lives inline (most states have one or
  // two), further edges in the shared table and the state's edge list.
  struct State {
    int32_t len;
    int32_t link;
    Position first;   // first occurrence (end position) of the state's strings
    Position recent;  // latest occurrence recorded as a longest match
    int32_t token0 = EdgeTable::kMissing;   // inline edge: token
    int32_t target0 = EdgeTable::kMissing;  // inline edge: target
    int32_t head = EdgeTable::kMissing;     // further edges: list head
    int32_t count = 0;  // kFrequent: positions the state's strings end at (occurrences)
  };

  int32_t new_state(int32_t len, int32_t link, Position first, Position recent) {
    states_.push_back(State{len, link, first, recent});
    return static_cast<int32_t>(states_.size() - 1);
  }

  int32_t next(int32_t state, int32_t token) const {
    const State& s = states_[state];
    if (s.token0 == token) return s.target0;
    if (s.head == EdgeTable::kMissing) return -1;  // at most the inline edge
    const int32_t edge = edges_.find(state, token);
    return edge == EdgeTable::kMissing ? -1 : edge_target_[edge];
  }

  void add_edge(int32_t state, int32_t token, int32_t target) {
    State& s = states_[state];
    if (s.token0 == EdgeTable::kMissing) {
      s.token0 = token;
      s.target0 = target;
      return;
    }
    const auto edge = static_cast<int32_t>(edge_token_.size());
    edge_token_.push_back(token);
    edge_target_.push_back(target);
    edge_next_.push_back(s.head);
    s.head = edge;
    edges_.insert(state, token, edge);
  }

  void retarget(int32_t state, int32_t token, int32_t target) {
    State& s = states_[state];
    if (s.token0 == token) {
      s.target0 = target;
    } else {
      edge_target_[edges_.find(state, token)] = target;
    }
  }

  // Splits q so that a state of length len(p) + 1 exists on p's c-edge.
  int32_t clone(int32_t p, int32_t token, int32_t q) {
    const State source = states_[q];
    const int32_t c = new_state(states_[p].len + 1, source.link, source.first, source.recent);
    states_[c].count = source.count;  // the new position is counted after the split
    if (source.token0 != EdgeTable::kMissing) add_edge(c, source.token0, source.target0);
    for (int32_t e = source.head; e != EdgeTable::kMissing; e = edge_next_[e]) {
      add_edge(c, edge_token_[e], edge_target_[e]);
    }
    while (p != -1 && next(p, token) == q) {
      retarget(p, token, c);
      p = states_[p].link;
    }
    states_[q].link = c;
    return c;
  }

  // Extends the string whose whole-string state is `last` by `token` at `at`;
  // returns the new whole-string state and records the new longest match.
  int32_t extend(int32_t last, int32_t token, Position at, Match* match) {
    const int32_t existing = next(last, token);
    if (existing != -1) {
      // The extended string already occurs elsewhere (a sibling wrote it).
      const int32_t state =
          states_[existing].len == states_[last].len + 1 ? existing : clone(last, token, existing);
      record_match(state, at, match);
      count_occurrence(state);
      return state;
    }
    const int32_t cur = new_state(states_[last].len + 1, 0, at, at);
    int32_t p = last;
    while (p != -1 && next(p, token) == -1) {
      add_edge(p, token, cur);
      p = states_[p].link;
    }
    if (p != -1) {
      const int32_t q = next(p, token);
      const int32_t link = states_[q].len == states_[p].len + 1 ? q : clone(p, token, q);
      states_[cur].link = link;
    }
    record_match(states_[cur].link, at, match);
    count_occurrence(cur);
    return cur;
  }

  // The appended position is one more end position of the new whole-string state and of every
  // suffix of it: add it along the suffix-link path (kFrequent only; bounded, see kMaxCountHops).
  void count_occurrence(int32_t state) {
    for (int hop = 0; state > 0 && hop < count_hops_; ++hop) {
      states_[state].count += 1;
      state = states_[state].link;
    }
  }

  // The match of the suffix ending at `at` is `state`: choose the occurrence to
  // draft from (before `at` itself is recorded as the state's latest one).
  void record_match(int32_t state, Position at, Match* match) {
    State& s = states_[state];
    match->state = state;
    match->length = s.len;
    match->anchor = occurrence_ == Occurrence::kFirst ? s.first : s.recent;
    if (state != 0) s.recent = at;
  }

  Occurrence occurrence_;
  double min_probability_;
  int count_hops_;
  std::vector<int32_t> prompt_;
  int32_t prompt_end_ = 0;
  Match prompt_match_;
  std::vector<Member> members_;
  std::vector<State> states_;
  // Edges beyond each state's inline one: a singly linked list per state (for
  // cloning) and the lookup table.
  std::vector<int32_t> edge_token_;
  std::vector<int32_t> edge_target_;
  std::vector<int32_t> edge_next_;
  EdgeTable edges_;
};

}  // namespace samrollout
