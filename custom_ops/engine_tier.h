// The SSD tier and spilling: with a store attached (Engine::AttachStore, a table's memory
// budget), at most budget_bytes of blocks and index stay in DRAM (budget / num_shards per
// shard); the others are in a BlockStore (block_store.h; a file of block slots in
// slot_file_block_store.cc), whole. Every batch operation runs between Pin (the blocks of
// its keys read back into DRAM, one MultiGet per shard) and Unpin (the least counted
// unpinned blocks spilled while the shard is over its share, one Write), so the
// operations only ever see DRAM blocks and a budget cannot change a result.
//
// A block read back leaves its copy in the store (a delete per read would double the
// store's writes): while the block is in DRAM that copy is stale and the DRAM block is the
// one that counts. A spill replaces it, an erasure in DRAM (EraseBlock) deletes it with
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
#include <atomic>
#include <cstdint>
#include <limits>
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
  // A key's pins: how many are held, the shard's Pin call that last pinned it, and
  // whether its block is known to be in DRAM: set when a Pin finds it there or reads it
  // back, cleared when it leaves (EraseBlock; a spill erases the whole entry), so a key
  // pinned again needs no index lookup (a step pins its keys in three calls).
  struct PinState {
    int32_t count;
    uint32_t last_pin;
    bool resident;
  };

  // Keys just pinned, with their entries in the pins map.
  struct Pinned {
    std::vector<int64_t> keys;
    std::vector<PinState*> pins;
    void Clear() {
      keys.clear();
      pins.clear();
    }
  };

  // The tier's state of one shard: the keys pinned in DRAM or pinned by one of the last
  // few Pin calls (see kRecentPins), and what the store holds of this shard's keys.
  struct ShardState {
    absl::flat_hash_map<int64_t, PinState> pins;
    uint32_t pin_calls = 0;
    size_t pins_after_prune = 0;
    int64_t blocks = 0, stored = 0, tracked = 0, bytes = 0;
    // The highest access count among the last spill's victims (see Victims).
    uint64_t victim_count = 0;
    // Keys whose DRAM block was erased since the last Unpin (see EraseBlock): their store
    // entries, stale copies where there are any, are deleted with Unpin's batch.
    std::vector<int64_t> erased;
    // A Pin call's keys pinned anew and those of them without a DRAM block: kept between
    // calls so their memory is reused (a call's own vectors were a few mallocs per call).
    Pinned fresh, missing;
    // Cumulative I/O: blocks and bytes read back, blocks and bytes spilled (benchmarks).
    int64_t io[4] = {0, 0, 0, 0};
    void Add(const BlockHeader& h, size_t bytes_of_block, bool stored_row, int sign) {
      blocks += sign;
      bytes += sign * static_cast<int64_t>(bytes_of_block);
      if (stored_row) stored += sign;
      if (h.tracked()) tracked += sign;
    }
  };

  // Call before any other use of the engine; `name` (the engine's) and `tables` (the
  // names of its tables, if known) are named in errors; `block_bytes`: a block with a row.
  void Attach(std::unique_ptr<BlockStore> store, int64_t budget_bytes, int num_shards,
              size_t block_bytes, const std::string& name, const std::string& tables = "") {
    store_ = std::move(store);
    budget_ = std::max<int64_t>(0, budget_bytes);
    shard_budget_ = budget_ / num_shards;
    shards_ = std::vector<ShardState>(num_shards);
    block_bytes_ = static_cast<int64_t>(block_bytes);
    name_ = "'" + name + "'" + (tables.empty() ? "" : " (tables " + tables + ")");
  }
  bool attached() const { return store_ != nullptr; }
  BlockStore* store() const { return store_.get(); }
  // Shard s's state; null without a store.
  const ShardState* state(int s) const { return attached() ? &shards_[s] : nullptr; }

  // Brings the blocks of the keys at `pos` into DRAM and pins them there (a count per key:
  // a prefetch and the step's own operation may pin the same key). Keys in neither tier
  // stay absent. On an error the pins are still taken: Unpin releases them. A key
  // pinned counts in CheckPinned until its last pin is released; *anew (if given): how
  // many keys had no pin before.
  std::string Pin(int s, Shard& sh, Span pos, const int64_t* keys, int64_t* anew = nullptr) {
    ShardState& t = shards_[s];
    const int64_t pinned = PinKeys(t, pos, keys);
    pinned_keys_.fetch_add(pinned, std::memory_order_relaxed);
    if (anew != nullptr) *anew = pinned;
    FindBlocks(sh, t.fresh, &t.missing);
    return ReadBack(t, sh, t.missing);
  }

  // The error of a budget smaller than the blocks of the keys pinned at once in all
  // shards, with `extra_keys` more (a call's keys, pinned shard by shard); empty if they
  // fit or with a budget of 0. What counts: a training step's batch and, with the
  // pipelined fit, the batches a prefetch keeps pinned; each key a block with a row,
  // stored or not (the step's update gives each one). Why an error: pinned blocks
  // cannot be spilled, so each shard over its share of the budget spills every unpinned
  // block at each call's end, and a step reads its blocks back at each of its calls (more
  // reads than keys: no hit). Other calls, such as an eviction's scan of every key, may
  // pin any number of blocks for their length. A budget of 0 keeps no block in DRAM
  // between calls, on purpose: the tier's exactness tests move every block at every call.
  std::string CheckPinned(int64_t extra_keys = 0) const {
    const int64_t pinned =
        (pinned_keys_.load(std::memory_order_relaxed) + extra_keys) * block_bytes_;
    if (budget_ == 0 || pinned <= budget_) return "";
    return "SSD tier of embedding engine " + name_ + ": a memory budget of " +
           std::to_string(budget_) + " bytes is smaller than the " + std::to_string(pinned) +
           " bytes of the blocks pinned at once (a batch's, with the pipelined fit the next "
           "batch's too); raise memory_budget_bytes above that, or lower the batch size";
  }
  // Releases Pin's pins of the keys at `pos`, then spills while the shard is over budget
  // (and deletes the store entries of blocks erased meanwhile, in the same batch).
  std::string Unpin(int s, Shard& sh, Span pos, const int64_t* keys) {
    ShardState& t = shards_[s];
    int64_t released = 0;  // keys whose last pin this call releases
    for (int64_t k = 0; k < pos.size; ++k) {
      if (k + kAhead < pos.size) t.pins.prefetch(keys[pos.data[k + kAhead]]);
      auto it = t.pins.find(keys[pos.data[k]]);
      if (it != t.pins.end() && it->second.count > 0) released += --it->second.count == 0;
    }
    pinned_keys_.fetch_sub(released, std::memory_order_relaxed);
    PrunePins(&t);
    return Spill(t, sh);
  }

  // Erases key's block in DRAM other than by a spill; with a store, Unpin deletes the
  // store's entry too (a stale copy of a block read back, see Pin), so the key does not
  // come back from it.
  void EraseBlock(int s, Shard& sh, int64_t key) {
    sh.Erase(key);
    if (!attached()) return;
    ShardState& t = shards_[s];
    t.erased.push_back(key);
    auto it = t.pins.find(key);
    if (it != t.pins.end()) it->second.resident = false;
  }

 private:
  // Keys or blocks prefetched ahead of their use (each is a cache miss otherwise).
  static constexpr int64_t kAhead = 8;

  // Takes a pin on each key at `pos`; sets t.fresh to the keys pinned anew whose block
  // Find must look for (those not known to be in DRAM) and returns how many keys it
  // pinned anew. The map is reserved first, so no insertion moves the entries kept.
  static int64_t PinKeys(ShardState& t, Span pos, const int64_t* keys) {
    const uint32_t call = ++t.pin_calls;
    t.pins.reserve(t.pins.size() + pos.size);
    Pinned& fresh = t.fresh;
    fresh.Clear();
    int64_t pinned = 0;
    for (int64_t k = 0; k < pos.size; ++k) {
      if (k + kAhead < pos.size) t.pins.prefetch(keys[pos.data[k + kAhead]]);
      const int64_t key = keys[pos.data[k]];
      PinState& pin = t.pins.try_emplace(key, PinState{0, call, false}).first->second;
      pin.last_pin = call;
      if (++pin.count != 1) continue;
      ++pinned;
      if (pin.resident) continue;
      fresh.keys.push_back(key);
      fresh.pins.push_back(&pin);
    }
    return pinned;
  }

  // Looks up the blocks of `fresh` in DRAM (the index probes and the keys in the blocks
  // they compare prefetched ahead), marking them resident; sets *missing to the keys
  // without one.
  static void FindBlocks(const Shard& sh, const Pinned& fresh, Pinned* missing) {
    missing->Clear();
    const int64_t n = static_cast<int64_t>(fresh.keys.size());
    for (int64_t j = 0; j < n; ++j) {
      if (j + 2 * kAhead < n) sh.PrefetchIndex(fresh.keys[j + 2 * kAhead]);
      if (j + kAhead < n) sh.PrefetchBlock(fresh.keys[j + kAhead], sizeof(int64_t));
      if (sh.Find(fresh.keys[j]) != nullptr) {
        fresh.pins[j]->resident = true;
      } else {
        missing->keys.push_back(fresh.keys[j]);
        missing->pins.push_back(fresh.pins[j]);
      }
    }
  }

  // Reads the blocks of `missing` (keys without a DRAM block) from the store into DRAM.
  std::string ReadBack(ShardState& t, Shard& sh, const Pinned& missing) {
    if (missing.keys.empty() || t.blocks == 0) return "";
    // Each block is read straight into its arena block (no buffer per block), then counted
    // once the store has filled it (on an error too: every block placed is filled).
    std::vector<std::pair<char*, size_t>> placed;
    placed.reserve(missing.keys.size());
    const int64_t* keys = missing.keys.data();
    const std::string error =
        store_->MultiGet(keys, missing.keys.size(), [&](size_t i, size_t size) {
          placed.emplace_back(sh.AdoptRoom(keys[i], size), size);
          missing.pins[i]->resident = true;
          return placed.back().first;
        });
    // The store keeps its copy of each block read back: deleting it would cost a write per
    // read (half the store's writes). The copy is stale while the block is in DRAM, which
    // is authoritative: a spill replaces the copy, an erasure deletes it (EraseBlock),
    // Export skips it and a checkpoint writes the DRAM blocks over it.
    for (size_t k = 0; k < placed.size(); ++k) {
      const BlockHeader* h = sh.Adopted(placed[k].first);
      t.Add(*h, placed[k].second, placed[k].second == sh.full_block_bytes(), -1);
      t.io[0] += 1;
      t.io[1] += static_cast<int64_t>(placed[k].second);
    }
    return error;
  }

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

  // A candidate victim's place in the spill order, least first: blocks not pinned by the
  // last kRecentPins calls before the others, then by access count, then by last step.
  // Counts past 2^31 - 1 compare as equal (a tie broken by the last step): the order
  // decides only which blocks stay in DRAM, never a result.
  static uint64_t Score(bool recent, uint64_t count, int32_t last_step) {
    const uint64_t capped = std::min<uint64_t>(count, (uint64_t{1} << 31) - 1);
    const uint32_t step = static_cast<uint32_t>(last_step) ^ 0x80000000u;  // signed order
    return (uint64_t{recent} << 63) | (capped << 32) | step;
  }

  // The order as one integer (see Score), so nth_element compares 16-byte pairs with one
  // instruction instead of three fields with branches.
  struct Candidate {
    uint64_t score;
    uint32_t ref;
    bool operator<(const Candidate& o) const { return score < o.score; }
  };

  // The blocks to spill to bring `sh` to `target` bytes (see Spill for the order; the
  // victims come out in no particular order, since they are spilled together).
  //
  // Why no sort of the shard: a spill takes a tenth of the shard's blocks, so a sort cost
  // each victim ten elements' log n comparisons, and a probe of the pins map per block
  // scanned. The pinned and recent blocks are marked instead, from the pins map (a few
  // calls' keys) into an array indexed by block, the headers are read in address order;
  // then rounds of nth_element take the least ordered candidates (TakeLeast).
  //
  // Why two sets of candidates: the victims are a tenth of them, and the highest count
  // among them changes little from one spill to the next. The candidates counted at most
  // one more than the last spill's highest (ShardState::victim_count), about half of them,
  // are selected from first, and the others, which all come after them in the order, only
  // if those do not free enough: the same victims as one set, for a selection over half
  // the candidates (nth_element over all of them was a third of the choice's CPU).
  static std::vector<BlockRef> Victims(ShardState& t, const Shard& sh, int64_t target) {
    const std::vector<uint8_t> marks = Marks(t, sh);
    const uint64_t bound = Score(false, t.victim_count + 1, std::numeric_limits<int32_t>::max());
    // The live headers in address order (the index's own order would cost a cache miss
    // per header). Freed blocks are left out by their mark, not by an index probe of each
    // victim: they are the blocks just spilled, whose stale scores are the lowest, so they
    // took half of each round's places (three rounds a spill instead of one).
    // Each candidate is written field by field into room for all of them: a Candidate
    // built in registers and pushed was stored in two halves and reloaded whole, a failed
    // store forwarding that stalled every header of the scan.
    const size_t most = sh.ref_numbers();
    std::unique_ptr<Candidate[]> room(new Candidate[most]);  // the first ones from the front,
    Candidate* first_end = room.get();                        // the later ones from the back
    Candidate* later_begin = room.get() + most;
    sh.ForEachLive([&](uint32_t ref, const BlockHeader* h) {
      const uint8_t mark = marks[sh.RefNumber(ref)];
      if (mark == kPinned) return;  // pinned: stays
      const uint64_t score = Score(mark == kRecent, h->count(), h->last_step);
      Candidate* c = score <= bound ? first_end++ : --later_begin;
      c->score = score;
      c->ref = ref;
    });
    std::vector<BlockRef> victims;
    int64_t excess = sh.live_bytes() - target;
    t.victim_count = 0;
    TakeLeast(sh, room.get(), first_end, &excess, &victims, &t.victim_count);
    TakeLeast(sh, later_begin, room.get() + most, &excess, &victims, &t.victim_count);
    return victims;
  }

  enum Mark : uint8_t { kCandidate = 0, kRecent = 1, kPinned = 2 };

  // A mark per block of `sh` (by RefNumber): pinned, pinned by one of the last
  // kRecentPins calls, or neither, from the pins map.
  static std::vector<uint8_t> Marks(const ShardState& t, const Shard& sh) {
    std::vector<uint8_t> marks(sh.ref_numbers(), kCandidate);
    const uint32_t now = t.pin_calls;
    for (const auto& [key, pin] : t.pins) {
      if (pin.count == 0 && now - pin.last_pin >= kRecentPins) continue;
      if (const uint32_t* ref = sh.Find(key)) {
        marks[sh.RefNumber(*ref)] = pin.count > 0 ? kPinned : kRecent;
      }
    }
    return marks;
  }

  // Appends the least of [rest, end) (reordered) to *victims while *excess bytes remain
  // to free, subtracting their bytes and raising *most_count to their highest count. Each
  // round of nth_element takes as many as the bytes still to free need if all were full
  // blocks, all of which a sorted order would have taken too (the same victims as a sort,
  // up to ties), and the rest go to the next round.
  static void TakeLeast(const Shard& sh, Candidate* rest, Candidate* end, int64_t* excess,
                        std::vector<BlockRef>* victims, uint64_t* most_count) {
    const int64_t largest = static_cast<int64_t>(sh.full_block_bytes());
    while (*excess > 0 && rest != end) {
      const auto take = std::min<int64_t>(end - rest, (*excess + largest - 1) / largest);
      std::nth_element(rest, rest + (take - 1), end);
      for (auto c = rest; c != rest + take; ++c) {
        const BlockHeader* h = sh.Header(c->ref);
        const size_t size = sh.BytesOf(c->ref);
        victims->push_back({h->key, reinterpret_cast<const char*>(h), size});
        *excess -= static_cast<int64_t>(size);
        *most_count = std::max(*most_count, h->count());
      }
      rest += take;
    }
  }

  std::unique_ptr<BlockStore> store_;  // null: every block in DRAM
  int64_t budget_ = 0, shard_budget_ = 0;  // DRAM bytes with a store, in all and per shard
  int64_t block_bytes_ = 0;                // a block with a row
  // Keys with a pin, all shards: a sum that each shard adds to and takes from under its
  // own lock (CheckPinned).
  std::atomic<int64_t> pinned_keys_{0};
  std::string name_;  // the engine's, quoted, and its tables: for errors
  std::vector<ShardState> shards_;     // with a store: one per shard, under its lock
};

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_ENGINE_TIER_H_
