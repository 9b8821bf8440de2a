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
// its key (Engine::WriteDelta). Errors name `dir`.
std::string WriteBlockCheckpoint(const std::string& dir, std::vector<BlockRef> blocks);

// Calls f(key, data, size) for every block of the checkpoint at `dir` (as
// BlockStore::Checkpoint or WriteBlockCheckpoint wrote it), in key order, read-only;
// size 0: a delta's deletion. Errors name `dir`.
std::string ReadBlockCheckpoint(const std::string& dir,
                                const std::function<void(int64_t, const char*, size_t)>& f);

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_ROCKSDB_CHECKPOINT_H_
