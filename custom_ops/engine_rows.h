// Rows: the format of a full block's payload and the batch operations on rows.
//
// A full block is the 28-byte header (engine_blocks.h), then the row: float[dim], or with
// Config::bf16_rows bfloat16[dim] padded to 4 bytes; then the optimizer's slots:
// float[num_slots * dim] (slot k at k * dim). RowFormat owns that layout and the
// conversions (bfloat16 rounding, initial rows as a stored block holds them); Rows runs
// lookups, the optimizer update, and the row reads, writes and removals of one shard,
// whose lock the caller holds.
//
// With bfloat16 rows the optimizer still runs in float32 on the row read back as float32,
// and the result is rounded to nearest even (as TensorFlow's cast) when it is stored;
// initial rows are rounded the same way.
//
// Part of the engine that embedding_engine.h composes; plain C++17 + absl.
#ifndef TF_FUSEDEMB_ENGINE_ROWS_H_
#define TF_FUSEDEMB_ENGINE_ROWS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "engine_blocks.h"
#include "engine_config.h"
#include "engine_initializer.h"
#include "engine_optimizer.h"
#include "engine_shard.h"

namespace tensorflow {
namespace fusedemb {
namespace engine {

// A row copy: an inlined loop the compiler vectorizes (memcpy of a run-time size is a
// library call, measured at 9% of a lookup); n may be 0 with null pointers (an optimizer
// without slots), which memcpy may not be given (UBSan's finding).
inline void CopyFloats(const float* from, int64_t n, float* to) {
  for (int64_t j = 0; j < n; ++j) to[j] = from[j];
}

// float32 -> bfloat16, rounded to nearest even: TensorFlow's (Eigen's) cast, so a row
// equals tf.cast(row, tf.bfloat16) of the float32 row; a NaN stays a quiet NaN.
inline uint16_t ToBfloat16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float FromBfloat16(uint16_t b) {
  const uint32_t bits = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The row and slots inside a full block, and the rows of keys without a block.
class RowFormat {
 public:
  explicit RowFormat(const Config& c)
      : config_(c), num_slots_(NumSlots(c.optimizer)), init_(c) {
    // Multiples of 4, the header's alignment: a bfloat16 row is padded to it.
    row_bytes_ = c.bf16_rows ? (sizeof(uint16_t) * c.dim + 3) / 4 * 4 : sizeof(float) * c.dim;
    block_bytes_ = sizeof(BlockHeader) + row_bytes_ + sizeof(float) * c.dim * num_slots_;
  }

  const Config& config() const { return config_; }
  int dim() const { return config_.dim; }
  int num_slots() const { return num_slots_; }
  size_t row_bytes() const { return row_bytes_; }
  size_t block_bytes() const { return block_bytes_; }
  const RowInitializer& initializer() const { return init_; }

  static float* FloatRow(BlockHeader* h) { return reinterpret_cast<float*>(h + 1); }
  static uint16_t* Bf16Row(const BlockHeader* h) {
    return reinterpret_cast<uint16_t*>(const_cast<BlockHeader*>(h) + 1);
  }
  float* Slots(const BlockHeader* h) const {
    return reinterpret_cast<float*>(reinterpret_cast<char*>(const_cast<BlockHeader*>(h) + 1) +
                                    row_bytes_);
  }

  // The stored row of h as float32[dim] at out.
  void LoadRow(const BlockHeader* h, float* out) const {
    const int d = dim();
    if (!config_.bf16_rows) {
      CopyFloats(reinterpret_cast<const float*>(h + 1), d, out);
      return;
    }
    const uint16_t* row = Bf16Row(h);
    for (int j = 0; j < d; ++j) out[j] = FromBfloat16(row[j]);
  }

  // Stores float32[dim] `row` as h's row (rounded with bfloat16 rows).
  void StoreRow(const float* row, BlockHeader* h) const {
    const int d = dim();
    if (!config_.bf16_rows) {
      CopyFloats(row, d, FloatRow(h));
      return;
    }
    uint16_t* out = Bf16Row(h);
    for (int j = 0; j < d; ++j) out[j] = ToBfloat16(row[j]);
  }

  // The initial row of init_key at out, float32[dim], as a stored block would hold it.
  void InitialRow(int64_t init_key, float* out) const {
    init_.Fill(init_key, out);
    if (!config_.bf16_rows) return;
    for (int j = 0; j < dim(); ++j) out[j] = FromBfloat16(ToBfloat16(out[j]));
  }

  // A new block's row and slots; `scratch`: float[dim] the row may be built in.
  void InitRowAndSlots(BlockHeader* h, int64_t init_key, float* scratch) const {
    const int d = dim();
    if (config_.bf16_rows) {
      init_.Fill(init_key, scratch);
      StoreRow(scratch, h);
    } else {
      init_.Fill(init_key, FloatRow(h));
    }
    float* slots = Slots(h);
    for (int k = 0; k < num_slots_; ++k) {
      std::fill(slots + k * d, slots + (k + 1) * d, InitialSlotValue(config_, k));
    }
  }

 private:
  Config config_;
  int num_slots_;
  size_t row_bytes_;
  size_t block_bytes_;
  RowInitializer init_;
};

// The row operations on one shard (locked by the caller: shared for the const ones).
// `pos`: the batch positions of the shard's keys; batch arrays are indexed by position.
class Rows {
 public:
  explicit Rows(const RowFormat& f) : f_(f) {}

  // Rows of keys (float[n, dim] at out); a key without a stored row gets its initial row
  // from init_keys and is NOT inserted.
  void Lookup(const Shard& sh, Span pos, const int64_t* keys, const int64_t* init_keys,
              float* out) const {
    const int d = f_.dim();
    const Ahead ahead{sizeof(BlockHeader) + f_.row_bytes(), out, nullptr, d};
    ForEachPrefetched(sh, pos, keys, ahead, [&](int32_t i) {
      const uint32_t* ref = sh.Find(keys[i]);
      if (ref != nullptr && Shard::IsStored(*ref)) {
        f_.LoadRow(sh.Header(*ref), out + int64_t{i} * d);
      } else {
        f_.InitialRow(init_keys[i], out + int64_t{i} * d);
      }
    });
  }

  // See Engine::ApplyGradients.
  std::string ApplyGradients(Shard& sh, Span pos, const int64_t* keys, const int64_t* init_keys,
                             const float* grads, const StepConstants& step,
                             const int64_t* min_counts, int num_tables, float* out) const {
    const int d = f_.dim();
    const Config& c = f_.config();
    std::string error;
    const Ahead ahead{f_.block_bytes(), grads, out, d};
    ForEachPrefetched(sh, pos, keys, ahead, [&](int32_t i) {
      if (!error.empty()) return;
      float* row_out = out + int64_t{i} * d;
      bool created;
      uint32_t* ref = sh.FindOrAddFull(keys[i], &created);
      BlockHeader* h = sh.Header(*ref);
      if (!Shard::IsStored(*ref)) {  // tracked, no row yet: admission decides
        if (num_tables > 0) {
          if (h->table() >= static_cast<uint32_t>(num_tables)) {
            error = "key " + std::to_string(keys[i]) + " is recorded with table " +
                    std::to_string(h->table()) + ", but min_counts has " +
                    std::to_string(num_tables) + " entries";
            return;
          }
          if (static_cast<int64_t>(h->count()) < min_counts[h->table()]) {  // not admitted
            f_.InitialRow(init_keys[i], row_out);
            return;
          }
        }
        h = sh.Promote(ref);
        created = true;
      }
      if (created) f_.InitRowAndSlots(h, init_keys[i], row_out);
      const float* g = grads + int64_t{i} * d;
      if (!c.bf16_rows) {  // in place
        float* row = RowFormat::FloatRow(h);
        ApplyOptimizer(c, step, row, f_.Slots(h), g);
        CopyFloats(row, d, row_out);
      } else {  // on the float32 row in row_out; out gets the stored, rounded row
        f_.LoadRow(h, row_out);
        ApplyOptimizer(c, step, row_out, f_.Slots(h), g);
        f_.StoreRow(row_out, h);
        f_.LoadRow(h, row_out);
      }
    });
    return error;
  }

  // Rows and slots of stored keys (float[n, dim] and float[n, num_slots, dim]); an error
  // names a key without a stored row.
  std::string GatherRows(const Shard& sh, Span pos, const int64_t* keys, float* values,
                         float* slots) const {
    const int64_t d = f_.dim(), sd = f_.num_slots() * d;
    std::string error;
    ForEachPrefetched(sh, pos, keys, Ahead{f_.block_bytes()}, [&](int32_t i) {
      if (!error.empty()) return;
      const uint32_t* ref = sh.Find(keys[i]);
      if (ref == nullptr || !Shard::IsStored(*ref)) {
        error = "key " + std::to_string(keys[i]) + " has no stored row";
        return;
      }
      BlockHeader* h = sh.Header(*ref);
      f_.LoadRow(h, values + i * d);
      CopyFloats(f_.Slots(h), sd, slots + i * sd);  // sd may be 0 with a null slots array
    });
    return error;
  }

  // Stores rows and slots (float[n, dim], float[n, num_slots, dim]) of keys; statistics
  // are left as they are.
  void WriteRows(Shard& sh, Span pos, const int64_t* keys, const float* values,
                 const float* slots) const {
    const int64_t d = f_.dim(), sd = f_.num_slots() * d;
    ForEachPrefetched(sh, pos, keys, Ahead{f_.block_bytes()}, [&](int32_t i) {
      bool created;
      uint32_t* ref = sh.FindOrAddFull(keys[i], &created);
      BlockHeader* h = Shard::IsStored(*ref) ? sh.Header(*ref) : sh.Promote(ref);
      f_.StoreRow(values + i * d, h);
      CopyFloats(slots + i * sd, sd, f_.Slots(h));  // sd may be 0, slots null
    });
  }

  // Drops the rows (and slots) of keys; their statistics stay. Absent keys are ignored.
  // erase(key) removes an untracked key's block (see Tier::EraseBlock).
  template <typename Erase>
  void RemoveRows(Shard& sh, Span pos, const int64_t* keys, Erase&& erase) const {
    for (int64_t k = 0; k < pos.size; ++k) {
      const int64_t key = keys[pos.data[k]];
      const uint32_t* found = sh.Find(key);
      if (found == nullptr || !Shard::IsStored(*found)) continue;
      uint32_t* ref = const_cast<uint32_t*>(found);  // see BlockIndex::FindOrInsert
      if (sh.Header(*ref)->tracked()) {
        sh.Demote(ref);
      } else {
        erase(key);
      }
    }
  }

 private:
  const RowFormat& f_;
};

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_ENGINE_ROWS_H_
