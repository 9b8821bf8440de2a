// The embedding storage engine of tf_fusedemb: per fused group and rank, ONE block per
// key holding its identity and access statistics, its row and its optimizer slots.
//
// Plain C++17 + absl (the copy TensorFlow ships and exports from
// libtensorflow_framework.so.2), no TensorFlow kernel headers, so it is unit- and
// stress-tested standalone (tests/engine_stress_test.cc) and under the sanitizers.
//
// Layout (why: one probe and one cache-line run per key, at a few bytes over the payload):
//  * A block is a 28-byte BlockHeader {key, id, count:48|table:16, last step:int32},
//    followed in "full" blocks by the row float[dim] (bfloat16[dim], padded to 4 bytes,
//    with Config::bf16_rows) and the slots float[num_slots * dim].
//    A key whose statistics are tracked but whose row is not stored (admission has not
//    let it in yet) lives in a header-only "meta" block: tracking a rare key costs 28
//    bytes, not a whole row. Whether a row is stored is which arena the block is in.
//  * Blocks live in chunked arenas (Arena): chunks are never moved or reallocated, so
//    growth never moves a row; removed blocks go on an intrusive free list.
//  * The index from key to block is absl::flat_hash_set<uint32_t block ref> with
//    transparent hash/eq that read the key from the block: 4-byte entries + 1 control
//    byte, and no key stored twice. A ref's top bit says which arena.
//  * Keys are split into num_shards shards by the top bits of Mix64(key); each shard has
//    its own index, arenas and reader/writer lock, so a batch runs shard-parallel with
//    one writer per shard and no resize race.
//  * Optionally (AttachStore, a table's memory budget) an SSD tier under the blocks: a
//    BlockStore (block_store.h; RocksDB in rocksdb_block_store.cc) holds, whole, the
//    blocks a shard spilled to stay within its share of the budget. Each batch operation
//    runs between Pin (blocks of its keys read back into DRAM) and Unpin (spill), so the
//    operations below only ever see DRAM blocks and a budget cannot change a result.
//    A block read back leaves its copy in the store (a delete per read would double the
//    store's writes): while the block is in DRAM that copy is stale and the DRAM block is
//    the one that counts. A spill overwrites it, an erasure in DRAM (EraseBlock) deletes
//    it with the next spill batch, and Export skips a stored key that DRAM holds.
//
// The math mirrors tf_fusedemb.storage: initial rows are bit-equal to
// initializers.init_rows (float64 math, one cast), the optimizers equal optimizers.py's
// TF formulas operation for operation in float32. With bfloat16 rows the optimizer still
// runs in float32 on the row read back as float32, and the result is rounded to nearest
// even (as TensorFlow's cast) when it is stored; initial rows are rounded the same way.
#ifndef TF_FUSEDEMB_EMBEDDING_ENGINE_H_
#define TF_FUSEDEMB_EMBEDDING_ENGINE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

// prefetch.h first: raw_hash_set's prefetch() prefetches the probe group only where
// ABSL_HAVE_PREFETCH is already defined.
#include "absl/base/prefetch.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "block_store.h"

namespace tensorflow {
namespace fusedemb {
namespace engine {

// fmix64, the library's one hash (fusedemb_common.h's Mix64, tf_fusedemb.ops.hashing.mix64);
// restated here so this header needs no TensorFlow header. Initial rows depend on it bit
// for bit, which the tests check against the Python mirrors.
inline uint64_t Fmix64(uint64_t x) {
  x = (x ^ (x >> 33)) * 0xff51afd7ed558ccdULL;
  x = (x ^ (x >> 33)) * 0xc4ceb9fe1a85ec53ULL;
  return x ^ (x >> 33);
}

// ------------------------------------------------------------------ configuration
enum class Optimizer { kSgd, kAdagrad, kFtrl, kAdam };
enum class Init { kZeros, kUniform, kNormal, kTruncatedNormal };

constexpr uint64_t kInitSalt = 0x9E3779B97F4A7C15ULL;  // initializers.SALT
constexpr int kTruncatedDraws = 8;                     // initializers.TRUNCATED_DRAWS
constexpr float kAdagradEpsilon = 1e-7f;               // optimizers.ADAGRAD_EPSILON

struct Config {
  int dim = 0;
  Optimizer optimizer = Optimizer::kSgd;
  float learning_rate = 0.0f;
  float initial_accumulator = 0.1f;  // adagrad, ftrl
  float beta1 = 0.9f, beta2 = 0.999f, epsilon = 1e-7f;  // adam
  float lr_power = -0.5f, l1 = 0.0f, l2 = 0.0f;         // ftrl
  bool bf16_rows = false;  // rows stored as bfloat16; slots and the optimizer stay float32
  Init init = Init::kUniform;
  double init_loc = 0.0, init_scale = 0.0;  // uniform: (minval, maxval - minval); normal: (mean, stddev)
  int num_shards = 16;                      // a power of two
};

// The value named `name` in a table of (name, value) pairs; false if none is.
template <typename T, size_t N>
bool ParseName(const std::pair<const char*, T> (&names)[N], const std::string& name, T* out) {
  for (const auto& p : names) {
    if (name == p.first) return *out = p.second, true;
  }
  return false;
}

inline bool ParseOptimizer(const std::string& name, Optimizer* out) {
  static const std::pair<const char*, Optimizer> kNames[] = {
      {"sgd", Optimizer::kSgd}, {"adagrad", Optimizer::kAdagrad},
      {"ftrl", Optimizer::kFtrl}, {"adam", Optimizer::kAdam}};
  return ParseName(kNames, name, out);
}

inline bool ParseInit(const std::string& name, Init* out) {
  static const std::pair<const char*, Init> kNames[] = {
      {"zeros", Init::kZeros}, {"uniform", Init::kUniform},
      {"normal", Init::kNormal}, {"truncated_normal", Init::kTruncatedNormal}};
  return ParseName(kNames, name, out);
}

inline int NumSlots(Optimizer o) {
  switch (o) {
    case Optimizer::kSgd: return 0;
    case Optimizer::kAdagrad: return 1;
    default: return 2;  // ftrl (accumulator, linear), adam (m, v)
  }
}

// "" when the config is usable, else what is wrong with it.
inline std::string ValidateConfig(const Config& c) {
  if (c.dim <= 0) return "dim must be > 0, got " + std::to_string(c.dim);
  if (c.num_shards <= 0 || c.num_shards > 4096 || (c.num_shards & (c.num_shards - 1)) != 0) {
    return "num_shards must be a power of two in [1, 4096], got " + std::to_string(c.num_shards);
  }
  if (!(c.learning_rate > 0.0f)) return "learning_rate must be > 0";
  if (!std::isfinite(c.init_loc) || !std::isfinite(c.init_scale)) {
    return "initializer parameters must be finite";
  }
  return "";
}

// ------------------------------------------------------------------ initial rows
// Rows of never-stored keys: b[k, j] = Fmix64(uint64(k) ^ Fmix64(j + SALT)), turned into
// a uniform / normal / truncated normal in float64 and cast to float32 once, exactly as
// tf_fusedemb.storage.initializers does (see its docstring for the bit layout).
class RowInitializer {
 public:
  explicit RowInitializer(const Config& c) : init_(c.init), loc_(c.init_loc), scale_(c.init_scale) {
    seeds_.resize(c.dim);
    for (int j = 0; j < c.dim; ++j) seeds_[j] = Fmix64(static_cast<uint64_t>(j) + kInitSalt);
  }

  void Fill(int64_t key, float* out) const {
    const int dim = static_cast<int>(seeds_.size());
    if (init_ == Init::kZeros) {
      std::fill(out, out + dim, 0.0f);
      return;
    }
    for (int j = 0; j < dim; ++j) {
      const uint64_t b = Fmix64(static_cast<uint64_t>(key) ^ seeds_[j]);
      // Two statements, so no compiler may contract them into an FMA (the mirrors round twice).
      const double scaled = scale_ * Standard(b);
      out[j] = static_cast<float>(loc_ + scaled);
    }
  }

 private:
  static double Uniform24(uint64_t bits24) { return static_cast<double>(bits24) * 0x1p-24; }

  // Box-Muller on bits 63..40 (u1 in (0, 1]) and 39..16 (u2 in [0, 1)) of one word.
  static double Normal(uint64_t b) {
    const double u1 = Uniform24((b >> 40) + 1);
    const double u2 = Uniform24((b >> 16) & 0xFFFFFF);
    const double two_pi_u2 = (2.0 * M_PI) * u2;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(two_pi_u2);
  }

  double Standard(uint64_t b) const {
    if (init_ == Init::kUniform) return Uniform24(b >> 40);
    double z = Normal(b);
    if (init_ == Init::kNormal) return z;
    // Truncated: redraw outside [-2, 2] from b_r = Fmix64(b_{r-1} + SALT), clip the last.
    for (int r = 1; r < kTruncatedDraws && !(std::fabs(z) <= 2.0); ++r) {
      b = Fmix64(b + kInitSalt);
      z = Normal(b);
    }
    return std::min(2.0, std::max(-2.0, z));
  }

  Init init_;
  double loc_, scale_;
  std::vector<uint64_t> seeds_;
};

// ------------------------------------------------------------------ optimizers
// Per-batch constants of the optimizer step (Adam's bias-corrected learning rate).
struct StepConstants {
  float lr_t = 0.0f;
};

inline StepConstants MakeStepConstants(const Config& c, int64_t step) {
  StepConstants s;
  if (c.optimizer == Optimizer::kAdam) {
    // As TF computes it: float32 t, float32 pow (Eigen's pow is std::pow on floats).
    const float t = static_cast<float>(step);
    const float num = std::sqrt(1.0f - std::pow(c.beta2, t));
    s.lr_t = c.learning_rate * num / (1.0f - std::pow(c.beta1, t));
  }
  return s;
}

// Initial value of every element of slot `k`.
inline float InitialSlotValue(const Config& c, int k) {
  if (c.optimizer == Optimizer::kAdagrad || c.optimizer == Optimizer::kFtrl) {
    return k == 0 ? c.initial_accumulator : 0.0f;
  }
  return 0.0f;
}

// One optimizer step on one row, in place: row float[dim], slots float[num_slots*dim]
// (slot k at slots + k*dim), grad float[dim]. Each expression keeps the operation order
// of optimizers.py, so float32 results agree with TF's to rounding (usually exactly).
inline void ApplyOptimizer(const Config& c, const StepConstants& s, float* row, float* slots,
                           const float* g) {
  const int d = c.dim;
  const float lr = c.learning_rate;
  switch (c.optimizer) {
    case Optimizer::kSgd:
      for (int j = 0; j < d; ++j) row[j] = row[j] + (-g[j]) * lr;
      return;
    case Optimizer::kAdagrad: {
      int j = 0;
#if defined(__SSE2__)
      // 4 lanes at a time: _mm_sqrt_ps and _mm_div_ps round exactly like the scalar ops
      // (IEEE), but std::sqrt's errno path keeps the compiler from vectorizing the loop.
      const __m128 neg_lr = _mm_set1_ps(-lr), eps = _mm_set1_ps(kAdagradEpsilon);
      for (; j + 4 <= d; j += 4) {
        const __m128 gj = _mm_loadu_ps(g + j);
        const __m128 acc = _mm_add_ps(_mm_loadu_ps(slots + j), _mm_mul_ps(gj, gj));
        _mm_storeu_ps(slots + j, acc);
        const __m128 delta = _mm_div_ps(_mm_mul_ps(neg_lr, gj), _mm_sqrt_ps(_mm_add_ps(acc, eps)));
        _mm_storeu_ps(row + j, _mm_add_ps(_mm_loadu_ps(row + j), delta));
      }
#endif
      for (; j < d; ++j) {
        const float acc = slots[j] + g[j] * g[j];
        slots[j] = acc;
        row[j] = row[j] + (-lr * g[j]) / std::sqrt(acc + kAdagradEpsilon);
      }
      return;
    }
    case Optimizer::kFtrl: {
      const float power = -c.lr_power;
      float* acc = slots;
      float* linear = slots + d;
      for (int j = 0; j < d; ++j) {
        const float new_acc = acc[j] + std::pow(g[j], 2.0f);
        const float new_pow = std::pow(new_acc, power);
        const float lin = linear[j] + (g[j] - (new_pow - std::pow(acc[j], power)) / lr * row[j]);
        const float quadratic = new_pow / lr + 2.0f * c.l2;
        row[j] = (std::min(c.l1, std::max(-c.l1, lin)) - lin) / quadratic;
        acc[j] = new_acc;
        linear[j] = lin;
      }
      return;
    }
    case Optimizer::kAdam: {
      float* m = slots;
      float* v = slots + d;
      const float b1 = c.beta1, b2 = c.beta2;
      for (int j = 0; j < d; ++j) {
        const float gm = (1.0f - b1) * g[j];
        m[j] = b1 * m[j] + gm;
        const float gv = (1.0f - b2) * (g[j] * g[j]);
        v[j] = b2 * v[j] + gv;
        row[j] = row[j] - s.lr_t * m[j] / (std::sqrt(v[j]) + c.epsilon);
      }
      return;
    }
  }
}

// Prefetches the cache line of p. An asm statement, not __builtin_prefetch: the compiler
// may delete a loop whose only effect is a builtin prefetch (PrefetchBlock's find()).
inline void PrefetchLine(uintptr_t p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 (%0)" : : "r"(p));
#else
  __builtin_prefetch(reinterpret_cast<const void*>(p));
#endif
}

// Prefetches the cache lines of [p, p + bytes).
inline void PrefetchBytes(const void* p, size_t bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t line = begin & ~uintptr_t{63}; line < begin + bytes; line += 64) PrefetchLine(line);
}

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

// ------------------------------------------------------------------ blocks and arenas
// The identity and statistics of a key, followed by row and slots in full blocks.
// 28 bytes, 4-byte aligned (packed): the last step is an int32 (a step count past 2^31
// is refused, not wrapped), and blocks need no padding to 8 bytes. At 10M rows of dim
// 16 with Adagrad the 4 bytes are what keeps a row under 170 bytes of RSS.
struct __attribute__((packed, aligned(4))) BlockHeader {
  static constexpr uint64_t kCountBits = 48;
  static constexpr uint64_t kMaxCount = (uint64_t{1} << kCountBits) - 1;
  static constexpr uint32_t kNoTable = 0xFFFF;  // not tracked: no identity recorded

  int64_t key;
  int64_t id;            // original instance ID (statistics)
  uint64_t count_table;  // access count (low 48 bits) | table index (high 16 bits)
  int32_t last_step;     // last step the key was seen (TTL eviction's clock)

  uint64_t count() const { return count_table & kMaxCount; }
  uint32_t table() const { return static_cast<uint32_t>(count_table >> kCountBits); }
  bool tracked() const { return table() != kNoTable; }
  void Set(uint64_t count, uint32_t table) {
    count_table = (static_cast<uint64_t>(table) << kCountBits) | count;
  }
  void Reset(int64_t k) {
    key = k;
    id = 0;
    last_step = 0;
    Set(0, kNoTable);
  }
};
static_assert(sizeof(BlockHeader) == 28, "the block header must stay 28 bytes");
static_assert(alignof(BlockHeader) == 4, "blocks are packed at 4-byte alignment");

// Fixed-size blocks in chunks that are never moved. Chunk c holds 64 << min(c, 8) blocks:
// small tables stay small, large ones grow by 16384 blocks at a time (so at most one
// partly used chunk per arena). Block i's chunk and offset come from i by bit arithmetic.
class Arena {
 public:
  static constexpr int kFirstShift = 6;   // first chunk: 64 blocks
  static constexpr int kDoublings = 8;    // then 128, ..., 16384 blocks per chunk
  static constexpr uint32_t kNone = 0xFFFFFFFFu;
  static constexpr uint32_t kMaxBlocks = 0x80000000u;  // refs keep one bit for the arena

  explicit Arena(size_t block_bytes) : block_bytes_(block_bytes) {}
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena() {
    for (char* c : chunks_) std::free(c);
  }

  size_t block_bytes() const { return block_bytes_; }
  // Bytes of the chunks (address space; a chunk's untouched tail is not resident).
  size_t bytes_allocated() const { return bytes_allocated_; }
  // Bytes of the blocks ever handed out: blocks are used in address order, so this is
  // what the process holds resident for the arena (freed blocks stay resident for reuse).
  size_t bytes_used() const { return static_cast<size_t>(end_) * block_bytes_; }
  int64_t live() const { return live_; }

  char* At(uint32_t i) const {
    int c;
    uint64_t off;
    Locate(i, &c, &off);
    return chunks_[c] + off * block_bytes_;
  }

  // Makes the next Allocate() succeed without allocating memory: call it before any
  // state changes, so running out of memory (std::bad_alloc) leaves everything intact.
  void Reserve() {
    if (free_head_ != kNone) return;
    if (end_ == kMaxBlocks) throw std::bad_alloc();
    int c;
    uint64_t off;
    Locate(end_, &c, &off);
    if (c == static_cast<int>(chunks_.size())) AddChunk(c);
  }

  // A block index, from the free list or past the end; its contents are unspecified.
  // Needs a Reserve() first.
  uint32_t Allocate() {
    ++live_;
    if (free_head_ != kNone) {
      const uint32_t i = free_head_;
      std::memcpy(&free_head_, At(i), sizeof(free_head_));
      return i;
    }
    return end_++;
  }

  // Puts block i on the free list; its first 4 bytes hold the next free block.
  void Free(uint32_t i) {
    --live_;
    std::memcpy(At(i), &free_head_, sizeof(free_head_));
    free_head_ = i;
  }

  static uint64_t ChunkBlocks(int c) {
    return uint64_t{1} << (kFirstShift + std::min(c, kDoublings));
  }

  static void Locate(uint64_t i, int* chunk, uint64_t* offset) {
    const uint64_t q = (i >> kFirstShift) + 1;
    if (q < (uint64_t{1} << (kDoublings + 1))) {  // in the doubling chunks 0..kDoublings
      const int c = 63 - __builtin_clzll(q);
      *chunk = c;
      *offset = i - (((uint64_t{1} << c) - 1) << kFirstShift);
      return;
    }
    const uint64_t j = i - (((uint64_t{1} << kDoublings) - 1) << kFirstShift);
    *chunk = kDoublings + static_cast<int>(j >> (kFirstShift + kDoublings));
    *offset = j & ((uint64_t{1} << (kFirstShift + kDoublings)) - 1);
  }

 private:
  void AddChunk(int c) {
    const size_t bytes = ChunkBlocks(c) * block_bytes_;
    // malloc, not zeroed: pages become resident only as blocks are used.
    char* p = static_cast<char*>(std::malloc(bytes));
    if (p == nullptr) throw std::bad_alloc();
    chunks_.push_back(p);
    bytes_allocated_ += bytes;
  }

  size_t block_bytes_;
  std::vector<char*> chunks_;
  uint32_t end_ = 0;          // blocks ever handed out past the free list
  uint32_t free_head_ = kNone;
  int64_t live_ = 0;
  size_t bytes_allocated_ = 0;
};

// ------------------------------------------------------------------ shards
// A position list: the batch positions of one shard's keys.
struct Span {
  const int32_t* data = nullptr;
  int64_t size = 0;
};

// Runs fn(q) for every q in [0, parts), possibly in parallel; returns when all are done.
using ParallelParts = std::function<void(int parts, const std::function<void(int)>& fn)>;

inline void RunSerially(int parts, const std::function<void(int)>& fn) {
  for (int q = 0; q < parts; ++q) fn(q);
}

// Below this many keys per range a parallel partition costs more than it saves.
constexpr int64_t kMinKeysPerPart = 16384;

// Keys grouped by shard: order[begin[s] .. begin[s+1]) are the positions of shard s.
struct Partition {
  std::vector<int32_t> order;
  std::vector<int64_t> begin;
  Span Of(int s) const { return {order.data() + begin[s], begin[s + 1] - begin[s]}; }
};

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

class Shard {
 public:
  static constexpr uint32_t kMetaBit = 0x80000000u;

  Shard(size_t full_block_bytes)
      : full_(full_block_bytes), meta_(sizeof(BlockHeader)), index_(0, RefHash{this}, RefEq{this}) {}
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  std::shared_mutex& mutex() const { return mu_; }

  BlockHeader* Header(uint32_t ref) const {
    return reinterpret_cast<BlockHeader*>((ref & kMetaBit) ? meta_.At(ref & ~kMetaBit)
                                                           : full_.At(ref));
  }
  static bool IsStored(uint32_t ref) { return (ref & kMetaBit) == 0; }

  // Cache prefetches: the index's probe group of `key`; the first `bytes` of its block.
  void PrefetchIndex(int64_t key) const { index_.prefetch(KeyProbe{key}); }
  // A find() whose equality never matches but prefetches each candidate's block: it
  // walks the probe sequence like a miss, touching only the index, so it never waits
  // for a block (a real find would read the key in the block, the very miss to hide).
  void PrefetchBlock(int64_t key, size_t bytes) const {
    index_.find(PrefetchProbe{key, bytes});
  }

  // The ref of `key`, or nullptr when it has no block.
  const uint32_t* Find(int64_t key) const {
    auto it = index_.find(KeyProbe{key});
    return it == index_.end() ? nullptr : &*it;
  }

  // The ref of `key`'s block, creating a meta (header-only) block for a new key.
  uint32_t* FindOrAddMeta(int64_t key) { return FindOrAdd(key, /*full=*/false, nullptr); }

  // The ref of `key`'s block, creating a full block (header reset, row and slots
  // unspecified) for a new key; *created says whether it did.
  uint32_t* FindOrAddFull(int64_t key, bool* created) { return FindOrAdd(key, true, created); }

  // Gives `*ref` a full block (row + slots, unspecified) keeping its header; returns it.
  BlockHeader* Promote(uint32_t* ref) {
    full_.Reserve();
    const uint32_t i = full_.Allocate();
    BlockHeader* h = reinterpret_cast<BlockHeader*>(full_.At(i));
    *h = *Header(*ref);
    meta_.Free(*ref & ~kMetaBit);
    *ref = i;
    return h;
  }

  // Moves a full block back to a meta block (row and slots dropped).
  void Demote(uint32_t* ref) {
    meta_.Reserve();
    const uint32_t i = meta_.Allocate();
    *reinterpret_cast<BlockHeader*>(meta_.At(i)) = *Header(*ref);
    full_.Free(*ref);
    *ref = i | kMetaBit;
  }

  // Removes `key`'s block entirely.
  void Erase(int64_t key) {
    auto it = index_.find(KeyProbe{key});
    if (it == index_.end()) return;
    const uint32_t ref = *it;
    index_.erase(it);
    if (IsStored(ref)) {
      full_.Free(ref);
    } else {
      meta_.Free(ref & ~kMetaBit);
    }
  }

  // Inserts a block read back from the SSD tier (bytes of a full or a meta block, header
  // first) for a key that has none here; returns its header.
  BlockHeader* Adopt(const std::string& bytes) {
    int64_t key;
    std::memcpy(&key, bytes.data(), sizeof(key));
    bool created;
    uint32_t* ref = bytes.size() == full_.block_bytes() ? FindOrAddFull(key, &created)
                                                        : FindOrAddMeta(key);
    BlockHeader* h = Header(*ref);
    std::memcpy(static_cast<void*>(h), bytes.data(), bytes.size());
    if (h->tracked()) ++tracked_;
    return h;
  }

  // Bytes of the blocks alive in DRAM and of the index: what a memory budget bounds
  // (freed blocks are reused before the arenas grow, so the resident arena bytes stay
  // within the budget plus one batch's blocks).
  int64_t live_bytes() const {
    const size_t cap = index_.capacity();
    return static_cast<int64_t>(full_.live() * full_.block_bytes() + meta_.live() * sizeof(BlockHeader) +
                                (cap == 0 ? 0 : cap * (1 + sizeof(uint32_t)) + 16));
  }

  // Shrinks the index to its size when erasures left it over 4x too large (after a
  // spill), so the index does not hold on to one large batch's worth of slots.
  void ShrinkIndex() {
    if (index_.capacity() > 4 * index_.size() + 64) index_.rehash(0);
  }

  // A key's pins: how many are held, and the shard's Pin call that last pinned it.
  struct PinState {
    int32_t count;
    uint32_t last_pin;
  };

  // The SSD tier's state of this shard (guarded by the shard's lock): the keys pinned in
  // DRAM or pinned by one of the last few Pin calls (see Engine::kRecentPins), and what
  // the store holds of this shard's keys.
  struct Spilled {
    absl::flat_hash_map<int64_t, PinState> pins;
    uint32_t pin_calls = 0;
    size_t pins_after_prune = 0;
    int64_t blocks = 0, stored = 0, tracked = 0, bytes = 0;
    // Keys whose DRAM block was erased since the last Unpin (see Engine::EraseBlock): their
    // store entries, stale copies where there are any, are deleted with Unpin's batch.
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
  Spilled& spilled() { return spilled_; }
  const Spilled& spilled() const { return spilled_; }
  size_t full_block_bytes() const { return full_.block_bytes(); }

  int64_t stored() const { return full_.live(); }
  int64_t blocks() const { return full_.live() + meta_.live(); }
  int64_t& tracked() { return tracked_; }
  int64_t tracked() const { return tracked_; }

  // Bytes this shard holds resident: the arenas' used blocks and the index's backing
  // array (a control byte and a 4-byte ref per slot, plus absl's cloned control bytes,
  // all written when the array is made). Chunk tails never touched are left out: they
  // cost address space, not memory, so the figure follows the process's RSS.
  // An index no larger than an empty one's capacity has no backing array: 0 slots before
  // abseil's small-object optimisation, 1 slot held in the table itself with it (TF 2.21).
  size_t bytes_held() const {
    static const size_t inline_capacity = Index(0, RefHash{nullptr}, RefEq{nullptr}).capacity();
    const size_t cap = index_.capacity();
    const size_t index_bytes = cap <= inline_capacity ? 0 : cap * (1 + sizeof(uint32_t)) + 16;
    return full_.bytes_used() + meta_.bytes_used() + index_bytes;
  }

  template <typename F>
  void ForEach(F&& f) const {
    for (uint32_t ref : index_) f(ref);
  }

 private:
  uint32_t* FindOrAdd(int64_t key, bool full, bool* created) {
    Arena& arena = full ? full_ : meta_;
    arena.Reserve();  // before the index changes: a throw must leave no half-made entry
    if (created != nullptr) *created = false;
    auto it = index_.lazy_emplace(KeyProbe{key}, [&](const auto& construct) {
      const uint32_t i = arena.Allocate();
      reinterpret_cast<BlockHeader*>(arena.At(i))->Reset(key);
      if (created != nullptr) *created = true;
      construct(full ? i : (i | kMetaBit));
    });
    // Elements are const in a set, but a ref is hashed by the key in its block, which
    // moving the block between arenas keeps: rewriting it in place leaves the set valid.
    return const_cast<uint32_t*>(&*it);
  }

  struct KeyProbe {
    int64_t key;
  };
  struct PrefetchProbe {
    int64_t key;
    size_t bytes;
  };
  struct RefHash {
    using is_transparent = void;
    const Shard* shard;
    size_t operator()(uint32_t ref) const { return Fmix64(shard->Header(ref)->key); }
    size_t operator()(KeyProbe p) const { return Fmix64(static_cast<uint64_t>(p.key)); }
    size_t operator()(PrefetchProbe p) const { return Fmix64(static_cast<uint64_t>(p.key)); }
  };
  struct RefEq {
    using is_transparent = void;
    const Shard* shard;
    int64_t Key(uint32_t ref) const { return shard->Header(ref)->key; }
    static int64_t Key(KeyProbe p) { return p.key; }
    bool operator()(uint32_t a, uint32_t b) const { return Key(a) == Key(b); }
    bool operator()(uint32_t a, KeyProbe b) const { return Key(a) == b.key; }
    bool operator()(KeyProbe a, uint32_t b) const { return a.key == Key(b); }
    bool operator()(KeyProbe a, KeyProbe b) const { return a.key == b.key; }
    bool operator()(uint32_t ref, PrefetchProbe p) const { return Prefetch(ref, p.bytes); }
    bool operator()(PrefetchProbe p, uint32_t ref) const { return Prefetch(ref, p.bytes); }
    bool Prefetch(uint32_t ref, size_t bytes) const {
      PrefetchBytes(shard->Header(ref), bytes);
      return false;
    }
  };
  using Index = absl::flat_hash_set<uint32_t, RefHash, RefEq>;

  mutable std::shared_mutex mu_;
  Arena full_, meta_;
  Index index_;
  int64_t tracked_ = 0;
  Spilled spilled_;
};

// ------------------------------------------------------------------ the engine
// Every batch operation takes one shard and the positions of its keys in the batch
// arrays (Partition); callers run the shards in parallel, each shard's work under its
// own lock (the methods lock). Errors are returned as text ("" = fine).
class Engine {
 public:
  explicit Engine(const Config& c)
      : config_(c), num_slots_(NumSlots(c.optimizer)), init_(c) {
    shard_shift_ = 64;
    for (int s = c.num_shards; s > 1; s >>= 1) --shard_shift_;
    // Multiples of 4, the header's alignment: a bfloat16 row is padded to it.
    row_bytes_ = c.bf16_rows ? (sizeof(uint16_t) * c.dim + 3) / 4 * 4 : sizeof(float) * c.dim;
    block_bytes_ = sizeof(BlockHeader) + row_bytes_ + sizeof(float) * c.dim * num_slots_;
    for (int s = 0; s < c.num_shards; ++s) shards_.emplace_back(new Shard(block_bytes_));
  }

  const Config& config() const { return config_; }
  int dim() const { return config_.dim; }
  int num_slots() const { return num_slots_; }
  int num_shards() const { return config_.num_shards; }
  const RowInitializer& initializer() const { return init_; }

  int ShardOf(int64_t key) const {
    return shard_shift_ == 64 ? 0 : static_cast<int>(Fmix64(static_cast<uint64_t>(key)) >> shard_shift_);
  }

  // Counting sort of positions 0..n-1 by the shard of keys[i]; stable. The keys are cut
  // into `parts` contiguous ranges that `run` counts and then scatters, possibly in
  // parallel: each range writes its own slice of every shard's list, so no two ranges
  // write one place, and each shard's positions stay in increasing order. A serial
  // partition took 11-19% of an update's wall time at 16 threads.
  Partition PartitionKeys(const int64_t* keys, int64_t n, int parts = 1,
                          const ParallelParts& run = RunSerially) const {
    Partition p;
    const int S = num_shards();
    parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(parts, n / kMinKeysPerPart)));
    auto range = [n, parts](int q) {
      return std::make_pair(n * q / parts, n * (q + 1) / parts);
    };
    std::vector<int32_t> shard(n);
    std::vector<int64_t> next(static_cast<size_t>(parts) * S, 0);  // counts, then offsets
    run(parts, [&](int q) {
      int64_t* count = next.data() + static_cast<size_t>(q) * S;
      for (int64_t i = range(q).first; i < range(q).second; ++i) ++count[shard[i] = ShardOf(keys[i])];
    });
    p.begin.assign(S + 1, 0);
    int64_t total = 0;
    for (int s = 0; s < S; ++s) {
      p.begin[s] = total;
      for (int q = 0; q < parts; ++q) {
        const int64_t count = next[static_cast<size_t>(q) * S + s];
        next[static_cast<size_t>(q) * S + s] = total;
        total += count;
      }
    }
    p.begin[S] = total;
    p.order.resize(n);
    run(parts, [&](int q) {
      int64_t* at = next.data() + static_cast<size_t>(q) * S;
      for (int64_t i = range(q).first; i < range(q).second; ++i) {
        p.order[at[shard[i]]++] = static_cast<int32_t>(i);
      }
    });
    return p;
  }

  // Rows of keys (float[n, dim] at out); a key without a stored row gets its initial row
  // from init_keys and is NOT inserted.
  void Lookup(int s, Span pos, const int64_t* keys, const int64_t* init_keys, float* out) const {
    const Shard& sh = *shards_[s];
    std::shared_lock<std::shared_mutex> lock(sh.mutex());
    const int d = dim();
    Prefetched(sh, pos, keys, sizeof(BlockHeader) + row_bytes_, [&](int32_t i) {
      const uint32_t* ref = sh.Find(keys[i]);
      if (ref != nullptr && Shard::IsStored(*ref)) {
        LoadRow(sh.Header(*ref), out + int64_t{i} * d);
      } else {
        InitialRow(init_keys[i], out + int64_t{i} * d);
      }
    }, out);
  }

  // One optimizer step per key (keys unique): read row and slots (stored, or initial),
  // update, write back, in one pass; new keys are inserted. With admission
  // (num_tables > 0), a key with no stored row whose statistics are tracked with a count
  // below min_counts[its table] is not stored, and out gets its unchanged initial row.
  // out: the rows after the step, float[n, dim].
  std::string ApplyGradients(int s, Span pos, const int64_t* keys, const int64_t* init_keys,
                             const float* grads, const StepConstants& step,
                             const int64_t* min_counts, int num_tables, float* out) {
    Shard& sh = *shards_[s];
    std::unique_lock<std::shared_mutex> lock(sh.mutex());
    const int d = dim();
    std::string error;
    Prefetched(sh, pos, keys, block_bytes_, [&](int32_t i) {
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
            InitialRow(init_keys[i], row_out);
            return;
          }
        }
        h = sh.Promote(ref);
        created = true;
      }
      if (created) InitRowAndSlots(h, init_keys[i], row_out);
      const float* g = grads + int64_t{i} * d;
      if (!config_.bf16_rows) {  // in place
        float* row = FloatRow(h);
        ApplyOptimizer(config_, step, row, Slots(h), g);
        CopyFloats(row, d, row_out);
      } else {  // on the float32 row in row_out; out gets the stored, rounded row
        LoadRow(h, row_out);
        ApplyOptimizer(config_, step, row_out, Slots(h), g);
        StoreRow(row_out, h);
        LoadRow(h, row_out);
      }
    }, grads, out);
    return error;
  }

  // Adds access statistics: creates a tracked (meta) block for a new key, adds counts,
  // sets (table, id) and the last step (see RecordArgs).
  std::string Record(int s, Span pos, const RecordArgs& a) {
    Shard& sh = *shards_[s];
    std::unique_lock<std::shared_mutex> lock(sh.mutex());
    std::string error;
    Prefetched(sh, pos, a.keys, sizeof(BlockHeader), [&](int32_t i) {
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
  void Find(int s, Span pos, const int64_t* keys, KeyFields* out) const {
    const Shard& sh = *shards_[s];
    std::shared_lock<std::shared_mutex> lock(sh.mutex());
    Prefetched(sh, pos, keys, sizeof(BlockHeader), [&](int32_t i) {
      const uint32_t* ref = sh.Find(keys[i]);
      out[i] = ref == nullptr ? KeyFields{false, -1, 0, 0, 0} : Fields(sh, *ref);
    });
  }

  // Rows and slots of stored keys (float[n, dim] and float[n, num_slots, dim]); an error
  // names a key without a stored row.
  std::string GatherRows(int s, Span pos, const int64_t* keys, float* values, float* slots) const {
    const Shard& sh = *shards_[s];
    std::shared_lock<std::shared_mutex> lock(sh.mutex());
    const int64_t d = dim(), sd = num_slots_ * d;
    for (int64_t k = 0; k < pos.size; ++k) {
      const int32_t i = pos.data[k];
      const uint32_t* ref = sh.Find(keys[i]);
      if (ref == nullptr || !Shard::IsStored(*ref)) {
        return "key " + std::to_string(keys[i]) + " has no stored row";
      }
      BlockHeader* h = sh.Header(*ref);
      LoadRow(h, values + i * d);
      CopyFloats(Slots(h), sd, slots + i * sd);  // sd may be 0 with a null slots array
    }
    return "";
  }

  // Stores rows and slots (float[n, dim], float[n, num_slots, dim]) of keys; statistics
  // are left as they are.
  void WriteRows(int s, Span pos, const int64_t* keys, const float* values, const float* slots) {
    Shard& sh = *shards_[s];
    std::unique_lock<std::shared_mutex> lock(sh.mutex());
    const int64_t d = dim(), sd = num_slots_ * d;
    for (int64_t k = 0; k < pos.size; ++k) {
      const int32_t i = pos.data[k];
      bool created;
      uint32_t* ref = sh.FindOrAddFull(keys[i], &created);
      BlockHeader* h = Shard::IsStored(*ref) ? sh.Header(*ref) : sh.Promote(ref);
      StoreRow(values + i * d, h);
      CopyFloats(slots + i * sd, sd, Slots(h));  // sd may be 0, slots null
    }
  }

  // Drops the rows (and slots) of keys; their statistics stay. Absent keys are ignored.
  void RemoveRows(int s, Span pos, const int64_t* keys) {
    Shard& sh = *shards_[s];
    std::unique_lock<std::shared_mutex> lock(sh.mutex());
    for (int64_t k = 0; k < pos.size; ++k) {
      const int64_t key = keys[pos.data[k]];
      const uint32_t* found = sh.Find(key);
      if (found == nullptr || !Shard::IsStored(*found)) continue;
      uint32_t* ref = const_cast<uint32_t*>(found);  // see FindOrAdd
      if (sh.Header(*ref)->tracked()) {
        sh.Demote(ref);
      } else {
        EraseBlock(sh, key);
      }
    }
  }

  // Forgets the statistics of keys (count, identity, last step); their rows stay.
  void Forget(int s, Span pos, const int64_t* keys) {
    Shard& sh = *shards_[s];
    std::unique_lock<std::shared_mutex> lock(sh.mutex());
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
        EraseBlock(sh, key);
      }
    }
  }

  // Every block of both tiers (stored_only: only those with a row), unsorted; rows and
  // slots appended to values/slots when they are non-null (zeros for a block without a
  // row). Holds every shard's lock for the whole export, so no block moves between the
  // tiers meanwhile (it would be exported twice or not at all).
  std::string Export(bool stored_only, std::vector<int64_t>* keys, std::vector<KeyFields>* fields,
                     std::vector<float>* values, std::vector<float>* slots) const {
    std::vector<std::shared_lock<std::shared_mutex>> locks;
    for (const auto& sh : shards_) locks.emplace_back(sh->mutex());
    for (const auto& sh : shards_) {
      sh->ForEach([&](uint32_t ref) {
        if (stored_only && !Shard::IsStored(ref)) return;
        const BlockHeader* h = sh->Header(ref);
        AppendBlock(h, Fields(*sh, ref), keys, fields, values, slots);
      });
    }
    if (store_ == nullptr) return "";
    return store_->ForEach([&](int64_t key, const char* data, size_t size) {
      if (shards_[ShardOf(key)]->Find(key) != nullptr) return;  // a stale copy: see Pin
      const bool stored = size == block_bytes_;
      if (stored_only && !stored) return;
      const BlockHeader* h = reinterpret_cast<const BlockHeader*>(data);
      AppendBlock(h, HeaderFields(*h, stored), keys, fields, values, slots);
    });
  }

  // ------------------------------------------------------------------ the SSD tier
  // With a store attached, at most `budget_bytes` of blocks and index stay in DRAM
  // (budget_bytes / num_shards per shard); the others are in the store, whole. Every batch
  // operation runs between Pin and Unpin of its keys: Pin reads the keys' blocks back
  // from the store (one MultiGet per shard) and keeps them in DRAM until Unpin; Unpin
  // spills the least recently used unpinned blocks while the shard is over its share
  // (one WriteBatch). The operations themselves only ever see DRAM blocks, so moves
  // between the tiers cannot change a result. Call before any other use.
  void AttachStore(std::unique_ptr<BlockStore> store, int64_t budget_bytes) {
    store_ = std::move(store);
    shard_budget_ = std::max<int64_t>(0, budget_bytes / num_shards());
  }
  bool tiered() const { return store_ != nullptr; }
  const BlockStore* store() const { return store_.get(); }

  // Brings the blocks of the keys at `pos` into DRAM and pins them there (a count per key:
  // a prefetch and the step's own operation may pin the same key). Keys in neither tier
  // stay absent. On an error the pins are still taken: Unpin releases them.
  std::string Pin(int s, Span pos, const int64_t* keys) {
    Shard& sh = *shards_[s];
    std::unique_lock<std::shared_mutex> lock(sh.mutex());
    std::vector<int64_t> missing;
    const uint32_t call = ++sh.spilled().pin_calls;
    for (int64_t k = 0; k < pos.size; ++k) {
      const int64_t key = keys[pos.data[k]];
      Shard::PinState& pin = sh.spilled().pins.try_emplace(key, Shard::PinState{0, call}).first->second;
      pin.last_pin = call;
      if (++pin.count == 1 && sh.Find(key) == nullptr) missing.push_back(key);
    }
    if (missing.empty() || sh.spilled().blocks == 0) return "";
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
      sh.spilled().Add(*h, blocks[i].size(), blocks[i].size() == block_bytes_, -1);
      sh.spilled().io[0] += 1;
      sh.spilled().io[1] += static_cast<int64_t>(blocks[i].size());
    }
    return "";
  }

  // Releases Pin's pins of the keys at `pos`, then spills while the shard is over budget
  // (and deletes the store entries of blocks erased meanwhile, in the same batch).
  std::string Unpin(int s, Span pos, const int64_t* keys) {
    Shard& sh = *shards_[s];
    std::unique_lock<std::shared_mutex> lock(sh.mutex());
    auto& pins = sh.spilled().pins;
    for (int64_t k = 0; k < pos.size; ++k) {
      auto it = pins.find(keys[pos.data[k]]);
      if (it != pins.end() && it->second.count > 0) --it->second.count;
    }
    PrunePins(&sh.spilled());
    return Spill(sh);
  }

  // ------------------------------------------------------------------ checkpoints
  // Writes every block of both tiers to `dir`: a tiered engine through its store's own
  // checkpoint (the SSD tier's files linked, the DRAM tier's blocks written over them),
  // an engine without a store through `write_new` (a new checkpoint of the blocks alone:
  // the caller's store format, which this header does not know). The blocks are written
  // from the arenas, never copied whole. Holds every shard's lock meanwhile, so no block
  // moves between the tiers or changes.
  using CheckpointWriter =
      std::function<std::string(const std::string& dir, std::vector<BlockRef> blocks)>;
  std::string WriteCheckpoint(const std::string& dir, const CheckpointWriter& write_new) const {
    std::vector<std::shared_lock<std::shared_mutex>> locks;
    for (const auto& sh : shards_) locks.emplace_back(sh->mutex());
    std::vector<BlockRef> dram;
    for (const auto& sh : shards_) {
      sh->ForEach([&](uint32_t ref) {
        const BlockHeader* h = sh->Header(ref);
        dram.push_back({h->key, reinterpret_cast<const char*>(h),
                        Shard::IsStored(ref) ? block_bytes_ : sizeof(BlockHeader)});
      });
    }
    return store_ != nullptr ? store_->Checkpoint(dir, std::move(dram))
                             : write_new(dir, std::move(dram));
  }

  // Puts whole blocks, as a checkpoint holds them, in place of the blocks of keys:
  // blocks[i] is keys[i]'s. Run between Pin and Unpin (each key in DRAM or absent). An
  // error names a block of another engine's size (another dim or optimizer).
  std::string PutBlocks(int s, Span pos, const int64_t* keys, const std::string* blocks) {
    Shard& sh = *shards_[s];
    std::unique_lock<std::shared_mutex> lock(sh.mutex());
    for (int64_t k = 0; k < pos.size; ++k) {
      const int32_t i = pos.data[k];
      const std::string& block = blocks[i];
      if (block.size() != block_bytes_ && block.size() != sizeof(BlockHeader)) {
        return "the block of key " + std::to_string(keys[i]) + " has " +
               std::to_string(block.size()) + " bytes; this engine's blocks have " +
               std::to_string(block_bytes_) + " (or " + std::to_string(sizeof(BlockHeader)) +
               " without a row)";
      }
      int64_t key;
      std::memcpy(&key, block.data(), sizeof(key));
      if (key != keys[i]) {
        return "the block stored under key " + std::to_string(keys[i]) + " holds key " +
               std::to_string(key);
      }
      if (const uint32_t* ref = sh.Find(key)) {
        if (sh.Header(*ref)->tracked()) --sh.tracked();
        EraseBlock(sh, key);
      }
      sh.Adopt(block);
    }
    return "";
  }

  // Counts over both tiers; bytes_held is DRAM, ssd_bytes the blocks in the store.
  struct Sizes {
    int64_t stored = 0, tracked = 0, blocks = 0;
    int64_t bytes_held = 0, ssd_bytes = 0;
    int64_t ssd_io[4] = {0, 0, 0, 0};  // Shard::Spilled::io summed
  };
  Sizes Size() const {
    Sizes z;
    for (const auto& sh : shards_) {
      std::shared_lock<std::shared_mutex> lock(sh->mutex());
      z.stored += sh->stored();
      z.tracked += sh->tracked();
      z.blocks += sh->blocks();
      z.bytes_held += static_cast<int64_t>(sh->bytes_held());
      const Shard::Spilled& ssd = sh->spilled();
      z.stored += ssd.stored;
      z.tracked += ssd.tracked;
      z.blocks += ssd.blocks;
      z.ssd_bytes += ssd.bytes;
      for (int i = 0; i < 4; ++i) z.ssd_io[i] += ssd.io[i];
    }
    return z;
  }

 private:
  // Runs work(i) for the batch positions i of `pos` in order, with the index probe of the
  // key kIndexAhead positions later and the block of the key kBlockAhead later prefetched
  // (their first `bytes`). Why: in a table larger than the cache each key costs two
  // dependent misses (index slot, then block); issued ahead, they overlap. The prefetches
  // only read, between the work's own (possibly inserting) calls on the same thread.
  // `rows_a`, `rows_b` (may be null): batch arrays of `width` floats per position whose
  // rows are prefetched too (a shard's positions stride through them, 1/S-th apart).
  template <typename F>
  void Prefetched(const Shard& sh, Span pos, const int64_t* keys, size_t bytes, F&& work,
                  const float* rows_a = nullptr, const float* rows_b = nullptr) const {
    constexpr int64_t kIndexAhead = 16, kBlockAhead = 8;
    const size_t row_bytes = sizeof(float) * dim();
    for (int64_t k = 0; k < pos.size; ++k) {
      if (k + kIndexAhead < pos.size) sh.PrefetchIndex(keys[pos.data[k + kIndexAhead]]);
      if (k + kBlockAhead < pos.size) {
        const int64_t i = pos.data[k + kBlockAhead];
        sh.PrefetchBlock(keys[i], bytes);
        if (rows_a != nullptr) PrefetchBytes(rows_a + i * dim(), row_bytes);
        if (rows_b != nullptr) PrefetchBytes(rows_b + i * dim(), row_bytes);
      }
      work(pos.data[k]);
    }
  }

  static KeyFields Fields(const Shard& sh, uint32_t ref) {
    return HeaderFields(*sh.Header(ref), Shard::IsStored(ref));
  }

  static KeyFields HeaderFields(const BlockHeader& h, bool stored) {
    return {stored, h.tracked() ? static_cast<int32_t>(h.table()) : -1, h.id,
            static_cast<int64_t>(h.count()), h.last_step};
  }

  // Export's output for one block (its row and slots follow the header when `stored`).
  void AppendBlock(const BlockHeader* h, const KeyFields& f, std::vector<int64_t>* keys,
                   std::vector<KeyFields>* fields, std::vector<float>* values,
                   std::vector<float>* slots) const {
    const int64_t d = dim(), sd = num_slots_ * d;
    keys->push_back(h->key);
    fields->push_back(f);
    if (values == nullptr) return;
    if (f.stored) {
      values->resize(values->size() + d);
      LoadRow(h, values->data() + values->size() - d);
      const float* slot = Slots(h);
      slots->insert(slots->end(), slot, slot + sd);
    } else {
      values->resize(values->size() + d, 0.0f);
      slots->resize(slots->size() + sd, 0.0f);
    }
  }

  // Pin calls per shard during which a key stays a late victim after its pins are
  // released: a training step pins its keys in several calls (lookup, statistics, update),
  // and the header's last step only advances at the statistics, so without this the
  // lookup's blocks would be spilled before the update reads them again.
  static constexpr uint32_t kRecentPins = 4;

  // Forgets unpinned keys pinned longer than kRecentPins calls ago, once the map has
  // doubled since the last time (so its size stays within a few batches' keys, at an
  // amortized constant cost per pin).
  static void PrunePins(Shard::Spilled* t) {
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
  // then the least recently seen (the header's last step, which the statistics advance
  // on every access), then the least counted: a block seen long ago and rarely is the
  // one least likely to be needed by the next batches.
  std::string Spill(Shard& sh) {
    std::vector<int64_t>& erased = sh.spilled().erased;
    const bool over = sh.live_bytes() > shard_budget_;
    if (!over && erased.empty()) return "";
    std::vector<BlockRef> victims;
    if (over) victims = Victims(sh, shard_budget_ - shard_budget_ / 10);
    std::string error = store_->Write(victims, erased);
    if (!error.empty()) return error;  // nothing erased: every block still in DRAM
    erased.clear();
    auto& pins = sh.spilled().pins;
    for (const BlockRef& v : victims) {
      pins.erase(v.key);
      const BlockHeader* h = reinterpret_cast<const BlockHeader*>(v.data);
      sh.spilled().Add(*h, v.size, v.size == block_bytes_, +1);
      sh.spilled().io[2] += 1;
      sh.spilled().io[3] += static_cast<int64_t>(v.size);
      if (h->tracked()) --sh.tracked();
      sh.Erase(v.key);
    }
    sh.ShrinkIndex();
    return "";
  }

  // The blocks to spill to bring `sh` to `target` bytes, in victim order (see Spill).
  std::vector<BlockRef> Victims(const Shard& sh, int64_t target) const {
    struct Candidate {
      bool recent;
      int32_t last_step;
      uint64_t count;
      uint32_t ref;
      bool operator<(const Candidate& o) const {
        if (recent != o.recent) return !recent;
        return last_step != o.last_step ? last_step < o.last_step : count < o.count;
      }
    };
    std::vector<Candidate> candidates;
    const auto& pins = sh.spilled().pins;
    const uint32_t now = sh.spilled().pin_calls;
    sh.ForEach([&](uint32_t ref) {
      const BlockHeader* h = sh.Header(ref);
      auto it = pins.find(h->key);
      if (it != pins.end() && it->second.count > 0) return;  // pinned: stays
      const bool recent = it != pins.end() && now - it->second.last_pin < kRecentPins;
      candidates.push_back({recent, h->last_step, h->count(), ref});
    });
    std::sort(candidates.begin(), candidates.end());
    std::vector<BlockRef> victims;
    int64_t bytes = sh.live_bytes();
    for (const Candidate& c : candidates) {
      if (bytes <= target) break;
      const size_t size = Shard::IsStored(c.ref) ? block_bytes_ : sizeof(BlockHeader);
      const BlockHeader* h = sh.Header(c.ref);
      victims.push_back({h->key, reinterpret_cast<const char*>(h), size});
      bytes -= static_cast<int64_t>(size);
    }
    return victims;
  }

  // Erases key's block in DRAM other than by a spill; with a store, Unpin deletes the
  // store's entry too (a stale copy of a block read back, see Pin), so the key does not
  // come back from it.
  void EraseBlock(Shard& sh, int64_t key) {
    sh.Erase(key);
    if (store_ != nullptr) sh.spilled().erased.push_back(key);
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

  // ---- a block's row and slots (the row float32 or bfloat16, see Config::bf16_rows)
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

  Config config_;
  int num_slots_;
  int shard_shift_;
  size_t row_bytes_;
  size_t block_bytes_;
  RowInitializer init_;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::unique_ptr<BlockStore> store_;  // the SSD tier; null: every block in DRAM
  int64_t shard_budget_ = 0;           // DRAM bytes per shard with a store
};

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_EMBEDDING_ENGINE_H_
