// Statistics: a key's identity and access record, kept in its block's header (table,
// original ID, access count, last step; engine_blocks.h). Record adds to them (creating
// a header-only block for a key never seen), Find reads them, Forget drops them. The
// shard counts its tracked keys; admission (engine_rows.h) and TTL eviction read the
// counts and steps. Owns no memory: the operations work on a shard the caller has locked.
//
// Part of the engine that embedding_engine.h composes; plain C++17 + absl.
#ifndef TF_FUSEDEMB_ENGINE_STATISTICS_H_
#define TF_FUSEDEMB_ENGINE_STATISTICS_H_

#include <cstdint>
#include <string>

#include "engine_blocks.h"
#include "engine_shard.h"

namespace tensorflow {
namespace fusedemb {
namespace engine {

// Statistics to write for a key (Record).
struct RecordArgs {
  const int64_t* keys;
  const int32_t* tables;
  const int64_t* ids;
  const int64_t* counts;      // added to the key's count
  const int64_t* last_steps;  // per key (stride 1) or one value (stride 0)
  int64_t last_step_stride;
  // true: last_steps overwrite; false: they apply only to keys not tracked before.
  bool overwrite_last_step;
};

// The fields of a key, as Find and Export return them.
struct KeyFields {
  bool stored;
  int32_t table;  // -1: not tracked
  int64_t id, count, last_step;
};

struct Statistics {
  // Adds access statistics: creates a tracked (meta) block for a new key, adds counts,
  // sets (table, id) and the last step (see RecordArgs).
  static std::string Record(Shard& sh, Span pos, const RecordArgs& a) {
    std::string error;
    ForEachPrefetched(sh, pos, a.keys, Ahead{sizeof(BlockHeader)}, [&](int32_t i) {
      if (!error.empty()) return;
      BlockHeader* h = sh.Header(*sh.FindOrAddMeta(a.keys[i]));
      const uint64_t count = h->count() + static_cast<uint64_t>(a.counts[i]);
      if (count > BlockHeader::kMaxCount) {
        error = "the access count of key " + std::to_string(a.keys[i]) + " exceeds 2^48 - 1";
        return;
      }
      const int32_t last = static_cast<int32_t>(a.last_steps[a.last_step_stride * i]);
      if (!h->tracked()) {
        ++sh.tracked();
        h->last_step = last;
      } else if (a.overwrite_last_step) {
        h->last_step = last;
      }
      h->id = a.ids[i];
      h->Set(count, static_cast<uint32_t>(a.tables[i]));
    });
    return error;
  }

  // Fields of keys (any, duplicates allowed).
  static void Find(const Shard& sh, Span pos, const int64_t* keys, KeyFields* out) {
    ForEachPrefetched(sh, pos, keys, Ahead{sizeof(BlockHeader)}, [&](int32_t i) {
      const uint32_t* ref = sh.Find(keys[i]);
      out[i] = ref == nullptr ? KeyFields{false, -1, 0, 0, 0} : Fields(sh, *ref);
    });
  }

  // Forgets the statistics of keys (count, identity, last step); their rows stay.
  // erase(key) removes a key's header-only block (see Tier::EraseBlock).
  template <typename Erase>
  static void Forget(Shard& sh, Span pos, const int64_t* keys, Erase&& erase) {
    for (int64_t k = 0; k < pos.size; ++k) {
      const int64_t key = keys[pos.data[k]];
      const uint32_t* ref = sh.Find(key);
      if (ref == nullptr) continue;
      BlockHeader* h = sh.Header(*ref);
      if (!h->tracked()) continue;
      --sh.tracked();
      if (Shard::IsStored(*ref)) {
        h->Reset(key);
      } else {
        erase(key);
      }
    }
  }

  static KeyFields Fields(const Shard& sh, uint32_t ref) {
    return HeaderFields(*sh.Header(ref), Shard::IsStored(ref));
  }

  static KeyFields HeaderFields(const BlockHeader& h, bool stored) {
    return {stored, h.tracked() ? static_cast<int32_t>(h.table()) : -1, h.id,
            static_cast<int64_t>(h.count()), h.last_step};
  }
};

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_ENGINE_STATISTICS_H_
