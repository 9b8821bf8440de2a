// The index of one shard: from a key to the ref of its block (engine_blocks.h).
//
// An absl::flat_hash_set<uint32_t ref> whose hash and equality are transparent and read
// the key from the block: a 4-byte entry and 1 control byte per slot, and no key stored
// twice. Owns its backing array (capacity 2^k - 1 slots, at most 7/8 full) and nothing
// else; the blocks it names belong to the shard's Blocks, which must outlive it.
//
// Part of the engine that embedding_engine.h composes; plain C++17 + absl (the copy
// TensorFlow ships and exports from libtensorflow_framework.so.2).
#ifndef TF_FUSEDEMB_ENGINE_INDEX_H_
#define TF_FUSEDEMB_ENGINE_INDEX_H_

#include <cstddef>
#include <cstdint>

// prefetch.h first: raw_hash_set's prefetch() prefetches the probe group only where
// ABSL_HAVE_PREFETCH is already defined.
#include "absl/base/prefetch.h"
#include "absl/container/flat_hash_set.h"
#include "engine_blocks.h"
#include "engine_config.h"

namespace tensorflow {
namespace fusedemb {
namespace engine {

// The index's hash of a key. absl takes a slot's 7-bit tag (H2) from the top 7 bits of
// the hash and the probe's start (H1) from the low bits; the shard of a key is the top
// log2(num_shards) bits of Fmix64(key), so with 16 shards every key of a shard shares 4 of
// the 7 tag bits of Fmix64 itself. A probe then matched about 1.2 wrong slots per lookup
// at the index's usual load, each a block read (a cache miss) to reject, and a block
// prefetch wasted. Multiplying by an odd constant (a bijection) brings every bit of the
// hash into the top 7; the low bits, H1, depend on the same low bits as before.
inline uint64_t IndexHash(int64_t key) {
  return Fmix64(static_cast<uint64_t>(key)) * 0x9E3779B97F4A7C15ULL;
}

// The index's allocator: backing arrays from MapPages, so the array a resize frees goes
// back to the kernel at once instead of staying in the heap.
template <typename T>
struct PageAllocator {
  using value_type = T;
  PageAllocator() = default;
  template <typename U>
  PageAllocator(const PageAllocator<U>&) {}  // NOLINT: rebinding, as std::allocator
  T* allocate(size_t n) { return static_cast<T*>(MapPages(n * sizeof(T))); }
  void deallocate(T* p, size_t n) { UnmapPages(p, n * sizeof(T)); }
  template <typename U>
  bool operator==(const PageAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const PageAllocator<U>&) const { return false; }
};

class BlockIndex {
 public:
  explicit BlockIndex(const Blocks* blocks) : set_(0, RefHash{blocks}, RefEq{blocks}) {}
  BlockIndex(const BlockIndex&) = delete;
  BlockIndex& operator=(const BlockIndex&) = delete;

  // Cache prefetches: the probe group of `key` (control bytes and slots).
  void Prefetch(int64_t key) const { set_.prefetch(KeyProbe{key}); }
  // A find() whose equality never matches but prefetches the first `bytes` of each
  // candidate's block: it walks the probe sequence like a miss, touching only the index,
  // so it never waits for a block (a real find would read the key in the block, the very
  // miss to hide).
  void PrefetchBlock(int64_t key, size_t bytes) const { set_.find(PrefetchProbe{key, bytes}); }

  // The ref of `key`, or nullptr when it has no block.
  const uint32_t* Find(int64_t key) const {
    auto it = set_.find(KeyProbe{key});
    return it == set_.end() ? nullptr : &*it;
  }

  // The ref of `key`; for a key without one, make() (which returns a new block's ref,
  // its header already naming `key`) is inserted.
  template <typename Make>
  uint32_t* FindOrInsert(int64_t key, Make&& make) {
    auto it = set_.lazy_emplace(KeyProbe{key}, [&](const auto& construct) { construct(make()); });
    // Elements are const in a set, but a ref is hashed by the key in its block, which
    // moving the block between arenas keeps: rewriting it in place leaves the set valid.
    return const_cast<uint32_t*>(&*it);
  }

  // Removes `key`; its ref at *ref. False if it had none.
  bool Erase(int64_t key, uint32_t* ref) {
    auto it = set_.find(KeyProbe{key});
    if (it == set_.end()) return false;
    *ref = *it;
    set_.erase(it);
    return true;
  }

  size_t size() const { return set_.size(); }
  size_t capacity() const { return set_.capacity(); }

  // Bytes of the backing array, as a memory budget counts them.
  size_t budget_bytes() const {
    const size_t cap = set_.capacity();
    return cap == 0 ? 0 : cap * (1 + sizeof(uint32_t)) + 16;
  }

  // Bytes of the backing array the process holds resident (a control byte and a 4-byte
  // ref per slot, plus absl's cloned control bytes, all written when the array is made).
  // An index no larger than an empty one's capacity has no backing array: 0 slots before
  // abseil's small-object optimisation, 1 slot held in the table itself with it (TF 2.21).
  size_t bytes_held() const {
    static const size_t inline_capacity = Set(0, RefHash{nullptr}, RefEq{nullptr}).capacity();
    const size_t cap = set_.capacity();
    return cap <= inline_capacity ? 0 : cap * (1 + sizeof(uint32_t)) + 16;
  }

  // Shrinks the backing array to the size when erasures left it over 4x too large (after
  // a spill), so the index does not hold on to one large batch's worth of slots.
  void ShrinkIfSparse() {
    if (set_.capacity() > 4 * set_.size() + 64) set_.rehash(0);
  }

  template <typename F>
  void ForEach(F&& f) const {
    for (uint32_t ref : set_) f(ref);
  }

 private:
  struct KeyProbe {
    int64_t key;
  };
  struct PrefetchProbe {
    int64_t key;
    size_t bytes;
  };
  struct RefHash {
    using is_transparent = void;
    const Blocks* blocks;
    size_t operator()(uint32_t ref) const { return IndexHash(blocks->Header(ref)->key); }
    size_t operator()(KeyProbe p) const { return IndexHash(p.key); }
    size_t operator()(PrefetchProbe p) const { return IndexHash(p.key); }
  };
  struct RefEq {
    using is_transparent = void;
    const Blocks* blocks;
    int64_t Key(uint32_t ref) const { return blocks->Header(ref)->key; }
    bool operator()(uint32_t a, uint32_t b) const { return Key(a) == Key(b); }
    bool operator()(uint32_t a, KeyProbe b) const { return Key(a) == b.key; }
    bool operator()(KeyProbe a, uint32_t b) const { return a.key == Key(b); }
    bool operator()(KeyProbe a, KeyProbe b) const { return a.key == b.key; }
    bool operator()(uint32_t ref, PrefetchProbe p) const { return Prefetch(ref, p.bytes); }
    bool operator()(PrefetchProbe p, uint32_t ref) const { return Prefetch(ref, p.bytes); }
    bool Prefetch(uint32_t ref, size_t bytes) const {
      PrefetchBytes(blocks->Header(ref), bytes);
      return false;
    }
  };
  using Set = absl::flat_hash_set<uint32_t, RefHash, RefEq, PageAllocator<uint32_t>>;

  Set set_;
};

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_ENGINE_INDEX_H_
