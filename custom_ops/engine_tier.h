// The SSD tier and spilling: with a store attached (Engine::AttachStore, a table's memory
// budget), at most budget_bytes of blocks and index stay in DRAM (budget / num_shards per
// shard); the others are in a BlockStore (block_store.h; a file of block slots in
// slot_file_block_store.cc), whole. Every batch operation runs between Pin (the blocks of
// its keys read back into DRAM, one MultiGet per shard) and Unpin (the least counted
// unpinned blocks spilled while the shard is over its share, one WriteBatch), so the
// operations only ever see DRAM blocks and a budget cannot change a result.
//
// A block read back leaves its copy in the store (a delete per read would double the
// store's writes): while the block is in DRAM that copy is stale and the DRAM block is the
// one that counts. A spill overwrites it, an erasure in DRAM (EraseBlock) deletes it with
// the next spill batch, and Export skips a stored key that DRAM holds.
//
// Owns the store and, per shard, the pins, the counts of what the store holds and the
// keys erased since the last spill; each shard's state is guarded by that shard's lock,
// which the caller holds.
//
// Part of the engine that embedding_engine.h composes; plain C++17 + absl.
#ifndef TF_FUSEDEMB_ENGINE_TIER_H_
#define TF_FUSEDEMB_ENGINE_TIER_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "block_store.h"
#include "engine_blocks.h"
#include "engine_shard.h"

namespace tensorflow {
namespace fusedemb {
namespace engine {

class Tier {
 public:
  // A key's pins: how many are held, and the shard's Pin call that last pinned it.
  struct PinState {
    int32_t count;
    uint32_t last_pin;
  };

  // The tier's state of one shard: the keys pinned in DRAM or pinned by one of the last
  // few Pin calls (see kRecentPins), and what the store holds of this shard's keys.
  struct ShardState {
    absl::flat_hash_map<int64_t, PinState> pins;
    uint32_t pin_calls = 0;
    size_t pins_after_prune = 0;
    int64_t blocks = 0, stored = 0, tracked = 0, bytes = 0;
    // Keys whose DRAM block was erased since the last Unpin (see EraseBlock): their store
    // entries, stale copies where there are any, are deleted with Unpin's batch.
    std::vector<int64_t> erased;
    // Cumulative I/O: blocks and bytes read back, blocks and bytes spilled (benchmarks).
    int64_t io[4] = {0, 0, 0, 0};
    void Add(const BlockHeader& h, size_t bytes_of_block, bool stored_row, int sign) {
      blocks += sign;
      bytes += sign * static_cast<int64_t>(bytes_of_block);
      if (stored_row) stored += sign;
      if (h.tracked()) tracked += sign;
    }
  };

  // Call before any other use of the engine.
  void Attach(std::unique_ptr<BlockStore> store, int64_t budget_bytes, int num_shards) {
    store_ = std::move(store);
    shard_budget_ = std::max<int64_t>(0, budget_bytes / num_shards);
    shards_ = std::vector<ShardState>(num_shards);
  }
  bool attached() const { return store_ != nullptr; }
  BlockStore* store() const { return store_.get(); }
  // Shard s's state; null without a store.
  const ShardState* state(int s) const { return attached() ? &shards_[s] : nullptr; }

  // Brings the blocks of the keys at `pos` into DRAM and pins them there (a count per key:
  // a prefetch and the step's own operation may pin the same key). Keys in neither tier
  // stay absent. On an error the pins are still taken: Unpin releases them.
  std::string Pin(int s, Shard& sh, Span pos, const int64_t* keys) {
    ShardState& t = shards_[s];
    std::vector<int64_t> missing;
    const uint32_t call = ++t.pin_calls;
    for (int64_t k = 0; k < pos.size; ++k) {
      const int64_t key = keys[pos.data[k]];
      PinState& pin = t.pins.try_emplace(key, PinState{0, call}).first->second;
      pin.last_pin = call;
      if (++pin.count == 1 && sh.Find(key) == nullptr) missing.push_back(key);
    }
    if (missing.empty() || t.blocks == 0) return "";
    std::vector<std::string> blocks;
    std::string error = store_->MultiGet(missing.data(), missing.size(), &blocks);
    if (!error.empty()) return error;
    // The store keeps its copy of each block read back: deleting it would cost a write per
    // read (half the store's writes). The copy is stale while the block is in DRAM, which
    // is authoritative: a spill overwrites the copy, an erasure deletes it (EraseBlock),
    // Export skips it and a checkpoint writes the DRAM blocks over it.
    for (size_t i = 0; i < missing.size(); ++i) {
      if (blocks[i].empty()) continue;
      const BlockHeader* h = sh.Adopt(blocks[i]);
      t.Add(*h, blocks[i].size(), blocks[i].size() == sh.full_block_bytes(), -1);
      t.io[0] += 1;
      t.io[1] += static_cast<int64_t>(blocks[i].size());
    }
    return "";
  }

  // Releases Pin's pins of the keys at `pos`, then spills while the shard is over budget
  // (and deletes the store entries of blocks erased meanwhile, in the same batch).
  std::string Unpin(int s, Shard& sh, Span pos, const int64_t* keys) {
    ShardState& t = shards_[s];
    for (int64_t k = 0; k < pos.size; ++k) {
      auto it = t.pins.find(keys[pos.data[k]]);
      if (it != t.pins.end() && it->second.count > 0) --it->second.count;
    }
    PrunePins(&t);
    return Spill(t, sh);
  }

  // Erases key's block in DRAM other than by a spill; with a store, Unpin deletes the
  // store's entry too (a stale copy of a block read back, see Pin), so the key does not
  // come back from it.
  void EraseBlock(int s, Shard& sh, int64_t key) {
    sh.Erase(key);
    if (attached()) shards_[s].erased.push_back(key);
  }

 private:
  // Pin calls per shard during which a key stays a late victim after its pins are
  // released: a training step pins its keys in several calls (lookup, statistics, update),
  // and the header's last step only advances at the statistics, so without this the
  // lookup's blocks would be spilled before the update reads them again.
  static constexpr uint32_t kRecentPins = 4;

  // Forgets unpinned keys pinned longer than kRecentPins calls ago, once the map has
  // doubled since the last time (so its size stays within a few batches' keys, at an
  // amortized constant cost per pin).
  static void PrunePins(ShardState* t) {
    if (t->pins.size() <= 2 * t->pins_after_prune + 256) return;
    const uint32_t now = t->pin_calls;
    absl::erase_if(t->pins, [&](const auto& p) {
      return p.second.count == 0 && now - p.second.last_pin >= kRecentPins;
    });
    t->pins_after_prune = t->pins.size();
  }

  // Spills unpinned blocks of `sh` (locked) to the store while it holds more than its
  // budget, down to 90% of it, so one scan of the shard pays for a tenth of the budget's
  // blocks instead of one. Victims: blocks not pinned by the last kRecentPins calls first;
  // then the least counted (the header's access count, which the statistics advance on
  // every access), then the least recently seen (the header's last step): as FBGEMM's
  // DRAM cache and HierarchicalKV evict by score, DRAM keeps the keys accessed most,
  // which on skewed (Zipf) keys hit more often than the most recent ones. A block read
  // back with a low count is the first victim again: admission by count.
  std::string Spill(ShardState& t, Shard& sh) {
    const bool over = sh.live_bytes() > shard_budget_;
    if (!over && t.erased.empty()) return "";
    std::vector<BlockRef> victims;
    if (over) victims = Victims(t, sh, shard_budget_ - shard_budget_ / 10);
    std::string error = store_->Write(victims, t.erased);
    if (!error.empty()) return error;  // nothing erased: every block still in DRAM
    t.erased.clear();
    for (const BlockRef& v : victims) {
      t.pins.erase(v.key);
      const BlockHeader* h = reinterpret_cast<const BlockHeader*>(v.data);
      t.Add(*h, v.size, v.size == sh.full_block_bytes(), +1);
      t.io[2] += 1;
      t.io[3] += static_cast<int64_t>(v.size);
      if (h->tracked()) --sh.tracked();
      sh.Erase(v.key);
    }
    sh.ShrinkIndex();
    return "";
  }

  // The blocks to spill to bring `sh` to `target` bytes, in victim order (see Spill).
  static std::vector<BlockRef> Victims(const ShardState& t, const Shard& sh, int64_t target) {
    struct Candidate {
      bool recent;
      int32_t last_step;
      uint64_t count;
      uint32_t ref;
      bool operator<(const Candidate& o) const {
        if (recent != o.recent) return !recent;
        return count != o.count ? count < o.count : last_step < o.last_step;
      }
    };
    std::vector<Candidate> candidates;
    const uint32_t now = t.pin_calls;
    sh.ForEach([&](uint32_t ref) {
      const BlockHeader* h = sh.Header(ref);
      auto it = t.pins.find(h->key);
      if (it != t.pins.end() && it->second.count > 0) return;  // pinned: stays
      const bool recent = it != t.pins.end() && now - it->second.last_pin < kRecentPins;
      candidates.push_back({recent, h->last_step, h->count(), ref});
    });
    std::sort(candidates.begin(), candidates.end());
    std::vector<BlockRef> victims;
    int64_t bytes = sh.live_bytes();
    for (const Candidate& c : candidates) {
      if (bytes <= target) break;
      const size_t size = sh.BytesOf(c.ref);
      const BlockHeader* h = sh.Header(c.ref);
      victims.push_back({h->key, reinterpret_cast<const char*>(h), size});
      bytes -= static_cast<int64_t>(size);
    }
    return victims;
  }

  std::unique_ptr<BlockStore> store_;  // null: every block in DRAM
  int64_t shard_budget_ = 0;           // DRAM bytes per shard with a store
  std::vector<ShardState> shards_;     // with a store: one per shard, under its lock
};

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_ENGINE_TIER_H_
