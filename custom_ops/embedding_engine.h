// The embedding storage engine of tf_fusedemb: per fused group and rank, ONE block per
// key holding its identity and access statistics, its row and its optimizer slots.
//
// Plain C++17 + absl (the copy TensorFlow ships and exports from
// libtensorflow_framework.so.2), no TensorFlow kernel headers, so it is unit- and
// stress-tested standalone (tests/engine_stress_test.cc) and under the sanitizers.
//
// Why this layout: one probe and one cache-line run per key, at a few bytes over the
// payload. The engine is a composition of one header per concept; read them in this order:
//   engine_config.h       Config, its parsing and validation; Fmix64, the one hash.
//   engine_initializer.h  initial rows, bit-equal to tf_fusedemb.storage.initializers.
//   engine_optimizer.h    one optimizer step on a row and its slots (optimizers.py's math).
//   engine_blocks.h       blocks (28-byte header, then row and slots) in chunked arenas,
//                         named by 32-bit refs; header-only blocks for tracked keys.
//   engine_index.h        the index from key to ref: a flat hash set of 4-byte refs.
//   engine_partition.h    a key's shard; a batch's keys grouped by shard.
//   engine_shard.h        a shard: blocks + index + lock; the prefetched walk of a batch.
//   engine_rows.h         the row format (float32 / bfloat16) and the row operations:
//                         lookup, the optimizer update, gather, write, remove.
//   engine_statistics.h   record, find and forget a key's statistics.
//   engine_tier.h         the SSD tier under the blocks: pin, unpin, spill.
//   engine_changes.h      the keys changed since the last checkpoint (delta checkpoints).
// This file's Engine holds them together: it owns the shards, takes each shard's lock
// (readers shared, writers exclusive) and hands the locked shard to the operation.
//
// The math mirrors tf_fusedemb.storage: initial rows are bit-equal to
// initializers.init_rows (float64 math, one cast), the optimizers equal optimizers.py's
// TF formulas operation for operation in float32.
#ifndef TF_FUSEDEMB_EMBEDDING_ENGINE_H_
#define TF_FUSEDEMB_EMBEDDING_ENGINE_H_

#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "block_store.h"
#include "engine_blocks.h"
#include "engine_changes.h"
#include "engine_config.h"
#include "engine_initializer.h"
#include "engine_optimizer.h"
#include "engine_partition.h"
#include "engine_rows.h"
#include "engine_shard.h"
#include "engine_statistics.h"
#include "engine_tier.h"

namespace tensorflow {
namespace fusedemb {
namespace engine {

// Every batch operation takes one shard and the positions of its keys in the batch
// arrays (Partition); callers run the shards in parallel, each shard's work under its
// own lock (the methods lock). Errors are returned as text ("" = fine).
class Engine {
 public:
  explicit Engine(const Config& c) : format_(c), rows_(format_), sharding_(c.num_shards) {
    for (int s = 0; s < c.num_shards; ++s) shards_.emplace_back(new Shard(format_.block_bytes()));
    changes_.resize(c.num_shards);
  }

  const Config& config() const { return format_.config(); }
  int dim() const { return format_.dim(); }
  int num_slots() const { return format_.num_slots(); }
  int num_shards() const { return sharding_.num_shards(); }
  const RowInitializer& initializer() const { return format_.initializer(); }

  int ShardOf(int64_t key) const { return sharding_.Of(key); }

  // Positions 0..n-1 grouped by the shard of keys[i] (see Sharding::Split), computed in
  // `parts` ranges that `run` may run in parallel.
  Partition PartitionKeys(const int64_t* keys, int64_t n, int parts = 1,
                          const ParallelParts& run = RunSerially) const {
    return sharding_.Split(keys, n, parts, run);
  }

  // ---------------------------------------------------------------- rows (engine_rows.h)
  // Rows of keys (float[n, dim] at out); a key without a stored row gets its initial row
  // from init_keys and is NOT inserted.
  void Lookup(int s, Span pos, const int64_t* keys, const int64_t* init_keys, float* out) const {
    std::shared_lock<std::shared_mutex> lock(shards_[s]->mutex());
    rows_.Lookup(*shards_[s], pos, keys, init_keys, out);
  }

  // One optimizer step per key (keys unique): read row and slots (stored, or initial),
  // update, write back, in one pass; new keys are inserted. With admission
  // (num_tables > 0), a key with no stored row whose statistics are tracked with a count
  // below min_counts[its table] is not stored, and out gets its unchanged initial row.
  // out: the rows after the step, float[n, dim].
  std::string ApplyGradients(int s, Span pos, const int64_t* keys, const int64_t* init_keys,
                             const float* grads, const StepConstants& step,
                             const int64_t* min_counts, int num_tables, float* out) {
    std::unique_lock<std::shared_mutex> lock(shards_[s]->mutex());
    changes_[s].Mark(pos, keys);
    return rows_.ApplyGradients(*shards_[s], pos, keys, init_keys, grads, step, min_counts,
                                num_tables, out);
  }

  // Rows and slots of stored keys (float[n, dim] and float[n, num_slots, dim]); an error
  // names a key without a stored row.
  std::string GatherRows(int s, Span pos, const int64_t* keys, float* values, float* slots) const {
    std::shared_lock<std::shared_mutex> lock(shards_[s]->mutex());
    return rows_.GatherRows(*shards_[s], pos, keys, values, slots);
  }

  // Stores rows and slots (float[n, dim], float[n, num_slots, dim]) of keys; statistics
  // are left as they are.
  void WriteRows(int s, Span pos, const int64_t* keys, const float* values, const float* slots) {
    std::unique_lock<std::shared_mutex> lock(shards_[s]->mutex());
    changes_[s].Mark(pos, keys);
    rows_.WriteRows(*shards_[s], pos, keys, values, slots);
  }

  // Drops the rows (and slots) of keys; their statistics stay. Absent keys are ignored.
  void RemoveRows(int s, Span pos, const int64_t* keys) {
    Shard& sh = *shards_[s];
    std::unique_lock<std::shared_mutex> lock(sh.mutex());
    changes_[s].Mark(pos, keys);
    rows_.RemoveRows(sh, pos, keys, [&](int64_t key) { tier_.EraseBlock(s, sh, key); });
  }

  // ---------------------------------------------------------------- statistics
  // Adds access statistics: creates a tracked (meta) block for a new key, adds counts,
  // sets (table, id) and the last step (see RecordArgs).
  std::string Record(int s, Span pos, const RecordArgs& a) {
    std::unique_lock<std::shared_mutex> lock(shards_[s]->mutex());
    changes_[s].Mark(pos, a.keys);
    return Statistics::Record(*shards_[s], pos, a);
  }

  // Fields of keys (any, duplicates allowed).
  void Find(int s, Span pos, const int64_t* keys, KeyFields* out) const {
    std::shared_lock<std::shared_mutex> lock(shards_[s]->mutex());
    Statistics::Find(*shards_[s], pos, keys, out);
  }

  // Forgets the statistics of keys (count, identity, last step); their rows stay.
  void Forget(int s, Span pos, const int64_t* keys) {
    Shard& sh = *shards_[s];
    std::unique_lock<std::shared_mutex> lock(sh.mutex());
    changes_[s].Mark(pos, keys);
    Statistics::Forget(sh, pos, keys, [&](int64_t key) { tier_.EraseBlock(s, sh, key); });
  }

  // ---------------------------------------------------------------- the SSD tier
  // With a store attached, at most `budget_bytes` of blocks and index stay in DRAM; every
  // batch operation runs between Pin and Unpin of its keys (engine_tier.h). Call before
  // any other use.
  void AttachStore(std::unique_ptr<BlockStore> store, int64_t budget_bytes,
                   const std::string& name, const std::string& tables = "") {
    tier_.Attach(std::move(store), budget_bytes, num_shards(), block_bytes(), name, tables);
  }
  bool tiered() const { return tier_.attached(); }
  // Bytes of a block with a row (the largest a store is given).
  size_t block_bytes() const { return format_.block_bytes(); }
  const BlockStore* store() const { return tier_.store(); }

  // Brings the blocks of the keys at `pos` into DRAM and pins them there (Tier::Pin);
  // *anew (if given): how many had no pin before. Nothing to do without a store.
  std::string Pin(int s, Span pos, const int64_t* keys, int64_t* anew = nullptr) {
    if (!tiered()) return "";
    std::unique_lock<std::shared_mutex> lock(shards_[s]->mutex());
    return tier_.Pin(s, *shards_[s], pos, keys, anew);
  }

  // The error of a budget smaller than the blocks pinned at once, with `extra_keys` keys
  // more (Tier::CheckPinned); empty when they fit or without a store.
  std::string CheckPinned(int64_t extra_keys = 0) const {
    return tiered() ? tier_.CheckPinned(extra_keys) : "";
  }

  // Releases Pin's pins of the keys at `pos`, then spills while the shard is over budget
  // (Tier::Unpin). Nothing to do without a store.
  std::string Unpin(int s, Span pos, const int64_t* keys) {
    if (!tiered()) return "";
    std::unique_lock<std::shared_mutex> lock(shards_[s]->mutex());
    return tier_.Unpin(s, *shards_[s], pos, keys);
  }

  // ---------------------------------------------------------------- whole tables
  // Every block of both tiers (stored_only: only those with a row), unsorted; rows and
  // slots appended to values/slots when they are non-null (zeros for a block without a
  // row). Holds every shard's lock for the whole export, so no block moves between the
  // tiers meanwhile (it would be exported twice or not at all).
  std::string Export(bool stored_only, std::vector<int64_t>* keys, std::vector<KeyFields>* fields,
                     std::vector<float>* values, std::vector<float>* slots) const {
    const auto locks = LockAll();
    for (const auto& sh : shards_) {
      sh->ForEach([&](uint32_t ref) {
        if (stored_only && !Shard::IsStored(ref)) return;
        AppendBlock(sh->Header(ref), Statistics::Fields(*sh, ref), keys, fields, values, slots);
      });
    }
    if (!tiered()) return "";
    return tier_.store()->ForEach([&](int64_t key, const char* data, size_t size) {
      if (shards_[ShardOf(key)]->Find(key) != nullptr) return;  // a stale copy: see Tier::Pin
      const bool stored = size == format_.block_bytes();
      if (stored_only && !stored) return;
      const BlockHeader* h = reinterpret_cast<const BlockHeader*>(data);
      AppendBlock(h, Statistics::HeaderFields(*h, stored), keys, fields, values, slots);
    });
  }

  // The keys of every block with a row, both tiers, appended to `keys` unsorted: what an
  // export enumerates its rows by, 8 bytes a key where Export holds a block's fields.
  // Holds every shard's lock meanwhile, as Export does.
  std::string StoredKeys(std::vector<int64_t>* keys) const {
    const auto locks = LockAll();
    for (const auto& sh : shards_) {
      sh->ForEach([&](uint32_t ref) {
        if (Shard::IsStored(ref)) keys->push_back(sh->Header(ref)->key);
      });
    }
    if (!tiered()) return "";
    return tier_.store()->ForEach([&](int64_t key, const char*, size_t size) {
      if (shards_[ShardOf(key)]->Find(key) != nullptr) return;  // a stale copy: see Tier::Pin
      if (size == format_.block_bytes()) keys->push_back(key);
    });
  }

  // Writes every block of both tiers to `dir`: a tiered engine through its store's own
  // checkpoint (the SSD tier's files linked, the DRAM tier's blocks written over them),
  // an engine without a store through `write_new` (a new checkpoint of the blocks alone:
  // the caller's store format, which this header does not know). The blocks are written
  // from the arenas, never copied whole. Holds every shard's lock meanwhile, so no block
  // moves between the tiers or changes. Once written, a non-empty `changes_for` (who
  // will write the deltas: a checkpoint manager's id) starts recording the keys that
  // change from here, for WriteDelta by that owner; "" stops recording.
  using CheckpointWriter =
      std::function<std::string(const std::string& dir, std::vector<BlockRef> blocks)>;
  std::string WriteCheckpoint(const std::string& dir, const CheckpointWriter& write_new,
                              const std::string& changes_for) {
    std::lock_guard<std::mutex> serial(checkpoint_mu_);
    const auto locks = LockAll();
    std::vector<BlockRef> dram;
    for (const auto& sh : shards_) {
      sh->ForEach([&](uint32_t ref) {
        const BlockHeader* h = sh->Header(ref);
        dram.push_back({h->key, reinterpret_cast<const char*>(h), sh->BytesOf(ref)});
      });
    }
    const std::string error = tiered() ? tier_.store()->Checkpoint(dir, std::move(dram))
                                       : write_new(dir, std::move(dram));
    if (error.empty()) {
      for (ChangeSet& c : changes_) c.Restart(!changes_for.empty());
      changes_for_ = changes_for;
    }
    return error;
  }

  // Whether the engine records changes for `owner` (its last checkpoint write, full or
  // delta, was that owner's): only then does that owner's WriteDelta follow its own.
  bool RecordsChangesFor(const std::string& owner) {
    std::lock_guard<std::mutex> serial(checkpoint_mu_);
    return !owner.empty() && owner == changes_for_;
  }

  // What WriteDelta wrote: blocks (changed keys' current blocks) and deletions (changed
  // keys that have no block any more).
  struct DeltaCounts {
    int64_t blocks = 0, deletions = 0;
  };

  // Writes to `dir` (through `write_new`, in WriteCheckpoint's format) the blocks of the
  // keys changed since `owner`'s last checkpoint write (WriteCheckpoint with changes_for
  // `owner`, or WriteDelta), from either tier, and a deletion (an empty value) for each
  // such key without a block any more; then records changes afresh. Applied in order
  // over that checkpoint (PutBlocks), deltas give back every block as it is now. An
  // error if the engine does not record changes for `owner` (none, or another owner
  // wrote a checkpoint since). Holds every shard's lock meanwhile, as WriteCheckpoint.
  std::string WriteDelta(const std::string& dir, const CheckpointWriter& write_new,
                         const std::string& owner, DeltaCounts* counts) {
    std::lock_guard<std::mutex> serial(checkpoint_mu_);
    if (owner.empty() || owner != changes_for_) {
      return "the engine records no changes since a checkpoint of its blocks by this "
             "writer (none was written with changes recorded for it, or another writer's "
             "checkpoint came since): write a full checkpoint first";
    }
    const auto locks = LockAll();
    std::vector<BlockRef> out;
    std::deque<std::string> read_back;  // blocks read from the SSD tier (stable addresses)
    *counts = DeltaCounts();
    for (int s = 0; s < num_shards(); ++s) {
      const Shard& sh = *shards_[s];
      std::vector<int64_t> in_store;  // changed keys without a block in DRAM
      for (const int64_t key : changes_[s].Sorted()) {
        if (const uint32_t* ref = sh.Find(key)) {
          out.push_back({key, reinterpret_cast<const char*>(sh.Header(*ref)), sh.BytesOf(*ref)});
        } else if (tiered()) {
          in_store.push_back(key);
        } else {
          out.push_back({key, "", 0});
        }
      }
      if (in_store.empty()) continue;
      const size_t first = read_back.size();
      read_back.resize(first + in_store.size());  // a key left empty: in neither tier
      const std::string error = tier_.store()->MultiGet(
          in_store.data(), in_store.size(), [&](size_t i, size_t size) {
            read_back[first + i].resize(size);
            return &read_back[first + i][0];
          });
      if (!error.empty()) return error;
      for (size_t i = 0; i < in_store.size(); ++i) {
        const std::string& block = read_back[first + i];
        out.push_back({in_store[i], block.data(), block.size()});
      }
    }
    for (const BlockRef& b : out) ++(b.size == 0 ? counts->deletions : counts->blocks);
    const std::string error = write_new(dir, std::move(out));
    if (error.empty()) {
      for (ChangeSet& c : changes_) c.Restart(true);
    }
    return error;
  }

  // Puts whole blocks, as a checkpoint holds them, in place of the blocks of keys:
  // blocks[i] is keys[i]'s; an empty block (a delta's deletion) erases the key's block.
  // Run between Pin and Unpin (each key in DRAM or absent). An error names a block of
  // another engine's size (another dim or optimizer).
  std::string PutBlocks(int s, Span pos, const int64_t* keys, const std::string* blocks) {
    Shard& sh = *shards_[s];
    std::unique_lock<std::shared_mutex> lock(sh.mutex());
    changes_[s].Mark(pos, keys);
    const size_t full = format_.block_bytes(), meta = sizeof(BlockHeader);
    for (int64_t k = 0; k < pos.size; ++k) {
      const int32_t i = pos.data[k];
      const std::string& block = blocks[i];
      if (block.empty()) {
        if (const uint32_t* ref = sh.Find(keys[i])) {
          if (sh.Header(*ref)->tracked()) --sh.tracked();
          tier_.EraseBlock(s, sh, keys[i]);
        }
        continue;
      }
      if (block.size() != full && block.size() != meta) {
        return "the block of key " + std::to_string(keys[i]) + " has " +
               std::to_string(block.size()) + " bytes; this engine's blocks have " +
               std::to_string(full) + " (or " + std::to_string(meta) + " without a row)";
      }
      int64_t key;
      std::memcpy(&key, block.data(), sizeof(key));
      if (key != keys[i]) {
        return "the block stored under key " + std::to_string(keys[i]) + " holds key " +
               std::to_string(key);
      }
      if (const uint32_t* ref = sh.Find(key)) {
        if (sh.Header(*ref)->tracked()) --sh.tracked();
        tier_.EraseBlock(s, sh, key);
      }
      sh.Adopt(block);
    }
    return "";
  }

  // Counts over both tiers; bytes_held is DRAM, ssd_bytes the blocks in the store,
  // ssd_index_bytes the DRAM of the store's index of them (BlockStore::IndexBytes).
  struct Sizes {
    int64_t stored = 0, tracked = 0, blocks = 0;
    int64_t bytes_held = 0, ssd_bytes = 0, ssd_index_bytes = 0;
    int64_t ssd_io[4] = {0, 0, 0, 0};  // Tier::ShardState::io summed
  };
  Sizes Size() const {
    Sizes z;
    for (int s = 0; s < num_shards(); ++s) {
      const Shard& sh = *shards_[s];
      std::shared_lock<std::shared_mutex> lock(sh.mutex());
      z.stored += sh.stored();
      z.tracked += sh.tracked();
      z.blocks += sh.blocks();
      z.bytes_held += static_cast<int64_t>(sh.bytes_held());
      if (const Tier::ShardState* ssd = tier_.state(s)) {
        z.stored += ssd->stored;
        z.tracked += ssd->tracked;
        z.blocks += ssd->blocks;
        z.ssd_bytes += ssd->bytes;
        for (int i = 0; i < 4; ++i) z.ssd_io[i] += ssd->io[i];
      }
    }
    if (tiered()) z.ssd_index_bytes = tier_.store()->IndexBytes();
    return z;
  }

 private:
  std::vector<std::shared_lock<std::shared_mutex>> LockAll() const {
    std::vector<std::shared_lock<std::shared_mutex>> locks;
    for (const auto& sh : shards_) locks.emplace_back(sh->mutex());
    return locks;
  }

  // Export's output for one block (its row and slots follow the header when f.stored).
  void AppendBlock(const BlockHeader* h, const KeyFields& f, std::vector<int64_t>* keys,
                   std::vector<KeyFields>* fields, std::vector<float>* values,
                   std::vector<float>* slots) const {
    const int64_t d = dim(), sd = num_slots() * d;
    keys->push_back(h->key);
    fields->push_back(f);
    if (values == nullptr) return;
    if (f.stored) {
      values->resize(values->size() + d);
      format_.LoadRow(h, values->data() + values->size() - d);
      const float* slot = format_.Slots(h);
      slots->insert(slots->end(), slot, slot + sd);
    } else {
      values->resize(values->size() + d, 0.0f);
      slots->resize(slots->size() + sd, 0.0f);
    }
  }

  RowFormat format_;
  Rows rows_;  // after format_, which it reads
  Sharding sharding_;
  std::vector<std::unique_ptr<Shard>> shards_;
  Tier tier_;  // the SSD tier; unattached: every block in DRAM
  // Per shard, the keys changed since the last checkpoint (engine_changes.h): marked
  // under the shard's writer lock; restarted by a checkpoint write under every shard's
  // reader lock and checkpoint_mu_, which keeps two checkpoint writes apart.
  std::vector<ChangeSet> changes_;
  std::string changes_for_;  // who records them ("": nobody, not recording); checkpoint_mu_
  std::mutex checkpoint_mu_;
};

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_EMBEDDING_ENGINE_H_
