// The storage engine's checkpoint format, a RocksDB database of every block (see
// rocksdb_checkpoint.cc for the options chosen and why).
#ifndef TF_FUSEDEMB_ROCKSDB_CHECKPOINT_H_
#define TF_FUSEDEMB_ROCKSDB_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "block_store.h"

namespace tensorflow {
namespace fusedemb {
namespace engine {

// Writes `blocks` as a new checkpoint at `dir` (which must not exist; its parent must),
// in the format BlockStore::Checkpoint writes: the checkpoint of an engine without an SSD
// tier. A block of size 0 is written as an empty value: a delta checkpoint's deletion of
// its key (Engine::WriteDelta). Errors name `dir`; a write that fails removes the
// directory it created (BlockCheckpointWriter).
std::string WriteBlockCheckpoint(const std::string& dir, std::vector<BlockRef> blocks);

// Writes the same checkpoint from parts of the blocks, for a table larger than memory:
// each part (its keys unique across every part) is sorted by key and written as SST
// files of its own (one key range per thread) when it is added, and Finish ingests them
// all at once, so the blocks pass in the order their store reads fastest and only one
// part's BlockRefs are held at a time. The parts' key ranges may overlap: RocksDB places
// such files in level 0 and merges them in key order on reading. A part's blocks need
// stay readable only until its Add returns. Errors name `dir`; after one, Add and Finish
// return it again. A writer destroyed before a successful Finish removes the directory
// it created (a caller's error between parts included), so none is left half-written.
class BlockCheckpointWriter {
 public:
  explicit BlockCheckpointWriter(std::string dir);  // creates the database at `dir`
  ~BlockCheckpointWriter();
  std::string Add(std::vector<BlockRef> part);
  std::string Finish();  // ingests the parts' files and closes the database

 private:
  struct Database;
  std::string dir_;
  std::unique_ptr<Database> db_;
  std::vector<std::string> files_;
  std::string error_;
  bool created_ = false, finished_ = false;
};

// Calls f(key, data, size) for every block of the checkpoint at `dir` (as
// BlockStore::Checkpoint or WriteBlockCheckpoint wrote it), in key order, read-only;
// size 0: a delta's deletion. Errors name `dir`.
std::string ReadBlockCheckpoint(const std::string& dir,
                                const std::function<void(int64_t, const char*, size_t)>& f);

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_ROCKSDB_CHECKPOINT_H_
