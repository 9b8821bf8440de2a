// The SSD tier's interface as the storage engine sees it: whole blocks (header, row,
// slots) stored by key. Plain C++17, no store header, so embedding_engine.h and its
// standalone tests need no RocksDB; slot_file_block_store.cc implements it.
#ifndef TF_FUSEDEMB_BLOCK_STORE_H_
#define TF_FUSEDEMB_BLOCK_STORE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tensorflow {
namespace fusedemb {
namespace engine {

// One block to write: its key and its bytes (pointing into an arena; read during Write).
struct BlockRef {
  int64_t key;
  const char* data;
  size_t size;
};

// A store of blocks by key. Thread-safe: the engine's shards call it in parallel,
// each for keys of its own shard only. Errors are returned as text ("" = fine) that
// names the store's path.
class BlockStore {
 public:
  virtual ~BlockStore() = default;

  // Where a block read back goes: place(i, size) returns room for keys[i]'s `size` bytes,
  // which the store then fills; a block goes straight to its final place (an engine's
  // arena), with no buffer per block.
  using Place = std::function<char*(size_t i, size_t size)>;

  // Reads the blocks of keys[0..n) in one batch: for each key the store holds, calls
  // place(i, its size) once (in an order of the store's choosing) and copies the block
  // there; keys it does not hold are not placed. On an error (a corrupt or truncated
  // store) every block placed is filled, and the rest are not placed.
  virtual std::string MultiGet(const int64_t* keys, size_t n, const Place& place) = 0;

  // Deletes `deletes`, then writes `puts`, in one atomic batch (a key in both keeps its put).
  virtual std::string Write(const std::vector<BlockRef>& puts,
                            const std::vector<int64_t>& deletes) = 0;

  // Calls f(key, data, size) for every block, in the order the store reads fastest (not
  // by key); `data` stays valid until f returns. Not const: the walk may look its keys up.
  virtual std::string ForEach(
      const std::function<void(int64_t, const char*, size_t)>& f) = 0;

  // Bytes of the blocks the store holds on disk.
  virtual int64_t DiskBytes() const = 0;

  // Writes a checkpoint of the store to `dir` (which must not exist; its parent must):
  // every block the store holds, with `extra` (the blocks the DRAM tier holds) in place
  // of their stored copies, so that `dir` holds every block. The store itself is not
  // changed. Read it back with ReadBlockCheckpoint (rocksdb_checkpoint.h).
  virtual std::string Checkpoint(const std::string& dir, std::vector<BlockRef> extra) = 0;

  // DRAM the store holds to find its blocks (a key -> slot index), in bytes.
  virtual int64_t IndexBytes() const { return 0; }

  virtual const std::string& path() const = 0;
};

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_BLOCK_STORE_H_
