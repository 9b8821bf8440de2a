// The storage engine's SSD tier on RocksDB (the distribution's librocksdb-dev).
//
// Options, and why:
//  * No write-ahead log (WriteOptions::disableWAL) and no fsync: the store is scratch
//    space, never a source of truth across processes. A restart (after SIGKILL too)
//    restores from the last checkpoint, which holds every block of both tiers, and this
//    store is recreated empty; a WAL would double every spill's bytes for nothing.
//  * No compression: rows and optimizer slots are float32 noise to a compressor; it would
//    spend CPU on the step's critical path for a few percent.
//  * Point lookups (OptimizeForPointLookup): a bloom filter per SST file, so a miss (a key
//    never spilled, the common case for new keys) costs no disk read, and a hash index in
//    data blocks. Its block cache is small (8 MiB) because the DRAM tier is the cache.
//  * Two memtables of 8 MiB: the fixed memory the store adds to the budget.
//  * Keys are 8 bytes big-endian: fixed length, so compaction compares them cheaply.
//  * Checkpoints are RocksDB's own (rocksdb::Checkpoint: the SST files hard-linked, or
//    copied across filesystems, after a flush of the memtables), opened once more to
//    write the DRAM tier's blocks over them and flushed to SST files, so a checkpoint
//    directory is a complete, closed RocksDB database of every block. The live store
//    keeps no WAL either way: a checkpoint never reads one. An engine without an SSD
//    tier writes the same format (WriteBlockCheckpoint: a new database of its blocks),
//    straight from its arenas, so its checkpoint holds no second copy of the table.
#include "rocksdb_block_store.h"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "rocksdb/slice.h"
#include "rocksdb/sst_file_writer.h"
#include "rocksdb/utilities/checkpoint.h"
#include "rocksdb/write_batch.h"

namespace tensorflow {
namespace fusedemb {
namespace engine {
namespace {

constexpr uint64_t kBlockCacheMiB = 8;
constexpr size_t kMemtableBytes = size_t{8} << 20;
constexpr size_t kBlocksPerSstFile = size_t{1} << 16;  // at least, per checkpoint writer thread

void EncodeKey(int64_t key, char out[8]) {
  const uint64_t k = static_cast<uint64_t>(key);
  for (int b = 0; b < 8; ++b) out[b] = static_cast<char>(k >> (56 - 8 * b));
}

int64_t DecodeKey(const rocksdb::Slice& s) {
  uint64_t k = 0;
  for (int b = 0; b < 8; ++b) k = (k << 8) | static_cast<unsigned char>(s[b]);
  return static_cast<int64_t>(k);
}

rocksdb::Options StoreOptions() {
  rocksdb::Options o;
  o.create_if_missing = true;
  o.error_if_exists = true;
  o.OptimizeForPointLookup(kBlockCacheMiB);
  o.compression = rocksdb::kNoCompression;
  o.write_buffer_size = kMemtableBytes;
  o.max_write_buffer_number = 2;
  o.max_background_jobs = 2;
  return o;
}

// Reads of blocks: no checksum verification (scratch space on a local disk, see the file
// comment; it cost 2.4% of a tiered step's CPU) and no block-cache fill (keys come in
// random order, so a data block read once is rarely read again from the cache: the DRAM
// tier is the cache).
rocksdb::ReadOptions BlockReads() {
  rocksdb::ReadOptions ro;
  ro.verify_checksums = false;
  ro.fill_cache = false;
  return ro;
}

// Writes sorted[lo, hi) into a new SST file at `file` (keys in RocksDB's byte order).
rocksdb::Status WriteSstFile(const rocksdb::Options& options, const std::string& file,
                             const std::vector<BlockRef>& sorted, size_t lo, size_t hi) {
  rocksdb::SstFileWriter writer(rocksdb::EnvOptions(), options);
  rocksdb::Status s = writer.Open(file);
  char k[8];
  for (size_t i = lo; s.ok() && i < hi; ++i) {
    EncodeKey(sorted[i].key, k);
    s = writer.Put(rocksdb::Slice(k, 8), rocksdb::Slice(sorted[i].data, sorted[i].size));
  }
  return s.ok() ? writer.Finish() : s;
}

// Opens the checkpoint database at `dir` (`create`: a new one, which must not exist) and
// puts `blocks` (unique keys) into it, over what it holds, then closes it: a checkpoint
// directory is a complete, closed RocksDB database. The blocks are sorted by key and
// written as SST files, one contiguous key range per thread, which the database then
// ingests (moved, not copied): no memtable, no WAL and no compaction, and each thread
// writes its file sequentially.
rocksdb::Status WriteCheckpointBlocks(const std::string& dir, bool create,
                                      std::vector<BlockRef> blocks) {
  rocksdb::Options options = StoreOptions();
  options.error_if_exists = create;
  options.create_if_missing = create;
  options.disable_auto_compactions = true;  // written once, read once: no compaction
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(options, dir, &raw);
  std::unique_ptr<rocksdb::DB> db(raw);
  if (!s.ok()) return s;
  if (blocks.empty()) return db->Close();
  std::sort(blocks.begin(), blocks.end(), [](const BlockRef& a, const BlockRef& b) {
    return static_cast<uint64_t>(a.key) < static_cast<uint64_t>(b.key);  // big-endian bytes
  });
  const size_t parts = std::clamp<size_t>(blocks.size() / kBlocksPerSstFile, 1,
                                          std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::string> files(parts);
  std::vector<rocksdb::Status> written(parts);
  std::vector<std::thread> writers;
  for (size_t p = 0; p < parts; ++p) {
    files[p] = dir + "/blocks-" + std::to_string(p) + ".sst";
    writers.emplace_back([&, p] {
      written[p] = WriteSstFile(options, files[p], blocks, blocks.size() * p / parts,
                                blocks.size() * (p + 1) / parts);
    });
  }
  for (std::thread& w : writers) w.join();
  for (const rocksdb::Status& w : written) {
    if (!w.ok()) return w;
  }
  rocksdb::IngestExternalFileOptions ingest;
  ingest.move_files = true;
  s = db->IngestExternalFile(files, ingest);
  return s.ok() ? db->Close() : s;
}

// Calls f for every block of `db` in key order.
rocksdb::Status Scan(rocksdb::DB* db, const std::function<void(int64_t, const char*, size_t)>& f) {
  rocksdb::ReadOptions ro;
  ro.total_order_seek = true;  // OptimizeForPointLookup's hash index needs it to iterate
  std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(ro));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    f(DecodeKey(it->key()), it->value().data(), it->value().size());
  }
  return it->status();
}

class RocksDbBlockStore : public BlockStore {
 public:
  RocksDbBlockStore(std::string path, std::unique_ptr<rocksdb::DB> db)
      : path_(std::move(path)), db_(std::move(db)) {
    write_.disableWAL = true;  // see the file comment
  }

  ~RocksDbBlockStore() override {
    db_.reset();
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);  // scratch: the checkpoint holds the truth
  }

  std::string MultiGet(const int64_t* keys, size_t n, std::vector<std::string>* values) override {
    std::vector<char> encoded(8 * n);
    std::vector<rocksdb::Slice> slices(n);
    for (size_t i = 0; i < n; ++i) {
      EncodeKey(keys[i], &encoded[8 * i]);
      slices[i] = rocksdb::Slice(&encoded[8 * i], 8);
    }
    std::vector<rocksdb::PinnableSlice> found(n);
    std::vector<rocksdb::Status> statuses(n);
    db_->MultiGet(BlockReads(), db_->DefaultColumnFamily(), n, slices.data(),
                  found.data(), statuses.data());
    values->assign(n, std::string());
    for (size_t i = 0; i < n; ++i) {
      if (statuses[i].IsNotFound()) continue;
      if (!statuses[i].ok()) return Failure("read", statuses[i]);
      (*values)[i].assign(found[i].data(), found[i].size());
    }
    return "";
  }

  std::string Write(const std::vector<BlockRef>& puts, const std::vector<int64_t>& deletes) override {
    rocksdb::WriteBatch batch;
    char k[8];
    for (int64_t key : deletes) {  // first: a later put of the same key wins
      EncodeKey(key, k);
      batch.Delete(rocksdb::Slice(k, 8));
    }
    for (const BlockRef& b : puts) {
      EncodeKey(b.key, k);
      batch.Put(rocksdb::Slice(k, 8), rocksdb::Slice(b.data, b.size));
    }
    const rocksdb::Status s = db_->Write(write_, &batch);
    return s.ok() ? "" : Failure("write", s);
  }

  std::string ForEach(const std::function<void(int64_t, const char*, size_t)>& f) const override {
    const rocksdb::Status s = Scan(db_.get(), f);
    return s.ok() ? "" : Failure("scan", s);
  }

  std::string Checkpoint(const std::string& dir, std::vector<BlockRef> extra) override {
    rocksdb::Checkpoint* raw = nullptr;
    rocksdb::Status s = rocksdb::Checkpoint::Create(db_.get(), &raw);
    std::unique_ptr<rocksdb::Checkpoint> checkpoint(raw);
    // log_size_for_flush 0: the memtables are flushed first (there is no WAL to copy).
    if (s.ok()) s = checkpoint->CreateCheckpoint(dir, /*log_size_for_flush=*/0);
    if (!s.ok()) return Failure(("checkpoint to " + dir).c_str(), s);
    s = WriteCheckpointBlocks(dir, /*create=*/false, std::move(extra));
    return s.ok() ? "" : Failure(("writing the DRAM tier into checkpoint " + dir).c_str(), s);
  }

  int64_t DiskBytes() const override {
    uint64_t sst = 0;
    db_->GetIntProperty(rocksdb::DB::Properties::kTotalSstFilesSize, &sst);
    return static_cast<int64_t>(sst);
  }

  const std::string& path() const override { return path_; }

 private:
  std::string Failure(const char* what, const rocksdb::Status& s) const {
    return std::string("SSD tier at ") + path_ + ": " + what + " failed: " + s.ToString();
  }

  std::string path_;
  std::unique_ptr<rocksdb::DB> db_;
  rocksdb::WriteOptions write_;
};

}  // namespace

std::unique_ptr<BlockStore> OpenRocksDbBlockStore(const std::string& path, std::string* error) {
  const rocksdb::Options options = StoreOptions();
  rocksdb::DestroyDB(path, options);  // the directory is this engine's alone: start empty
  rocksdb::DB* raw = nullptr;
  const rocksdb::Status s = rocksdb::DB::Open(options, path, &raw);
  if (!s.ok()) {
    *error = "cannot open the SSD tier at " + path + ": " + s.ToString();
    return nullptr;
  }
  return std::make_unique<RocksDbBlockStore>(path, std::unique_ptr<rocksdb::DB>(raw));
}

std::string WriteBlockCheckpoint(const std::string& dir, std::vector<BlockRef> blocks) {
  const rocksdb::Status s = WriteCheckpointBlocks(dir, /*create=*/true, std::move(blocks));
  return s.ok() ? "" : "cannot write the checkpoint at " + dir + ": " + s.ToString();
}

std::string ReadBlockCheckpoint(const std::string& dir,
                                const std::function<void(int64_t, const char*, size_t)>& f) {
  rocksdb::Options options = StoreOptions();
  options.create_if_missing = false;
  options.error_if_exists = false;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::OpenForReadOnly(options, dir, &raw);
  std::unique_ptr<rocksdb::DB> db(raw);
  if (s.ok()) s = Scan(db.get(), f);
  return s.ok() ? "" : "cannot read the SSD-tier checkpoint at " + dir + ": " + s.ToString();
}

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow
