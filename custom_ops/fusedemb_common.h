// Shared helpers of the tf_fusedemb kernels: the one owner hash, category tags and a
// small open-addressing index map used by every "unique" in the library.
#ifndef TF_FUSEDEMB_COMMON_H_
#define TF_FUSEDEMB_COMMON_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"

namespace tensorflow {
namespace fusedemb {

// MurmurHash3's fmix64 finaliser: a bijection on 64-bit words with full avalanche.
// It is THE hash of tf_fusedemb: owners, category keys and hash-map slots all use it,
// and the Python side (tf_fusedemb.ops.hashing) mirrors it bit for bit.
inline uint64_t Mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

// Owner rank of an instance ID: Mix64(uint64(id)) mod num_ranks. Depends on the ID
// only, so equal IDs of different categories (a0, b0) go to the same rank.
inline int32_t OwnerRank(int64_t id, int32_t num_ranks) {
  return static_cast<int32_t>(Mix64(static_cast<uint64_t>(id)) %
                              static_cast<uint64_t>(num_ranks));
}

// 64-bit tag of a category name: Mix64(FNV-1a-64(utf8 bytes)).
inline uint64_t CategoryTag(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return Mix64(h);
}

// Hashed unified key H(category, id) = Mix64(uint64(id) XOR tag). Bijective in id for a
// fixed category, so two IDs of one category never collide; ids x of a and y of b
// collide exactly when x XOR y == tag(a) XOR tag(b).
inline int64_t HashedUnifiedKey(int64_t id, uint64_t tag) {
  return static_cast<int64_t>(Mix64(static_cast<uint64_t>(id) ^ tag));
}

// Open-addressing (linear probing) map from a 64-bit key to a dense index assigned in
// first-insertion order. Slots use the high bits of Mix64(key ^ salt): the salt
// decorrelates slots from owner ranks (low bits of Mix64(key)), which are all equal
// for the keys one rank receives.
class IndexMap {
 public:
  explicit IndexMap(int64_t expected) { Reset(expected); }

  void Reset(int64_t expected) {
    int64_t cap = 16;
    while (cap < 2 * expected) cap <<= 1;
    Allocate(cap);
    size_ = 0;
  }

  int64_t size() const { return size_; }

  // Returns the index of `key`, inserting it with index size() if absent.
  // `*inserted` tells which happened.
  int32_t FindOrInsert(int64_t key, bool* inserted) {
    if (2 * (size_ + 1) > static_cast<int64_t>(slots_.size())) Grow();
    uint64_t pos = SlotOf(key);
    while (true) {
      Slot& s = slots_[pos];
      if (s.index < 0) {
        s.key = key;
        s.index = static_cast<int32_t>(size_++);
        *inserted = true;
        return s.index;
      }
      if (s.key == key) {
        *inserted = false;
        return s.index;
      }
      pos = (pos + 1) & mask_;
    }
  }

 private:
  struct Slot {
    int64_t key;
    int32_t index;
  };

  uint64_t SlotOf(int64_t key) const {
    return Mix64(static_cast<uint64_t>(key) ^ 0x5851f42d4c957f2dULL) >> shift_;
  }

  void Allocate(int64_t cap) {
    slots_.assign(cap, Slot{0, -1});
    mask_ = cap - 1;
    shift_ = 64;
    for (int64_t c = cap; c > 1; c >>= 1) --shift_;
  }

  void Grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    Allocate(static_cast<int64_t>(old.size()) * 2);
    for (const Slot& s : old) {
      if (s.index < 0) continue;
      uint64_t pos = SlotOf(s.key);
      while (slots_[pos].index >= 0) pos = (pos + 1) & mask_;
      slots_[pos] = s;
    }
  }

  std::vector<Slot> slots_;
  uint64_t mask_ = 0;
  int shift_ = 64;
  int64_t size_ = 0;
};

// Validates row-splits: rank 1, at least one entry, starts at 0, non-decreasing, ends at n.
inline Status ValidateSplits(const Tensor& splits, int64_t n, const char* name) {
  if (splits.dims() != 1 || splits.NumElements() < 1) {
    return errors::InvalidArgument(name, " must be a vector of at least one element, got shape ",
                                   splits.shape().DebugString());
  }
  auto s = splits.flat<int64_t>();
  const int64_t m = s.size() - 1;
  if (s(0) != 0) return errors::InvalidArgument(name, "[0] must be 0, got ", s(0));
  for (int64_t i = 0; i < m; ++i) {
    if (s(i + 1) < s(i)) {
      return errors::InvalidArgument(name, " must be non-decreasing, but ", name, "[", i + 1,
                                     "] = ", s(i + 1), " < ", name, "[", i, "] = ", s(i));
    }
  }
  if (s(m) != n) {
    return errors::InvalidArgument(name, "[-1] = ", s(m), " must equal the number of keys ", n);
  }
  return OkStatus();
}

inline Status ValidateVector(const Tensor& t, const char* name) {
  if (t.dims() != 1) {
    return errors::InvalidArgument(name, " must be a vector, got shape ", t.shape().DebugString());
  }
  if (t.NumElements() > INT32_MAX) {
    return errors::InvalidArgument(name, " has ", t.NumElements(),
                                   " elements; int32 indices allow at most 2^31-1");
  }
  return OkStatus();
}

}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_COMMON_H_
