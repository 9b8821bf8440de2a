// Change tracking for incremental checkpoints: per shard, the set of keys whose block
// (row, slots or statistics) changed or was removed since the last checkpoint written
// with tracking on. A delta checkpoint writes the current block of each such key, or a
// deletion when the key has no block any more.
//
// Why a per-shard set, not a bit in the block header: the header stays 28 bytes (its
// fields use every bit: engine_blocks.h), a removed key has no header left to carry a
// bit, a delta finds its keys without scanning every block of both tiers (a bit would
// cost a pass over the whole table, SSD tier included, at every save), and blocks moving
// between the tiers (which must not count as changes) never touch it. It costs nothing
// while tracking is off (the default), and about 16 bytes per changed key while on,
// until the next checkpoint empties it.
//
// A ChangeSet is guarded by its shard's lock: Mark runs under the writer lock of the
// operation that changed the keys.
//
// Part of the engine that embedding_engine.h composes; plain C++17 + absl.
#ifndef TF_FUSEDEMB_ENGINE_CHANGES_H_
#define TF_FUSEDEMB_ENGINE_CHANGES_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "engine_partition.h"

namespace tensorflow {
namespace fusedemb {
namespace engine {

class ChangeSet {
 public:
  bool tracking() const { return tracking_; }

  // Records that the blocks of keys[pos] changed (or were removed); nothing while not
  // tracking. Over-marking is harmless: a marked key's block is written as it is.
  void Mark(Span pos, const int64_t* keys) {
    if (!tracking_) return;
    for (int64_t k = 0; k < pos.size; ++k) keys_.insert(keys[pos.data[k]]);
  }
  void Mark(int64_t key) {
    if (tracking_) keys_.insert(key);
  }

  // Starts tracking afresh (a checkpoint of every block was just written) or stops it.
  void Restart(bool tracking) {
    tracking_ = tracking;
    absl::flat_hash_set<int64_t>().swap(keys_);  // hands the memory back
  }

  // The keys marked, sorted (a delta is written in key order).
  std::vector<int64_t> Sorted() const {
    std::vector<int64_t> out(keys_.begin(), keys_.end());
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  bool tracking_ = false;
  absl::flat_hash_set<int64_t> keys_;
};

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_ENGINE_CHANGES_H_
