// SlotTable: the SSD tier's DRAM index of cold keys, key (int64) -> slot (uint32) in an
// open-addressed table with linear probing. 12 bytes per entry (keys and slots in two
// arrays, no padding) and a load kept between 0.68 and 0.85 (it grows by a quarter when
// 85% full), so a cold key costs 14 to 18 bytes of DRAM (IndexBytes reports it). A
// general hash map of 16-byte entries at absl's load (0.44 to 0.875) would cost up to 39.
// Why that load: the index of a table that lives on disk is most of its DRAM (45 M cold
// keys of a 50 M-row table at a 10% budget), and at 0.53-0.8 (up to 23 bytes a key) a
// 10% budget of 50 M rows did not fit 2 GiB. Linear probing's cost at 0.85 is a miss's
// probe of about 23 adjacent entries, a few cache lines.
//
// Not thread-safe: SlotFileBlockStore guards each of its tables with a lock.
// Plain C++17.
#ifndef TF_FUSEDEMB_SLOT_TABLE_H_
#define TF_FUSEDEMB_SLOT_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "engine_blocks.h"
#include "engine_config.h"

namespace tensorflow {
namespace fusedemb {
namespace engine {

class SlotTable {
 public:
  static constexpr uint32_t kNone = UINT32_MAX;  // no slot (an empty entry)

  // key's slot, or kNone.
  uint32_t Find(int64_t key) const {
    if (size_ == 0) return kNone;
    for (size_t i = Home(key);; i = Next(i)) {
      if (slots_[i] == kNone) return kNone;
      if (keys_[i] == key) return slots_[i];
    }
  }

  // Prefetches the cache lines Find(key) reads first (its home entry), so a batch of
  // lookups can overlap their misses.
  void Prefetch(int64_t key) const {
    if (size_ == 0) return;
    const size_t i = Home(key);
    PrefetchLine(reinterpret_cast<uintptr_t>(&slots_[i]));
    PrefetchLine(reinterpret_cast<uintptr_t>(&keys_[i]));
  }

  // Sets key's slot (key must not be in the table).
  void Insert(int64_t key, uint32_t slot) {
    if (20 * (size_ + 1) > 17 * capacity()) Grow();
    size_t i = Home(key);
    while (slots_[i] != kNone) i = Next(i);
    keys_[i] = key;
    slots_[i] = slot;
    ++size_;
  }

  // Sets key's slot, in the table or not; its slot before, or kNone when it had none.
  uint32_t Set(int64_t key, uint32_t slot) {
    if (size_ != 0) {
      for (size_t i = Home(key); slots_[i] != kNone; i = Next(i)) {
        if (keys_[i] == key) return std::exchange(slots_[i], slot);
      }
    }
    Insert(key, slot);
    return kNone;
  }

  // Removes key; its slot, or kNone when it had none. Backward-shift deletion: the entries
  // after it move up into the gap where their probe allows, so no tombstones accumulate.
  uint32_t Erase(int64_t key) {
    if (size_ == 0) return kNone;
    size_t i = Home(key);
    while (slots_[i] != kNone && keys_[i] != key) i = Next(i);
    const uint32_t slot = slots_[i];
    if (slot == kNone) return kNone;
    for (size_t j = Next(i);; j = Next(j)) {
      if (slots_[j] == kNone) break;
      const size_t h = Home(keys_[j]);
      const bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);  // h in (i, j]
      if (stays) continue;
      keys_[i] = keys_[j];
      slots_[i] = slots_[j];
      i = j;
    }
    slots_[i] = kNone;
    --size_;
    return slot;
  }

  // Calls f(key, slot) for every entry.
  template <typename F>
  void ForEach(F&& f) const {
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (slots_[i] != kNone) f(keys_[i], slots_[i]);
    }
  }

  size_t size() const { return size_; }
  size_t capacity() const { return slots_.size(); }
  size_t bytes() const { return capacity() * (sizeof(int64_t) + sizeof(uint32_t)); }

 private:
  // The home entry: the hash's high bits scaled to the capacity (any capacity, not only
  // powers of two, so the table can grow by a quarter).
  size_t Home(int64_t key) const {
    const uint64_t h = Fmix64(static_cast<uint64_t>(key) ^ kSalt);
    return static_cast<size_t>((static_cast<unsigned __int128>(h) * slots_.size()) >> 64);
  }
  size_t Next(size_t i) const { return i + 1 == slots_.size() ? 0 : i + 1; }

  void Grow() {
    std::vector<int64_t> keys;
    std::vector<uint32_t> slots;
    keys.swap(keys_);
    slots.swap(slots_);
    const size_t capacity = std::max<size_t>(16, slots.size() + slots.size() / 4);
    keys_.assign(capacity, 0);
    slots_.assign(capacity, kNone);
    size_ = 0;
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i] != kNone) Insert(keys[i], slots[i]);
    }
  }

  // Decorrelates the table's hash from the engine's sharding (the top bits of Fmix64(key)),
  // so a shard's keys spread over the whole table.
  static constexpr uint64_t kSalt = 0x9e3779b97f4a7c15ULL;

  std::vector<int64_t> keys_;
  std::vector<uint32_t> slots_;
  size_t size_ = 0;
};

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_SLOT_TABLE_H_
