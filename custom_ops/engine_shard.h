// A shard: the blocks of the keys whose Fmix64 falls in one range (engine_partition.h),
// their index, a count of tracked keys, and the reader/writer lock that guards them all
// (and the shard's SSD-tier state, engine_tier.h). Each shard has its own index, so a
// batch runs shard-parallel with one writer per shard and no resize race.
//
// Also the walk over a batch's keys in one shard with their index slots and blocks
// prefetched ahead, a group of keys at a time (ForEachPrefetched), which the batch
// operations use.
//
// Part of the engine that embedding_engine.h composes; plain C++17 + absl.
#ifndef TF_FUSEDEMB_ENGINE_SHARD_H_
#define TF_FUSEDEMB_ENGINE_SHARD_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <shared_mutex>
#include <string>

#include "engine_blocks.h"
#include "engine_index.h"
#include "engine_partition.h"

namespace tensorflow {
namespace fusedemb {
namespace engine {

class Shard {
 public:
  static constexpr uint32_t kMetaBit = Blocks::kMetaBit;

  explicit Shard(size_t full_block_bytes) : blocks_(full_block_bytes), index_(&blocks_) {}
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  std::shared_mutex& mutex() const { return mu_; }

  BlockHeader* Header(uint32_t ref) const { return blocks_.Header(ref); }
  static bool IsStored(uint32_t ref) { return Blocks::IsStored(ref); }
  size_t BytesOf(uint32_t ref) const { return blocks_.BytesOf(ref); }

  // Cache prefetches: the index's probe group of `key`; the first `bytes` of its block.
  void PrefetchIndex(int64_t key) const { index_.Prefetch(key); }
  void PrefetchBlock(int64_t key, size_t bytes) const { index_.PrefetchBlock(key, bytes); }

  // The ref of `key`, or nullptr when it has no block.
  const uint32_t* Find(int64_t key) const { return index_.Find(key); }

  // The ref of `key`'s block, creating a meta (header-only) block for a new key.
  uint32_t* FindOrAddMeta(int64_t key) { return FindOrAdd(key, /*full=*/false, nullptr); }

  // The ref of `key`'s block, creating a full block (header reset, row and slots
  // unspecified) for a new key; *created says whether it did.
  uint32_t* FindOrAddFull(int64_t key, bool* created) { return FindOrAdd(key, true, created); }

  // Gives `*ref` a full block (row + slots, unspecified) keeping its header; returns it.
  BlockHeader* Promote(uint32_t* ref) { return blocks_.Promote(ref); }

  // Moves a full block back to a meta block (row and slots dropped).
  void Demote(uint32_t* ref) { blocks_.Demote(ref); }

  // Removes `key`'s block entirely.
  void Erase(int64_t key) {
    uint32_t ref;
    if (index_.Erase(key, &ref)) blocks_.Free(ref);
  }

  // Inserts a block read back from the SSD tier or a checkpoint (bytes of a full or a meta
  // block, header first) for a key that has none here; returns its header.
  BlockHeader* Adopt(const std::string& bytes) {
    int64_t key;
    std::memcpy(&key, bytes.data(), sizeof(key));
    char* room = AdoptRoom(key, bytes.size());
    std::memcpy(room, bytes.data(), bytes.size());
    return Adopted(room);
  }

  // Adopt in two halves, for a block copied straight into the arena (the SSD tier's
  // reads): AdoptRoom makes `key`'s block (full when `bytes` is a full block's size, meta
  // otherwise; the key has none here) and returns it to be overwritten with the block's
  // bytes, header first; Adopted then counts the header copied in and returns it.
  char* AdoptRoom(int64_t key, size_t bytes) {
    bool created;
    uint32_t* ref = bytes == blocks_.full_block_bytes() ? FindOrAddFull(key, &created)
                                                        : FindOrAddMeta(key);
    return reinterpret_cast<char*>(Header(*ref));
  }
  BlockHeader* Adopted(char* room) {
    BlockHeader* h = reinterpret_cast<BlockHeader*>(room);
    if (h->tracked()) ++tracked_;
    return h;
  }

  // Bytes of the blocks alive in DRAM and of the index: what a memory budget bounds
  // (freed blocks are reused before the arenas grow, so the resident arena bytes stay
  // within the budget plus one batch's blocks).
  int64_t live_bytes() const {
    return blocks_.live_bytes() + static_cast<int64_t>(index_.budget_bytes());
  }

  // Shrinks the index when erasures left it over 4x too large (after a spill).
  void ShrinkIndex() { index_.ShrinkIfSparse(); }

  size_t full_block_bytes() const { return blocks_.full_block_bytes(); }
  size_t ref_numbers() const { return blocks_.ref_numbers(); }
  size_t RefNumber(uint32_t ref) const { return blocks_.RefNumber(ref); }
  int64_t stored() const { return blocks_.stored(); }
  int64_t blocks() const { return blocks_.blocks(); }
  int64_t& tracked() { return tracked_; }
  int64_t tracked() const { return tracked_; }

  // Bytes this shard holds resident: the arenas' used blocks and the index's backing
  // array. Chunk tails never touched are left out: they cost address space, not memory,
  // so the figure follows the process's RSS.
  size_t bytes_held() const { return blocks_.bytes_used() + index_.bytes_held(); }

  template <typename F>
  void ForEach(F&& f) const {
    index_.ForEach(f);
  }

  // Calls f(ref, header) for every live block, in address order (Blocks).
  template <typename F>
  void ForEachLive(F&& f) const {
    blocks_.ForEachLive(f);
  }

 private:
  uint32_t* FindOrAdd(int64_t key, bool full, bool* created) {
    blocks_.Reserve(full);  // before the index changes: a throw must leave no half-made entry
    if (created != nullptr) *created = false;
    return index_.FindOrInsert(key, [&] {
      if (created != nullptr) *created = true;
      return blocks_.New(full, key);
    });
  }

  mutable std::shared_mutex mu_;
  Blocks blocks_;
  BlockIndex index_;  // after blocks_, which it reads keys from
  int64_t tracked_ = 0;
};

// What ForEachPrefetched prefetches besides the index: the first `block_bytes` of each
// key's block, and the rows of up to two batch arrays of `row_floats` floats per position
// (a shard's positions stride through them, 1/S-th apart); rows_a, rows_b may be null.
struct Ahead {
  size_t block_bytes;
  const float* rows_a = nullptr;
  const float* rows_b = nullptr;
  int64_t row_floats = 0;
};

// Runs work(i) for the batch positions i of `pos` in order, in groups of kGroup keys:
// before the work on group g, the index probes of group g + 2 and the blocks (and batch
// rows, see Ahead) of group g + 1 are prefetched. Why: in a table larger than the cache
// each key costs two dependent misses (index slot, then block); issued a group ahead, in
// tight loops of independent prefetches, they overlap each other and the work (measured
// at 1.3x the update and 1.6x the lookups of prefetching one key at a time, 16 and 8
// keys ahead). A block prefetch walks the probe sequence, whose index lines the previous
// group's prefetch brought in. The prefetches only read, between the work's own
// (possibly inserting) calls on the same thread.
template <typename F>
void ForEachPrefetched(const Shard& sh, Span pos, const int64_t* keys, const Ahead& ahead,
                       F&& work) {
  constexpr int64_t kGroup = 16;
  const int64_t n = pos.size;
  const size_t row_bytes = sizeof(float) * ahead.row_floats;
  auto prefetch_index = [&](int64_t begin) {
    for (int64_t k = begin, end = std::min(n, begin + kGroup); k < end; ++k) {
      sh.PrefetchIndex(keys[pos.data[k]]);
    }
  };
  auto prefetch_blocks = [&](int64_t begin) {
    for (int64_t k = begin, end = std::min(n, begin + kGroup); k < end; ++k) {
      const int64_t i = pos.data[k];
      sh.PrefetchBlock(keys[i], ahead.block_bytes);
      if (ahead.rows_a != nullptr) PrefetchBytes(ahead.rows_a + i * ahead.row_floats, row_bytes);
      if (ahead.rows_b != nullptr) PrefetchBytes(ahead.rows_b + i * ahead.row_floats, row_bytes);
    }
  };
  prefetch_index(0);
  prefetch_index(kGroup);
  prefetch_blocks(0);
  for (int64_t g = 0; g < n; g += kGroup) {
    prefetch_index(g + 2 * kGroup);
    prefetch_blocks(g + kGroup);
    for (int64_t k = g, end = std::min(n, g + kGroup); k < end; ++k) work(pos.data[k]);
  }
}

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_ENGINE_SHARD_H_
