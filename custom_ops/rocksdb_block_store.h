// The SSD tier of the storage engine on RocksDB (see rocksdb_block_store.cc for the
// options chosen and why).
#ifndef TF_FUSEDEMB_ROCKSDB_BLOCK_STORE_H_
#define TF_FUSEDEMB_ROCKSDB_BLOCK_STORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "block_store.h"

namespace tensorflow {
namespace fusedemb {
namespace engine {

// A fresh, empty RocksDB store at `path` (a directory the caller made for this engine
// alone; anything in it is destroyed first); removed from disk when the store is
// destroyed. nullptr with *error set (naming `path`) when it cannot be opened.
std::unique_ptr<BlockStore> OpenRocksDbBlockStore(const std::string& path, std::string* error);

// Writes `blocks` as a new checkpoint at `dir` (which must not exist; its parent must),
// in the format BlockStore::Checkpoint writes: the checkpoint of an engine without an SSD
// tier. Errors name `dir`.
std::string WriteBlockCheckpoint(const std::string& dir, std::vector<BlockRef> blocks);

// Calls f(key, data, size) for every block of the checkpoint at `dir` (as
// BlockStore::Checkpoint or WriteBlockCheckpoint wrote it), in key order, read-only.
// Errors name `dir`.
std::string ReadBlockCheckpoint(const std::string& dir,
                                const std::function<void(int64_t, const char*, size_t)>& f);

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_ROCKSDB_BLOCK_STORE_H_
