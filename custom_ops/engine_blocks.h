// Blocks and arenas: where a key's bytes live. A block is a 28-byte BlockHeader (key,
// identity, access statistics), followed in a "full" block by the row and the optimizer
// slots (their format: engine_rows.h). A key whose statistics are tracked but whose row is
// not stored (admission has not let it in yet) has a header-only "meta" block: tracking a
// rare key costs 28 bytes, not a whole row.
//
// Owns the memory of the blocks: two chunked arenas per shard (Blocks), one of full and
// one of meta blocks. Chunks are never moved or reallocated, so growth never moves a row;
// removed blocks go on an intrusive free list. A block is named by a 32-bit ref whose top
// bit says which arena: the index (engine_index.h) stores refs, never pointers.
//
// Part of the engine that embedding_engine.h composes; plain C++17, no TensorFlow header.
#ifndef TF_FUSEDEMB_ENGINE_BLOCKS_H_
#define TF_FUSEDEMB_ENGINE_BLOCKS_H_

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

namespace tensorflow {
namespace fusedemb {
namespace engine {

// Prefetches the cache line of p. An asm statement, not __builtin_prefetch: the compiler
// may delete a loop whose only effect is a builtin prefetch (BlockIndex::PrefetchBlock's
// find()).
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

// Memory for blocks and index arrays, straight from the kernel: `bytes` of fresh pages,
// resident only once written, and handed back (munmap) when freed, never kept by malloc.
// Why: from malloc, a large array may come out of memory already resident (a step's freed
// tensors), so an arena chunk's untouched tail is resident too, and the index's array
// that each resize frees stays in the heap.
inline void* MapPages(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  return p;
}

inline void UnmapPages(void* p, size_t bytes) { munmap(p, bytes); }

// The identity and statistics of a key, followed by row and slots in full blocks.
// 28 bytes, 4-byte aligned (packed): the last step is an int32 (a step count past 2^31
// is refused, not wrapped), and blocks need no padding to 8 bytes. At 10M rows of dim
// 16 with Adagrad the 4 bytes are what keeps a row under 170 bytes of RSS.
struct __attribute__((packed, aligned(4))) BlockHeader {
  static constexpr uint64_t kCountBits = 48;
  static constexpr uint64_t kMaxCount = (uint64_t{1} << kCountBits) - 1;
  static constexpr uint32_t kNoTable = 0xFFFF;  // not tracked: no identity recorded
  // count_table of a freed block (Blocks marks it), so a scan of the arenas in address
  // order can skip the freed blocks without an index probe each. No live block the engine
  // makes has it (Record sets a table below kNoTable; an untracked block's count is 0); a
  // forged one adopted from a checkpoint would only be skipped by the SSD tier's victim
  // scan, staying in DRAM.
  static constexpr uint64_t kFreed = ~uint64_t{0};

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
  bool freed() const { return count_table == kFreed; }
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
    for (size_t c = 0; c < chunks_.size(); ++c) UnmapPages(chunks_[c], ChunkBytes(c));
  }

  size_t block_bytes() const { return block_bytes_; }
  // Bytes of the chunks (address space; a chunk's untouched tail is not resident).
  size_t bytes_allocated() const { return bytes_allocated_; }
  // Bytes of the blocks ever handed out: blocks are used in address order, so this is
  // what the process holds resident for the arena (freed blocks stay resident for reuse).
  size_t bytes_used() const { return static_cast<size_t>(end_) * block_bytes_; }
  int64_t live() const { return live_; }
  // Blocks ever handed out: every block's index is below it.
  uint32_t end() const { return end_; }

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
  // Needs a Reserve() first. The new head of the free list is prefetched: the next
  // Allocate reads it, a cache miss otherwise (a batch read back from the SSD tier takes
  // a spill's freed blocks one after another).
  uint32_t Allocate() {
    ++live_;
    if (free_head_ != kNone) {
      const uint32_t i = free_head_;
      std::memcpy(&free_head_, At(i), sizeof(free_head_));
      if (free_head_ != kNone) PrefetchLine(reinterpret_cast<uintptr_t>(At(free_head_)));
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

  // Calls f(i, block i) for every block index below end(), in address order, with the
  // first `ahead_bytes` of the block kScanAhead blocks on prefetched. Why: blocks are over
  // a cache line apart, and a scan that reads only their headers outruns the hardware
  // prefetcher (the SSD tier's victim scan spent half its time on the first header load).
  template <typename F>
  void ForEach(size_t ahead_bytes, F&& f) const {
    constexpr uint32_t kScanAhead = 16;
    uint32_t i = 0;
    for (size_t c = 0; i < end_; ++c) {
      const char* block = chunks_[c];
      const uint32_t chunk_end =
          static_cast<uint32_t>(std::min<uint64_t>(end_, i + ChunkBlocks(static_cast<int>(c))));
      for (; i < chunk_end; ++i, block += block_bytes_) {
        if (i + kScanAhead < chunk_end) PrefetchBytes(block + kScanAhead * block_bytes_, ahead_bytes);
        f(i, block);
      }
    }
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
  size_t ChunkBytes(size_t c) const { return ChunkBlocks(static_cast<int>(c)) * block_bytes_; }

  // Fresh pages (MapPages): they become resident only as blocks are used.
  void AddChunk(int c) {
    chunks_.reserve(chunks_.size() + 1);  // before the mapping: a throw leaks nothing
    const size_t bytes = ChunkBytes(c);
    chunks_.push_back(static_cast<char*>(MapPages(bytes)));
    bytes_allocated_ += bytes;
  }

  size_t block_bytes_;
  std::vector<char*> chunks_;
  uint32_t end_ = 0;          // blocks ever handed out past the free list
  uint32_t free_head_ = kNone;
  int64_t live_ = 0;
  size_t bytes_allocated_ = 0;
};

// The blocks of one shard: an arena of full blocks (header, row, slots) and one of meta
// blocks (header only). A ref names a block: its index in the full arena, or its index in
// the meta arena with kMetaBit set. Moving a key between the arenas (Promote, Demote)
// keeps its header and changes its ref.
class Blocks {
 public:
  static constexpr uint32_t kMetaBit = 0x80000000u;

  explicit Blocks(size_t full_block_bytes) : full_(full_block_bytes), meta_(sizeof(BlockHeader)) {}

  static bool IsStored(uint32_t ref) { return (ref & kMetaBit) == 0; }

  BlockHeader* Header(uint32_t ref) const {
    return reinterpret_cast<BlockHeader*>((ref & kMetaBit) ? meta_.At(ref & ~kMetaBit)
                                                           : full_.At(ref));
  }

  // Bytes of a block named by `ref` (a full or a meta block).
  size_t BytesOf(uint32_t ref) const {
    return IsStored(ref) ? full_.block_bytes() : sizeof(BlockHeader);
  }
  size_t full_block_bytes() const { return full_.block_bytes(); }

  // Makes the next New(full) succeed without allocating (see Arena::Reserve).
  void Reserve(bool full) { (full ? full_ : meta_).Reserve(); }

  // A new block (after Reserve(full)) with its header reset to `key`; returns its ref.
  // A full block's row and slots are unspecified.
  uint32_t New(bool full, int64_t key) {
    Arena& arena = full ? full_ : meta_;
    const uint32_t i = arena.Allocate();
    reinterpret_cast<BlockHeader*>(arena.At(i))->Reset(key);
    return full ? i : (i | kMetaBit);
  }

  // Gives `*ref` (a meta block) a full block (row + slots, unspecified) keeping its header;
  // returns it.
  BlockHeader* Promote(uint32_t* ref) {
    full_.Reserve();
    const uint32_t i = full_.Allocate();
    BlockHeader* h = reinterpret_cast<BlockHeader*>(full_.At(i));
    *h = *Header(*ref);
    Release(meta_, *ref & ~kMetaBit);
    *ref = i;
    return h;
  }

  // Moves a full block back to a meta block (row and slots dropped).
  void Demote(uint32_t* ref) {
    meta_.Reserve();
    const uint32_t i = meta_.Allocate();
    *reinterpret_cast<BlockHeader*>(meta_.At(i)) = *Header(*ref);
    Release(full_, *ref);
    *ref = i | kMetaBit;
  }

  // Returns the block named by `ref` to its arena's free list.
  void Free(uint32_t ref) {
    if (IsStored(ref)) {
      Release(full_, ref);
    } else {
      Release(meta_, ref & ~kMetaBit);
    }
  }

  int64_t stored() const { return full_.live(); }
  int64_t blocks() const { return full_.live() + meta_.live(); }
  // A dense number per ref, below ref_numbers(): full blocks first, then meta blocks (for
  // arrays indexed by block, such as the SSD tier's marks of pinned blocks).
  size_t ref_numbers() const { return size_t{full_.end()} + meta_.end(); }
  size_t RefNumber(uint32_t ref) const {
    return IsStored(ref) ? ref : size_t{full_.end()} + (ref & ~kMetaBit);
  }

  // Calls f(ref, header) for every live block, in address order: a scan of the headers at
  // memory's sequential speed, not the index's random order, a chunk at a time (no chunk
  // arithmetic per block). The freed blocks are skipped by their mark (BlockHeader::kFreed).
  template <typename F>
  void ForEachLive(F&& f) const {
    full_.ForEach(sizeof(BlockHeader), [&](uint32_t i, const char* block) {
      const BlockHeader* h = reinterpret_cast<const BlockHeader*>(block);
      if (!h->freed()) f(i, h);
    });
    meta_.ForEach(sizeof(BlockHeader), [&](uint32_t i, const char* block) {
      const BlockHeader* h = reinterpret_cast<const BlockHeader*>(block);
      if (!h->freed()) f(i | kMetaBit, h);
    });
  }
  // Bytes of the live blocks (what a memory budget bounds).
  int64_t live_bytes() const {
    return static_cast<int64_t>(full_.live() * full_.block_bytes() +
                                meta_.live() * sizeof(BlockHeader));
  }
  // Bytes resident for the blocks: every block ever handed out (see Arena::bytes_used).
  size_t bytes_used() const { return full_.bytes_used() + meta_.bytes_used(); }

 private:
  // Frees block i of `arena`, marked freed first (ForEachLive). The free list's link takes
  // the first 4 bytes (the key's), not the count.
  static void Release(Arena& arena, uint32_t i) {
    reinterpret_cast<BlockHeader*>(arena.At(i))->count_table = BlockHeader::kFreed;
    arena.Free(i);
  }

  Arena full_, meta_;
};

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_ENGINE_BLOCKS_H_
