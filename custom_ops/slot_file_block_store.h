// The SSD tier of the storage engine as a file of fixed-size block slots (see
// slot_file_block_store.cc for the layout and why).
#ifndef TF_FUSEDEMB_SLOT_FILE_BLOCK_STORE_H_
#define TF_FUSEDEMB_SLOT_FILE_BLOCK_STORE_H_

#include <cstddef>
#include <memory>
#include <string>

#include "block_store.h"

namespace tensorflow {
namespace fusedemb {
namespace engine {

// A fresh, empty store of blocks of at most `max_block_bytes` in one file under `path` (a
// directory the caller made for this engine alone; anything in it is destroyed first),
// for the engine `name` (named in its errors with the path); removed from disk when the
// store is destroyed. nullptr with *error set when it cannot be opened.
std::unique_ptr<BlockStore> OpenSlotFileBlockStore(const std::string& path, const std::string& name,
                                                   size_t max_block_bytes, std::string* error);

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_SLOT_FILE_BLOCK_STORE_H_
