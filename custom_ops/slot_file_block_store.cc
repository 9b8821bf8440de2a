// The storage engine's SSD tier as an array of fixed-size block slots in one file.
//
// Layout, and why:
//  * Slot i holds one block at byte i * stride of `blocks.slots`: a 4-byte length, then
//    the block (header, row, slots; a statistics-only block is shorter). The stride is the
//    engine's largest block. Slots come in segments of kSegmentSlots adjacent slots.
//  * A spill writes its blocks to fresh slots, the next ones of the open segment (then of a
//    free segment, then of a new one at the end), so a batch of blocks is a run of adjacent
//    slots, staged in one buffer and written with one pwrite; each block's old slot is
//    released. Why not in place: a re-spilled block's slot is anywhere in the file, and a
//    write call per block cost 0.5-1 us of CPU in 4 KiB page-cache folios (ext4, kernel
//    6.18; 7-10 us in large folios, hence no readahead: POSIX_FADV_RANDOM, MADV_RANDOM),
//    against 0.13-0.27 us a block in a pwritev of 100 adjacent slots (measured side by
//    side). Why staged rather than pwritev's iovecs (length, block, tail: three a block):
//    the kernel's copy walks the iovecs one by one and cannot prefetch the blocks, and
//    its share of the tiered benchmark's CPU fell from about 10% to 6% staged.
//  * A segment left without a live slot is free again, whole. When the segments in use
//    hold over twice the live slots, Clean moves the live blocks of the least live ones to
//    the open segment, so the file stays within about 2x the live blocks. A block read
//    back keeps its old slot until it is spilled again or erased (Tier::Pin).
//  * A batch whose pages are all in the page cache (a sample of them, SomeUncached) is
//    copied out of a read-only shared mapping of the file, with no read call per block (a
//    pread of a cached slot cost 0.6-0.7 us of CPU, the copy 0.04-0.07 us). Otherwise one
//    POSIX_FADV_WILLNEED pass over the batch's pages (ReadAhead) has the disk read those
//    the cache lacks at its queue depth, not one fault at a time, and each block is read
//    with pread: a page read through the mapping stays mapped into the process (its RSS)
//    and costs its reclaim an unmapping and TLB shootdowns. Side by side on 4 KiB random
//    reads of an uncached 4 GB file in a 256 MB memory cgroup: 4.2 us of the machine's
//    CPU a read through the mapping, 3.3-3.5 through pread. The tiered benchmark's step
//    (10 M blocks, 1000 MB cgroup) spent the same CPU per block either way (3.72 and
//    3.71 us), and kept 3-7 MB of the file mapped instead of 315-388 MB. The kernel's page
//    cache holds the file's pages (reclaimable memory, not the process's anonymous
//    memory); they are written only with pwrite: writing through a writable shared
//    mapping kept dirty pages mapped into the process, which a memory cgroup reclaims far
//    slower (a table 31x its budget in a limit of budget + overhead + 10% thrashed past
//    its test's timeout). ForEach and Checkpoint walk the file in order, a part at a
//    time, and pass the stored blocks by pointer into the mapping, without a copy. Side
//    by side with RocksDB (MultiGet, WriteBatch, compaction) on the tiered benchmark:
//    docs/guide/tables-larger-than-memory.md.
//  * Space is reserved with posix_fallocate before a slot past the reserved end is
//    written, a quarter more at a time: a full disk fails that call with an error naming
//    the engine and the file, before any block is written. A file truncated or
//    overwritten under the store fails the read in one line (fstat per batch, each slot's
//    length and key checked), never with a SIGBUS or another key's block.
//  * Key -> slot lives in DRAM (slot_table.h, 14-18 bytes per cold key), in kStripes
//    tables each under its own lock: the engine's shards call the store in parallel, each
//    for its own keys, and a key's slot is changed only by its shard's calls, except in
//    Clean, which excludes every other call (layout_mu_). A key's table is chosen by the
//    bits that choose its engine shard, so a shard's batch falls in a few tables, and a
//    call takes each of their locks once (ForEachByStripe).
//  * No fsync and nothing persistent: the store is scratch space; checkpoints (RocksDB
//    databases, rocksdb_checkpoint.h) hold the truth.
#include "slot_file_block_store.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "rocksdb_checkpoint.h"
#include "slot_table.h"

namespace tensorflow {
namespace fusedemb {
namespace engine {
namespace {

constexpr size_t kMapBytes = size_t{1} << 40;        // address space reserved for the file
constexpr size_t kMinReserve = size_t{1} << 20;      // bytes reserved per posix_fallocate, at least
constexpr int kStripeBits = 6;
constexpr int kStripes = 1 << kStripeBits;            // key -> slot tables, each locked
using Length = uint32_t;                              // a slot's block length prefix
constexpr uint32_t kSegmentSlots = 256;               // slots per segment (see the layout)
constexpr uint32_t kNoSegment = UINT32_MAX;
constexpr size_t kCleanSlack = 4;                     // segments in use beyond 2x, before Clean
constexpr size_t kAhead = 8;                          // keys or blocks prefetched ahead
constexpr off_t kPageBytes = 4096;                    // the page cache's unit of the file
constexpr uint32_t kPartSegments = 1024;              // segments per part of a walk (ForEachPart)
constexpr off_t kWillNeedBytes = off_t{512} << 10;    // bytes per POSIX_FADV_WILLNEED (WillNeed)

class SlotFileBlockStore : public BlockStore {
 public:
  SlotFileBlockStore(std::string path, std::string name, std::string file, int fd, char* base,
                     size_t stride)
      : path_(std::move(path)), name_(std::move(name)), file_(std::move(file)), fd_(fd),
        base_(base), stride_(stride),
        max_slots_(std::min<size_t>(kMapBytes / stride, SlotTable::kNone)) {}

  ~SlotFileBlockStore() override {
    munmap(base_, kMapBytes);
    close(fd_);
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);  // scratch: the checkpoint holds the truth
  }

  // Copies each block out of the mapping, in file order, straight to where the caller
  // places it (see the layout); the keys' table entries and the slots are prefetched
  // kAhead ahead, each a cache miss otherwise (without, two thirds of the call's CPU
  // samples were the first read of each slot). One fstat per batch first: a file
  // truncated under the store fails here, in one line, not with a SIGBUS.
  std::string MultiGet(const int64_t* keys, size_t n, const Place& place) override {
    std::shared_lock<std::shared_mutex> layout(layout_mu_);  // no Clean moves them meanwhile
    std::vector<std::pair<uint32_t, uint32_t>> at;  // (slot, i) of the keys stored
    at.reserve(n);
    FindEach(keys, n, [&](size_t i, uint32_t slot) {
      if (slot != SlotTable::kNone) at.emplace_back(slot, static_cast<uint32_t>(i));
    });
    if (at.empty()) return "";
    std::sort(at.begin(), at.end());
    struct stat st;
    if (fstat(fd_, &st) != 0) return Failure("cannot stat " + file_ + ": " + std::strerror(errno));
    const off_t end = Offset(at.back().first) + static_cast<off_t>(stride_);
    if (st.st_size < end) {
      return Failure(file_ + " is truncated: " + std::to_string(st.st_size) +
                     " bytes, its blocks need " + std::to_string(end));
    }
    const bool uncached = SomeUncached(at);
    if (uncached) ReadAhead(at);
    std::unique_ptr<char[]> read(uncached ? new char[stride_] : nullptr);  // a slot, pread
    for (size_t j = 0; j < at.size(); ++j) {
      const auto [slot, i] = at[j];
      const char* block = base_ + Offset(slot);
      if (uncached) {
        const ssize_t got = pread(fd_, read.get(), stride_, Offset(slot));
        if (got != static_cast<ssize_t>(stride_)) {
          return Failure("cannot read " + file_ + ": " +
                         (got < 0 ? std::strerror(errno) : "slot " + std::to_string(slot) +
                                                               " is past its end"));
        }
        block = read.get();
      } else if (j + kAhead < at.size()) {
        PrefetchBytes(base_ + Offset(at[j + kAhead].first), stride_);
      }
      Length length;
      int64_t key;
      std::memcpy(&length, block, sizeof(length));
      std::memcpy(&key, block + sizeof(length), sizeof(key));
      if (length < sizeof(key) || length > stride_ - sizeof(Length) || key != keys[i]) {
        return Failure(file_ + " is corrupt: slot " + std::to_string(slot) + " of key " +
                       std::to_string(keys[i]) + " holds " + std::to_string(length) +
                       " bytes of key " + std::to_string(key));
      }
      std::memcpy(place(i, length), block + sizeof(length), length);
    }
    return "";
  }

  // Deletes, then writes each block to a fresh slot of the open segment (see the layout
  // above), so that a batch of blocks is a run of adjacent slots written with one pwrite;
  // the blocks' old slots are released. Then cleans segments when too few of their slots
  // are live (Clean).
  std::string Write(const std::vector<BlockRef>& puts, const std::vector<int64_t>& deletes) override {
    for (const BlockRef& b : puts) {
      if (b.size > stride_ - sizeof(Length)) {
        return Failure("a block of " + std::to_string(b.size) + " bytes exceeds its slot");
      }
    }
    std::string error;
    {
      std::shared_lock<std::shared_mutex> layout(layout_mu_);
      std::vector<uint32_t> freed;  // first: a later put of the same key wins
      ForEachByStripe(deletes.data(), deletes.size(), [&](SlotTable& table, size_t i) {
        const uint32_t slot = table.Erase(deletes[i]);
        if (slot != SlotTable::kNone) freed.push_back(slot);
      });
      Release(freed);
      error = WriteFresh(puts);
    }
    if (error.empty() && NeedsCleaning()) error = Clean();
    return error;
  }

  // In file order, a part at a time (ForEachPart): a walk in key order reads the file at
  // random, one fault per block where the page cache does not hold it.
  std::string ForEach(const std::function<void(int64_t, const char*, size_t)>& f) override {
    std::shared_lock<std::shared_mutex> layout(layout_mu_);  // no Clean moves them meanwhile
    std::vector<bool> free;
    const std::string error = UsedSegments(&free);
    if (!error.empty()) return error;
    return ForEachPart(free, [&](std::vector<BlockRef>& part) {
      for (const BlockRef& b : part) f(b.key, b.data, b.size);
      return std::string();
    });
  }

  // The checkpoint is the format every engine writes (rocksdb_checkpoint.h): the DRAM
  // tier's blocks (`extra`), then the stored blocks not among them, read straight out of
  // the mapping in file order, each part (ForEachPart) written as a file of its own. Why
  // in parts in file order: a list of every block costs 24 bytes a block (1.2 GB at 50 M
  // rows, more than the SSD tier's index), and its walk in key order reads the file at
  // random. A damaged file fails before the checkpoint's directory is created.
  std::string Checkpoint(const std::string& dir, std::vector<BlockRef> extra) override {
    absl::flat_hash_set<int64_t> in_dram;
    in_dram.reserve(extra.size());
    for (const BlockRef& b : extra) in_dram.insert(b.key);
    std::shared_lock<std::shared_mutex> layout(layout_mu_);  // no Clean moves them meanwhile
    std::vector<bool> free;
    std::string error = UsedSegments(&free);
    if (!error.empty()) return error;
    BlockCheckpointWriter writer(dir);
    error = writer.Add(std::move(extra));
    if (error.empty()) {
      error = ForEachPart(free, [&](std::vector<BlockRef>& part) {
        part.erase(std::remove_if(part.begin(), part.end(),
                                  [&](const BlockRef& b) { return in_dram.contains(b.key); }),
                   part.end());
        return writer.Add(std::move(part));
      });
    }
    return error.empty() ? writer.Finish() : error;
  }

  int64_t DiskBytes() const override {
    std::lock_guard<std::mutex> lock(alloc_mu_);
    return static_cast<int64_t>(live_slots_ * stride_);
  }

  // DRAM of the key -> slot tables (BlockStore's report of the cold keys' index).
  int64_t IndexBytes() const override {
    size_t bytes = 0;
    for (const Stripe& st : stripes_) {
      std::lock_guard<std::mutex> lock(st.mu);
      bytes += st.table.bytes();
    }
    return static_cast<int64_t>(bytes);
  }

  const std::string& path() const override { return path_; }

 private:
  struct Stripe {
    mutable std::mutex mu;
    SlotTable table;
  };

  off_t Offset(uint32_t slot) const { return static_cast<off_t>(slot) * static_cast<off_t>(stride_); }
  // The offset of the page holding byte `offset` of the file (the mapping starts on a page).
  static off_t PageStart(off_t offset) { return offset & ~(kPageBytes - 1); }

  // Whether the page cache lacks the first page of any of a sample of the slots `at`, one
  // in 16 and at most 32, spread over them (mincore, 0.36 us a call against 0.14 for
  // ReadAhead's call on a cached page): a batch whose file pages are all cached, as where
  // the file fits the page cache, then skips ReadAhead's call per block.
  bool SomeUncached(const std::vector<std::pair<uint32_t, uint32_t>>& at) const {
    const size_t samples = std::clamp<size_t>(at.size() / 16, 1, 32);
    const size_t step = std::max<size_t>(1, at.size() / samples);
    for (size_t j = 0; j < at.size(); j += step) {
      unsigned char resident = 0;
      if (mincore(base_ + PageStart(Offset(at[j].first)), 1, &resident) != 0 || !(resident & 1)) {
        return true;
      }
    }
    return false;
  }

  // Asks the kernel to read the pages of the slots `at` (sorted) into the page cache, all
  // at once, before MultiGet copies them: a page the cache lacks is then read while the
  // others are, at the disk's queue depth, not by one synchronous fault at a time. Side by
  // side on this VM's disk, 34,000 random blocks of an uncached 6 GB file: 1.63 s by
  // faults alone, 0.31 s after this pass (and 2.9 against 25 us of CPU a block); a cached
  // page costs the call about 0.26 us, hence SomeUncached first. Adjacent slots' pages go
  // in one call.
  void ReadAhead(const std::vector<std::pair<uint32_t, uint32_t>>& at) const {
    off_t begin = 0, end = 0;  // the pending range of pages, [begin, end)
    for (const auto& [slot, i] : at) {
      const off_t first = PageStart(Offset(slot));
      const off_t last = PageStart(Offset(slot) + static_cast<off_t>(stride_) + kPageBytes - 1);
      if (first > end) {
        WillNeed(begin, end);
        begin = first;
      }
      end = std::max(end, last);
    }
    WillNeed(begin, end);
  }

  // Asks the kernel to read bytes [begin, end) of the file into the page cache, in the
  // background, kWillNeedBytes a call: Linux reads at most max(read_ahead_kb,
  // max_sectors_kb) of one call and drops the rest of it silently (force_page_cache_ra).
  // On this VM's disk (8 MB) one call over a 42 MB part left four fifths of its pages to
  // one fault each.
  void WillNeed(off_t begin, off_t end) const {
    for (off_t at = begin; at < end; at += kWillNeedBytes) {
      posix_fadvise(fd_, at, std::min(kWillNeedBytes, end - at), POSIX_FADV_WILLNEED);
    }
  }

  // The stripe of a key: the top bits of Fmix64(key), which also name the engine's shard
  // (engine_partition.h), so a batch of one shard's keys falls in a few stripes only.
  static int StripeOf(int64_t key) {
    return static_cast<int>(Fmix64(static_cast<uint64_t>(key)) >> (64 - kStripeBits));
  }

  // Calls f(table, i) for each i in [0, n), grouped by the stripe of keys[i] (in no
  // particular order), with that stripe's table locked, and each key's entry prefetched
  // kAhead keys ahead within its stripe (a batch's entries are cache misses, which this
  // overlaps). Why grouped: a lock and an unlock per key, and another pair per prefetch,
  // were several percent of the tier's CPU; grouped, a batch takes each of its stripes'
  // locks once.
  template <typename F>
  void ForEachByStripe(const int64_t* keys, size_t n, F&& f) {
    std::vector<uint8_t> stripe(n);
    std::array<size_t, kStripes + 1> begin{};  // a counting sort of [0, n) by stripe
    for (size_t i = 0; i < n; ++i) {
      stripe[i] = static_cast<uint8_t>(StripeOf(keys[i]));
      ++begin[stripe[i] + 1];
    }
    for (int s = 0; s < kStripes; ++s) begin[s + 1] += begin[s];
    std::vector<uint32_t> order(n);
    std::array<size_t, kStripes + 1> next = begin;
    for (size_t i = 0; i < n; ++i) order[next[stripe[i]]++] = static_cast<uint32_t>(i);
    for (int s = 0; s < kStripes; ++s) {
      if (begin[s] == begin[s + 1]) continue;
      Stripe& st = stripes_[s];
      std::lock_guard<std::mutex> lock(st.mu);
      for (size_t j = begin[s]; j < begin[s + 1]; ++j) {
        if (j + kAhead < begin[s + 1]) st.table.Prefetch(keys[order[j + kAhead]]);
        f(st.table, order[j]);
      }
    }
  }

  // Calls f(i, the slot of keys[i] or SlotTable::kNone) for each i in [0, n), in no
  // particular order (ForEachByStripe).
  template <typename F>
  void FindEach(const int64_t* keys, size_t n, F&& f) {
    ForEachByStripe(keys, n, [&](SlotTable& table, size_t i) { f(i, table.Find(keys[i])); });
  }

  static uint32_t SegmentOf(uint32_t slot) { return slot / kSegmentSlots; }

  // Writes `puts` to fresh slots, a pwrite per run of adjacent ones, then points their
  // keys there and releases their old slots. On an error the index is unchanged (the
  // blocks are still in DRAM, or still in their old slots when Clean moves them).
  //
  // A run (adjacent slots, so within one segment) is staged whole in one buffer, each
  // block after its length and before its slot's zeroed tail: the kernel then copies one
  // contiguous buffer instead of walking three iovecs a block, and the staging copy
  // prefetches the blocks ahead, which the kernel's copy cannot.
  std::string WriteFresh(const std::vector<BlockRef>& puts) {
    if (puts.empty()) return "";
    std::vector<uint32_t> slots;
    std::string error = Allocate(puts.size(), &slots);
    if (!error.empty()) return error;  // nothing written
    const size_t most = std::min<size_t>(puts.size(), kSegmentSlots);
    std::unique_ptr<char[]> staged(new char[most * stride_]);
    for (size_t r = 0; r < puts.size() && error.empty();) {  // a run [r, e) per pwrite
      size_t e = r + 1;
      while (e < puts.size() && e - r < most && slots[e] == slots[e - 1] + 1) ++e;
      for (size_t k = r; k < e; ++k) {
        if (k + kAhead < e) PrefetchBytes(puts[k + kAhead].data, puts[k + kAhead].size);
        Stage(puts[k], staged.get() + (k - r) * stride_);
      }
      const size_t bytes = (e - r) * stride_;
      const ssize_t wrote = pwrite(fd_, staged.get(), bytes, Offset(slots[r]));
      if (wrote != static_cast<ssize_t>(bytes)) {
        error = Failure("cannot write " + file_ + ": " +
                        (wrote < 0 ? std::strerror(errno)
                                   : std::to_string(wrote) + " of " + std::to_string(bytes) +
                                         " bytes written"));
      }
      r = e;
    }
    if (!error.empty()) {
      Release(slots);  // the fresh slots hold nothing
      return error;
    }
    std::vector<int64_t> keys(puts.size());
    for (size_t i = 0; i < puts.size(); ++i) keys[i] = puts[i].key;
    std::vector<uint32_t> old;
    old.reserve(puts.size());
    ForEachByStripe(keys.data(), keys.size(), [&](SlotTable& table, size_t i) {
      const uint32_t was = table.Set(keys[i], slots[i]);
      if (was != SlotTable::kNone) old.push_back(was);
    });
    Release(old);
    return "";
  }

  // Copies `block` into a slot's bytes at `slot`: its length, the block, zeros to the end.
  void Stage(const BlockRef& block, char* slot) const {
    const Length length = static_cast<Length>(block.size);
    std::memcpy(slot, &length, sizeof(length));
    std::memcpy(slot + sizeof(length), block.data, block.size);
    std::memset(slot + sizeof(length) + block.size, 0, stride_ - sizeof(length) - block.size);
  }

  // Grants `n` fresh slots, in order, counted live: the open segment's next ones, then
  // whole free segments, then new ones past the file's end, whose space is reserved first.
  // On an error nothing is granted.
  std::string Allocate(size_t n, std::vector<uint32_t>* granted) {
    std::lock_guard<std::mutex> lock(alloc_mu_);
    const size_t in_open = open_ == kNoSegment ? 0 : kSegmentSlots - open_used_;
    const size_t more = n > in_open ? (n - in_open + kSegmentSlots - 1) / kSegmentSlots : 0;
    const size_t fresh = more > free_segments_.size() ? more - free_segments_.size() : 0;
    const size_t end = (segments_ + fresh) * kSegmentSlots;
    if (end > max_slots_) return Failure("more than " + std::to_string(max_slots_) + " blocks");
    if (end * stride_ > reserved_) {
      const size_t want = std::min(kMapBytes, std::max(end * stride_, reserved_ + std::max(kMinReserve, reserved_ / 4)));
      const int rc = posix_fallocate(fd_, 0, static_cast<off_t>(want));
      if (rc != 0) {
        return Failure("cannot reserve " + std::to_string(want) + " bytes in " + file_ + ": " +
                       std::strerror(rc));
      }
      reserved_ = want;
    }
    granted->clear();
    granted->reserve(n);
    while (granted->size() < n) {
      if (open_ == kNoSegment || open_used_ == kSegmentSlots) {
        if (open_ != kNoSegment && live_[open_] == 0) free_segments_.push_back(open_);
        if (!free_segments_.empty()) {
          open_ = free_segments_.back();
          free_segments_.pop_back();
        } else {
          open_ = static_cast<uint32_t>(segments_++);
          live_.push_back(0);
        }
        open_used_ = 0;
      }
      const size_t take = std::min<size_t>(n - granted->size(), kSegmentSlots - open_used_);
      for (size_t k = 0; k < take; ++k) granted->push_back(open_ * kSegmentSlots + open_used_++);
      live_[open_] += static_cast<uint32_t>(take);
    }
    live_slots_ += n;
    return "";
  }

  // Slots no key points to any more: a segment left without a live slot is free again.
  void Release(const std::vector<uint32_t>& slots) {
    if (slots.empty()) return;
    std::lock_guard<std::mutex> lock(alloc_mu_);
    for (uint32_t slot : slots) {
      const uint32_t seg = SegmentOf(slot);
      if (--live_[seg] == 0 && seg != open_) free_segments_.push_back(seg);
    }
    live_slots_ -= slots.size();
  }

  // Whether the segments in use hold more than twice the live slots (and a few segments).
  bool NeedsCleaning() const {
    std::lock_guard<std::mutex> lock(alloc_mu_);
    const size_t used = (segments_ - free_segments_.size()) * kSegmentSlots;
    return used > 2 * live_slots_ + kCleanSlack * kSegmentSlots;
  }

  // Moves the live blocks of the least live segments to the open one until the segments
  // in use hold at most 1.5 times the live slots, freeing those segments whole. Under the
  // layout lock alone: it moves the keys of every shard, which no other call may read or
  // write meanwhile. A live slot is one its block's key points to.
  std::string Clean() {
    std::unique_lock<std::shared_mutex> layout(layout_mu_);
    std::vector<std::pair<uint32_t, uint32_t>> by_live;  // (live slots, segment)
    size_t used, target;
    {
      const std::vector<bool> free = FreeSegments();
      std::lock_guard<std::mutex> lock(alloc_mu_);
      for (uint32_t seg = 0; seg < segments_; ++seg) {
        if (!free[seg] && seg != open_) by_live.emplace_back(live_[seg], seg);
      }
      used = (segments_ - free_segments_.size()) * kSegmentSlots;
      target = live_slots_ + live_slots_ / 2 + kCleanSlack * kSegmentSlots / 2;
    }
    std::sort(by_live.begin(), by_live.end());
    std::vector<BlockRef> moved;  // the segment's live blocks
    for (const auto& [live, seg] : by_live) {
      if (used <= target) break;
      moved.clear();
      std::string error = LiveBlocks(seg, &moved);
      if (error.empty()) error = WriteFresh(moved);  // frees `seg` once they are moved
      if (!error.empty()) return error;
      used -= kSegmentSlots - moved.size();
    }
    return "";
  }

  // Whether each segment (all segments_ of them) holds no live slot, into `free`; fails
  // when the file is too short to hold them all (a walk over it would fault on the
  // mapping past the file's end: SIGBUS).
  std::string UsedSegments(std::vector<bool>* free) const {
    *free = FreeSegments();
    const uint32_t slots = static_cast<uint32_t>(free->size()) * kSegmentSlots;
    struct stat st;
    if (slots > 0 && (fstat(fd_, &st) != 0 || st.st_size < Offset(slots))) {
      return Failure(file_ + " is truncated or cannot be read: its blocks need " +
                     std::to_string(Offset(slots)) + " bytes");
    }
    return "";
  }

  // Calls each_part(blocks) for the live blocks of the segments not `free`, kPartSegments
  // segments a part, in file order, the next part's pages read ahead while this one is
  // walked; the blocks point into the mapping and stay valid until each_part returns,
  // when the part's pages are unmapped. Stops at the first error, each_part's or the
  // file's. The caller holds the layout lock. Only one part's BlockRefs are held at a time.
  std::string ForEachPart(const std::vector<bool>& free,
                          const std::function<std::string(std::vector<BlockRef>&)>& each_part) {
    const uint32_t segments = static_cast<uint32_t>(free.size());
    const auto part_end = [&](uint32_t first) { return std::min(segments, first + kPartSegments); };
    std::string error;
    std::vector<BlockRef> part;
    WillNeed(Offset(0), Offset(part_end(0) * kSegmentSlots));
    for (uint32_t first = 0; error.empty() && first < segments; first += kPartSegments) {
      const uint32_t end = part_end(first);
      if (end < segments) WillNeed(Offset(end * kSegmentSlots), Offset(part_end(end) * kSegmentSlots));
      part.clear();
      for (uint32_t seg = first; error.empty() && seg < end; ++seg) {
        if (!free[seg]) error = LiveBlocks(seg, &part);
      }
      if (error.empty()) error = each_part(part);
      // Unmaps the part's pages from this process (they stay in the page cache): a walk
      // would otherwise leave the whole file mapped, in the process's RSS (7.3 GB after
      // a checkpoint of 50 M blocks), where a memory cgroup reclaims it slower.
      const off_t from = PageStart(Offset(first * kSegmentSlots));
      madvise(base_ + from, PageStart(Offset(end * kSegmentSlots)) - from, MADV_DONTNEED);
    }
    return error;
  }

  // Whether each segment (all segments_ of them) holds no live slot.
  std::vector<bool> FreeSegments() const {
    std::lock_guard<std::mutex> lock(alloc_mu_);
    std::vector<bool> free(segments_, false);
    for (uint32_t seg : free_segments_) free[seg] = true;
    return free;
  }

  // Appends segment `seg`'s live blocks to `live`, in no particular order, each pointing
  // into the mapping. A live slot is one its block's key points to (a stale copy's key
  // points to another; a slot never written holds no valid length). The keys' slots are
  // found in a batch like MultiGet's: a Find per slot read was a cache miss each, nearly
  // all of Write's CPU when it cleaned. Fails, naming the segment, when it finds fewer
  // live blocks than the segment holds: the file was overwritten under the store, and a
  // walk over it would drop blocks silently.
  std::string LiveBlocks(uint32_t seg, std::vector<BlockRef>* live) {
    std::vector<BlockRef> held;
    std::vector<int64_t> keys;
    std::vector<uint32_t> slots;
    for (uint32_t slot = seg * kSegmentSlots; slot < (seg + 1) * kSegmentSlots; ++slot) {
      const char* at = base_ + Offset(slot);
      Length length;
      int64_t key;
      std::memcpy(&length, at, sizeof(length));
      if (length < sizeof(key) || length > stride_ - sizeof(Length)) continue;  // never live
      std::memcpy(&key, at + sizeof(length), sizeof(key));
      held.push_back({key, at + sizeof(length), length});
      keys.push_back(key);
      slots.push_back(slot);
    }
    const size_t before = live->size();
    FindEach(keys.data(), keys.size(), [&](size_t i, uint32_t slot) {
      if (slot == slots[i]) live->push_back(held[i]);
    });
    const size_t found = live->size() - before;
    std::lock_guard<std::mutex> lock(alloc_mu_);
    if (found == live_[seg]) return "";
    return Failure(file_ + " is corrupt: segment " + std::to_string(seg) + " holds " +
                   std::to_string(found) + " of its " + std::to_string(live_[seg]) +
                   " live blocks");
  }

  std::string Failure(const std::string& what) const {
    return "SSD tier of embedding engine '" + name_ + "' at " + path_ + ": " + what;
  }

  const std::string path_, name_, file_;
  const int fd_;
  char* const base_;
  const size_t stride_, max_slots_;
  std::array<Stripe, kStripes> stripes_;
  // Shared by the calls that read or write blocks by key, exclusive to Clean.
  std::shared_mutex layout_mu_;
  mutable std::mutex alloc_mu_;  // guards the segments and the file's size
  std::vector<uint32_t> live_;   // live slots per segment (granted ones count)
  std::vector<uint32_t> free_segments_;  // segments without a live slot, not open
  uint32_t open_ = kNoSegment;   // the segment fresh slots come from
  size_t open_used_ = 0;         // its slots handed out so far
  size_t segments_ = 0, live_slots_ = 0, reserved_ = 0;
};

}  // namespace

std::unique_ptr<BlockStore> OpenSlotFileBlockStore(const std::string& path, const std::string& name,
                                                   size_t max_block_bytes, std::string* error) {
  const std::string where = "cannot open the SSD tier of embedding engine '" + name + "' at ";
  std::error_code ec;
  std::filesystem::remove_all(path, ec);  // the directory is this engine's alone: start empty
  std::filesystem::create_directories(path, ec);
  if (ec) {
    *error = where + path + ": " + ec.message();
    return nullptr;
  }
  const std::string file = path + "/blocks.slots";
  const int fd = open(file.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    *error = where + file + ": " + std::strerror(errno);
    return nullptr;
  }
  void* base = mmap(nullptr, kMapBytes, PROT_READ, MAP_SHARED | MAP_NORESERVE, fd, 0);
  if (base == MAP_FAILED) {
    *error = where + file + ": mmap: " + std::strerror(errno);
    close(fd);
    return nullptr;
  }
  // Random access, no readahead: readahead fills the page cache with large folios, and a
  // write into a large folio walks all of its buffer heads (see the layout).
  posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
  madvise(base, kMapBytes, MADV_RANDOM);
  const size_t stride = (sizeof(Length) + max_block_bytes + 7) / 8 * 8;
  return std::make_unique<SlotFileBlockStore>(path, name, file, fd, static_cast<char*>(base),
                                              stride);
}

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow
