// The storage engine's SSD tier as an array of fixed-size block slots in one file.
//
// Layout, and why:
//  * Slot i holds one block at byte i * stride of `blocks.slots`: a 4-byte length, then
//    the block (header, row, slots; a statistics-only block is shorter). The stride is the
//    engine's largest block, so a block is written in place, over its own slot, every time
//    it is spilled again: no log, no compaction, no second copy. A deleted key's slot goes
//    on a free list and is reused by the next new key.
//  * A block is read with one pread and written with one pwrite of its slot: the kernel's
//    page cache holds the file's pages (reclaimable memory, not the process's anonymous
//    memory). Side by side with RocksDB (MultiGet, WriteBatch, compaction) on the tiered
//    benchmark, see docs/guide/tables-larger-than-memory.md. Writing through a writable
//    shared mapping instead kept the written pages mapped into the process, which a
//    memory cgroup reclaims far slower: a table 31x its budget in a limit of budget +
//    overhead + 10% thrashed past its test's timeout. The file is mapped read-only for
//    ForEach and Checkpoint, which pass the stored blocks by pointer, without a copy.
//  * Space is reserved with posix_fallocate before a slot past the reserved end is
//    written, a quarter more at a time: a full disk fails that call with an error naming
//    the engine and the file, before any block is written.
//  * Key -> slot lives in DRAM (slot_table.h, 15-23 bytes per cold key), in kStripes
//    tables each under its own lock: the engine's shards call the store in parallel, each
//    for its own keys, and a key's slot is touched only by its shard's calls.
//  * No fsync and nothing persistent: the store is scratch space; checkpoints (RocksDB
//    databases, rocksdb_checkpoint.h) hold the truth.
#include "slot_file_block_store.h"

#include <fcntl.h>
#include <sys/mman.h>
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
constexpr int kStripes = 64;                          // key -> slot tables, each locked
using Length = uint32_t;                              // a slot's block length prefix

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

  std::string MultiGet(const int64_t* keys, size_t n, std::vector<std::string>* values) override {
    values->assign(n, std::string());
    std::vector<char> slot(stride_);
    for (size_t i = 0; i < n; ++i) {
      const uint32_t at = Find(keys[i]);
      if (at == SlotTable::kNone) continue;
      if (pread(fd_, slot.data(), stride_, Offset(at)) != static_cast<ssize_t>(stride_)) {
        return Failure("cannot read " + file_ + ": " + std::strerror(errno));
      }
      Length length;
      std::memcpy(&length, slot.data(), sizeof(length));
      (*values)[i].assign(slot.data() + sizeof(length), length);
    }
    return "";
  }

  std::string Write(const std::vector<BlockRef>& puts, const std::vector<int64_t>& deletes) override {
    for (const BlockRef& b : puts) {
      if (b.size > stride_ - sizeof(Length)) {
        return Failure("a block of " + std::to_string(b.size) + " bytes exceeds its slot");
      }
    }
    std::vector<uint32_t> freed;
    for (int64_t key : deletes) {  // first: a later put of the same key wins
      Stripe& st = StripeOf(key);
      std::lock_guard<std::mutex> lock(st.mu);
      const uint32_t slot = st.table.Erase(key);
      if (slot != SlotTable::kNone) freed.push_back(slot);
    }
    std::vector<uint32_t> slots(puts.size());
    size_t fresh = 0;
    for (size_t i = 0; i < puts.size(); ++i) {
      slots[i] = Find(puts[i].key);
      if (slots[i] == SlotTable::kNone) ++fresh;
    }
    std::vector<uint32_t> granted;
    const std::string error = Allocate(fresh, std::move(freed), &granted);
    if (!error.empty()) return error;  // nothing written: the blocks are still in DRAM
    std::vector<char> slot(stride_);
    for (size_t i = 0, g = 0; i < puts.size(); ++i) {
      const bool added = slots[i] == SlotTable::kNone;
      if (added) slots[i] = granted[g++];
      const Length length = static_cast<Length>(puts[i].size);
      std::memcpy(slot.data(), &length, sizeof(length));
      std::memcpy(slot.data() + sizeof(length), puts[i].data, puts[i].size);
      const size_t bytes = sizeof(length) + puts[i].size;
      if (pwrite(fd_, slot.data(), bytes, Offset(slots[i])) != static_cast<ssize_t>(bytes)) {
        return Failure("cannot write " + file_ + ": " + std::strerror(errno));  // still in DRAM
      }
      if (added) {
        Stripe& st = StripeOf(puts[i].key);
        std::lock_guard<std::mutex> lock(st.mu);
        st.table.Insert(puts[i].key, slots[i]);
      }
    }
    return "";
  }

  std::string ForEach(const std::function<void(int64_t, const char*, size_t)>& f) const override {
    for (const Stripe& st : stripes_) {
      std::lock_guard<std::mutex> lock(st.mu);
      st.table.ForEach([&](int64_t key, uint32_t slot) {
        const char* at = base_ + slot * stride_;
        Length length;
        std::memcpy(&length, at, sizeof(length));
        f(key, at + sizeof(length), length);
      });
    }
    return "";
  }

  // The checkpoint is the format every engine writes (a RocksDB database of every block,
  // WriteBlockCheckpoint): the stored blocks, read straight out of the mapping, with the
  // DRAM tier's (`extra`) in place of their stale stored copies.
  std::string Checkpoint(const std::string& dir, std::vector<BlockRef> extra) override {
    absl::flat_hash_set<int64_t> in_dram;
    in_dram.reserve(extra.size());
    for (const BlockRef& b : extra) in_dram.insert(b.key);
    std::vector<BlockRef> blocks = std::move(extra);
    ForEach([&](int64_t key, const char* data, size_t size) {
      if (!in_dram.contains(key)) blocks.push_back({key, data, size});
    });
    return WriteBlockCheckpoint(dir, std::move(blocks));
  }

  int64_t DiskBytes() const override {
    std::lock_guard<std::mutex> lock(alloc_mu_);
    return static_cast<int64_t>((next_slot_ - free_.size()) * stride_);
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

  Stripe& StripeOf(int64_t key) { return stripes_[Fmix64(static_cast<uint64_t>(key)) % kStripes]; }

  off_t Offset(uint32_t slot) const { return static_cast<off_t>(slot) * static_cast<off_t>(stride_); }

  uint32_t Find(int64_t key) {
    Stripe& st = StripeOf(key);
    std::lock_guard<std::mutex> lock(st.mu);
    return st.table.Find(key);
  }

  // Returns `freed` to the free list and grants `n` slots (freed ones first), reserving
  // the file's space for any past its reserved end. On an error nothing is granted.
  std::string Allocate(size_t n, std::vector<uint32_t> freed, std::vector<uint32_t>* granted) {
    std::lock_guard<std::mutex> lock(alloc_mu_);
    free_.insert(free_.end(), freed.begin(), freed.end());
    const size_t reused = std::min(n, free_.size());
    const size_t end = next_slot_ + (n - reused);
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
    granted->assign(free_.end() - reused, free_.end());
    free_.resize(free_.size() - reused);
    for (size_t s = next_slot_; s < end; ++s) granted->push_back(static_cast<uint32_t>(s));
    next_slot_ = end;
    return "";
  }

  std::string Failure(const std::string& what) const {
    return "SSD tier of embedding engine '" + name_ + "' at " + path_ + ": " + what;
  }

  const std::string path_, name_, file_;
  const int fd_;
  char* const base_;
  const size_t stride_, max_slots_;
  std::array<Stripe, kStripes> stripes_;
  mutable std::mutex alloc_mu_;  // guards the slots' allocation and the file's size
  std::vector<uint32_t> free_;
  size_t next_slot_ = 0, reserved_ = 0;
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
  const size_t stride = (sizeof(Length) + max_block_bytes + 7) / 8 * 8;
  return std::make_unique<SlotFileBlockStore>(path, name, file, fd, static_cast<char*>(base),
                                              stride);
}

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow
