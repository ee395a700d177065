// Open-addressing hash map from (state, token) to an edge index.
//
// The automaton's transitions live in one flat table per automaton instead of a
// map per state: the root of an automaton over a real vocabulary has tens of
// thousands of out-edges while most states have one or two, and a single
// linear-probing table serves both in O(1) expected time with no per-state
// allocation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace samrollout {

class EdgeTable {
 public:
  static constexpr int32_t kMissing = -1;

  EdgeTable() { reset(16); }

  // Returns the edge index stored for (state, token), or kMissing.
  int32_t find(int32_t state, int32_t token) const {
    const uint64_t key = pack(state, token);
    std::size_t slot = hash(key) & mask_;
    while (true) {
      const uint64_t k = keys_[slot];
      if (k == key) return values_[slot];
      if (k == kEmpty) return kMissing;
      slot = (slot + 1) & mask_;
    }
  }

  // Inserts a new key; the caller guarantees the key is absent.
  void insert(int32_t state, int32_t token, int32_t edge) {
    if ((size_ + 1) * 2 > keys_.size()) grow();
    place(pack(state, token), edge);
    ++size_;
  }

  std::size_t memory_bytes() const {
    return keys_.capacity() * sizeof(uint64_t) + values_.capacity() * sizeof(int32_t);
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};

  static uint64_t pack(int32_t state, int32_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(state)) << 32) |
           static_cast<uint32_t>(token);
  }

  static uint64_t hash(uint64_t x) {
    // splitmix64 finalizer: cheap and mixes both halves of the key.
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
  }

  void place(uint64_t key, int32_t value) {
    std::size_t slot = hash(key) & mask_;
    while (keys_[slot] != kEmpty) slot = (slot + 1) & mask_;
    keys_[slot] = key;
    values_[slot] = value;
  }

  void reset(std::size_t capacity) {
    keys_.assign(capacity, kEmpty);
    values_.assign(capacity, kMissing);
    mask_ = capacity - 1;
  }

  void grow() {
    std::vector<uint64_t> old_keys;
    std::vector<int32_t> old_values;
    old_keys.swap(keys_);
    old_values.swap(values_);
    reset(old_keys.size() * 2);
    for (std::size_t i = 0; i < old_keys.size(); ++i) {
      if (old_keys[i] != kEmpty) place(old_keys[i], old_values[i]);
    }
  }

  std::vector<uint64_t> keys_;
  std::vector<int32_t> values_;
  std::size_t mask_ = 0;
  std::size_t size_ = 0;
};

}  // namespace samrollout
