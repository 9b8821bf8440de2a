// CPU kernels of the embedding storage engine's ops (embedding_engine_ops.cc). Each op
// splits its keys by shard (one counting sort) and runs the shards in parallel on TF's
// intra-op pool, each under that shard's lock: writers exclusive, readers shared, so
// kernels on one resource may run concurrently.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <new>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "embedding_engine.h"
#include "fusedemb_common.h"
#include "rocksdb_checkpoint.h"
#include "slot_file_block_store.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor_util.h"
#include "tensorflow/core/platform/threadpool.h"

namespace tensorflow {
namespace fusedemb {

using engine::Engine;
using engine::BlockHeader;
using engine::KeyFields;
using engine::Partition;
using engine::Span;

// The resource: one engine per group table and rank.
class EngineResource : public ResourceBase {
 public:
  // Batches a prefetch keeps pinned: batch t+1's keys, pinned during step t, are
  // updated in step t+1 (prior rows) and t+2 (delayed rows, NestPipe's vertical
  // scheduling), before the prefetch of t+3 releases them.
  static constexpr size_t kPrefetchDepth = 2;

  explicit EngineResource(const engine::Config& c) : engine_(c) {}
  Engine& engine() { return engine_; }

  // Held for the whole of a prefetch (its pins, then the release of the oldest batch's)
  // and by CheckPinned: a step's check never sees the batch being prefetched beside the
  // one it is about to release, a passing moment.
  std::mutex& prefetch_mutex() { return prefetch_mu_; }
  // Records `keys` as the newest prefetched batch; returns the batch it releases (empty
  // while fewer than kPrefetchDepth are held). Call with prefetch_mutex() held.
  std::vector<int64_t> PushPrefetched(std::vector<int64_t> keys) {
    prefetched_.push_back(std::move(keys));
    if (prefetched_.size() <= kPrefetchDepth) return {};
    std::vector<int64_t> oldest = std::move(prefetched_.front());
    prefetched_.pop_front();
    return oldest;
  }
  std::string DebugString() const override {
    return strings::StrCat("FusedEmb engine (dim ", engine_.dim(), ", ", engine_.num_shards(),
                           " shards)");
  }
  int64_t MemoryUsed() const override { return engine_.Size().bytes_held; }
  // The error of a budget smaller than the blocks pinned at once, with `extra_keys` more
  // (Engine::CheckPinned), read between prefetches.
  std::string CheckPinned(int64_t extra_keys) {
    std::lock_guard<std::mutex> lock(prefetch_mu_);
    return engine_.CheckPinned(extra_keys);
  }

 private:
  Engine engine_;
  std::mutex prefetch_mu_;
  std::deque<std::vector<int64_t>> prefetched_;
};

namespace {

// Keys of one batch split by shard, and a runner of per-shard work in parallel.
class ShardedBatch {
 public:
  ShardedBatch(OpKernelContext* ctx, const Engine& e, const int64_t* keys, int64_t n)
      : engine_(e), partition_(Partitioned(ctx, e, keys, n)), n_(n) {}

  // Runs fn(shard, span) -> error text for every shard with keys, in parallel; returns
  // the first error. `cost_per_key`: rough CPU cycles per key, for TF's scheduler.
  template <typename F>
  Status Run(OpKernelContext* ctx, int64_t cost_per_key, F&& fn) const {
    const int S = engine_.num_shards();
    std::vector<std::string> failures(S);
    std::vector<char> out_of_memory(S, 0);
    auto work = [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) {
        const Span span = partition_.Of(static_cast<int>(s));
        if (span.size == 0) continue;
        try {
          failures[s] = fn(static_cast<int>(s), span);
        } catch (const std::bad_alloc&) {
          out_of_memory[s] = 1;
        }
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    pool->ParallelFor(S, std::max<int64_t>(1, cost_per_key * (n_ / S + 1)), work);
    for (int s = 0; s < S; ++s) {
      if (out_of_memory[s]) {
        return errors::ResourceExhausted("embedding engine: out of memory in shard ", s);
      }
      if (!failures[s].empty()) return errors::InvalidArgument("embedding engine: ", failures[s]);
    }
    return OkStatus();
  }

 private:
  // The partition, computed over the CPU worker pool's threads (one range each).
  static Partition Partitioned(OpKernelContext* ctx, const Engine& e, const int64_t* keys,
                               int64_t n) {
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    return e.PartitionKeys(keys, n, pool->NumThreads(), [pool](int parts, const auto& fn) {
      // A cost this high gives every range a task of its own.
      pool->ParallelFor(parts, int64_t{1} << 30, [&fn](int64_t begin, int64_t end) {
        for (int64_t q = begin; q < end; ++q) fn(static_cast<int>(q));
      });
    });
  }

  const Engine& engine_;
  Partition partition_;
  int64_t n_;
};

Status GetEngine(OpKernelContext* ctx, core::RefCountPtr<EngineResource>* out) {
  return LookupResource(ctx, HandleFromInput(ctx, 0), out);
}

Status CheckSameLength(const Tensor& t, int64_t n, const char* name) {
  TF_RETURN_IF_ERROR(ValidateVector(t, name));
  if (t.NumElements() != n) {
    return errors::InvalidArgument(name, " must have one entry per key (", n, "), got ",
                                   t.NumElements());
  }
  return OkStatus();
}

Status CheckMatrix(const Tensor& t, int64_t rows, const std::vector<int64_t>& inner,
                   const char* name) {
  TensorShape want({rows});
  for (int64_t d : inner) want.AddDim(d);
  if (t.shape() != want) {
    return errors::InvalidArgument(name, " must have shape ", want.DebugString(), ", got ",
                                   t.shape().DebugString());
  }
  return OkStatus();
}

// An op attr (dim, num_slots) that must agree with the engine's configuration.
Status CheckAttr(const char* what, int64_t op_value, int64_t engine_value) {
  if (op_value != engine_value) {
    return errors::InvalidArgument("the op's ", what, " ", op_value, " differs from the engine's ",
                                   what, " ", engine_value);
  }
  return OkStatus();
}

Status CheckDimAttr(const Engine& e, int64_t dim) { return CheckAttr("dim", dim, e.dim()); }

Status CheckNumSlots(const Engine& e, int64_t num_slots) {
  return CheckAttr("num_slots", num_slots, e.num_slots());
}

// Base of the kernels that read keys from input 1.
class EngineKernel : public OpKernel {
 public:
  explicit EngineKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {}

 protected:
  // The engine and the validated keys of one call.
  struct KeysBatch {
    core::RefCountPtr<EngineResource> resource;
    const int64_t* keys = nullptr;
    int64_t n = 0;
    // A training step's batch (the update's keys): with a tier, its blocks, with those
    // other calls keep pinned (a prefetch), must fit the budget (Tier::CheckPinned), or
    // the call fails once run. Other calls (finds, exports, evictions) may pin any number.
    bool step_batch = false;
    Engine& engine() const { return resource->engine(); }
    // Runs fn(shard, span) over the shards of the keys, in parallel; with an SSD tier,
    // between Pin and Unpin of the shard's keys (fn sees only DRAM blocks).
    template <typename F>
    Status Run(OpKernelContext* ctx, int64_t cost_per_key, F&& fn) const {
      Engine& e = engine();
      if (e.tiered()) return RunTiered(ctx, cost_per_key, fn);
      return ShardedBatch(ctx, e, keys, n).Run(ctx, cost_per_key, std::forward<F>(fn));
    }
    // Out of line, so the untiered path's code is what it was before the tier existed.
    template <typename F>
    __attribute__((noinline)) Status RunTiered(OpKernelContext* ctx, int64_t cost_per_key,
                                               F& fn) const {
      Engine& e = engine();
      std::atomic<int64_t> anew{0};  // keys this call pinned that no other call had pinned
      const Status status = ShardedBatch(ctx, e, keys, n).Run(
          ctx, cost_per_key + kTierCostPerKey, [&](int s, Span p) {
            int64_t pinned = 0;
            std::string error = e.Pin(s, p, keys, &pinned);
            anew.fetch_add(pinned, std::memory_order_relaxed);
            try {
              if (error.empty()) error = fn(s, p);
            } catch (...) {  // out of memory: release the pins before ShardedBatch reports it
              e.Unpin(s, p, keys);
              throw;
            }
            const std::string unpinned = e.Unpin(s, p, keys);
            return error.empty() ? unpinned : error;
          });
      if (!status.ok() || !step_batch) return status;
      // The batch's keys and those other calls keep pinned, as if pinned at once: shard by
      // shard they never are, yet a batch over the budget puts each shard over its share,
      // which then spills every unpinned block. Checked after the call, which pins each
      // shard's keys only while it runs there (all shards first would cost a pass more).
      const std::string error = resource->CheckPinned(anew.load(std::memory_order_relaxed));
      if (!error.empty()) return errors::InvalidArgument("embedding engine: ", error);
      return status;
    }
    // Rough extra cycles per key of Pin and Unpin (hash map updates, a share of the I/O).
    static constexpr int64_t kTierCostPerKey = 400;
  };

  static Status PrepareKeys(OpKernelContext* ctx, KeysBatch* b) {
    TF_RETURN_IF_ERROR(GetEngine(ctx, &b->resource));
    const Tensor& keys_t = ctx->input(1);
    TF_RETURN_IF_ERROR(ValidateVector(keys_t, "keys"));
    b->keys = keys_t.flat<int64_t>().data();
    b->n = keys_t.NumElements();
    return OkStatus();
  }
};

// ------------------------------------------------------------------ handle
// The whole of `text` as a float64 (strtod rounds correctly: Python's repr reads back exactly).
bool ParseDouble(const std::string& text, double* out) {
  if (text.empty()) return false;
  char* end = nullptr;
  *out = std::strtod(text.c_str(), &end);
  return end == text.c_str() + text.size();
}

class EngineHandleOp : public OpKernel {
 public:
  explicit EngineHandleOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    engine::Config& c = config_;
    int64_t dim, shards;
    std::string optimizer, initializer;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_shards", &shards));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("optimizer", &optimizer));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("initializer", &initializer));
    OP_REQUIRES(ctx, engine::ParseOptimizer(optimizer, &c.optimizer),
                errors::InvalidArgument("unknown optimizer '", optimizer,
                                        "'; the engine has sgd, adagrad, ftrl, adam"));
    OP_REQUIRES(ctx, engine::ParseInit(initializer, &c.init),
                errors::InvalidArgument("unknown initializer '", initializer,
                                        "'; the engine has zeros, uniform, normal, truncated_normal"));
    c.dim = static_cast<int>(dim);
    c.num_shards = static_cast<int>(shards);
    OP_REQUIRES_OK(ctx, ctx->GetAttr("learning_rate", &c.learning_rate));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("initial_accumulator_value", &c.initial_accumulator));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("beta1", &c.beta1));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("beta2", &c.beta2));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &c.epsilon));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("learning_rate_power", &c.lr_power));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("l1", &c.l1));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("l2", &c.l2));
    std::string row_dtype;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("row_dtype", &row_dtype));
    c.bf16_rows = row_dtype == "bfloat16";
    std::vector<std::string> params;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("init_params", &params));
    OP_REQUIRES(ctx, params.size() == 2 && ParseDouble(params[0], &c.init_loc) &&
                         ParseDouble(params[1], &c.init_scale),
                errors::InvalidArgument("init_params must be two numbers (loc, scale), got [",
                                        absl::StrJoin(params, ", "), "]"));
    const std::string bad = engine::ValidateConfig(c);
    OP_REQUIRES(ctx, bad.empty(), errors::InvalidArgument("embedding engine: ", bad));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("memory_budget_bytes", &budget_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("spill_path", &spill_path_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tables", &tables_));
    OP_REQUIRES(ctx, budget_ < 0 || !spill_path_.empty(),
                errors::InvalidArgument("a memory budget needs a spill_path for its SSD tier"));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("container", &container_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shared_name", &name_));
    OP_REQUIRES(ctx, !name_.empty(),
                errors::InvalidArgument("shared_name must name the table instance"));
  }

  void Compute(OpKernelContext* ctx) override {
    ResourceMgr* rm = ctx->resource_manager();
    const std::string container = container_.empty() ? rm->default_container() : container_;
    EngineResource* r = nullptr;
    OP_REQUIRES_OK(ctx, rm->LookupOrCreate<EngineResource>(
                            container, name_, &r, [this](EngineResource** out) {
                              return CreateEngine(out);
                            }));
    core::ScopedUnref unref(r);
    const engine::Config& have = r->engine().config();
    OP_REQUIRES(ctx, have.dim == config_.dim && have.optimizer == config_.optimizer &&
                         have.num_shards == config_.num_shards,
                errors::InvalidArgument("embedding engine '", name_,
                                        "' exists with another dim, optimizer or shard count"));
    Tensor* handle = nullptr;
    AllocatorAttributes host;
    host.set_on_host(true);
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &handle, host));
    handle->scalar<ResourceHandle>()() =
        MakeResourceHandle<EngineResource>(ctx, container, name_);
  }

 private:
  // A new engine, with its SSD tier when it has a memory budget.
  Status CreateEngine(EngineResource** out) const {
    // Unref'd, not deleted, if the store cannot open: a resource is deleted by its last
    // Unref (~RefCounted checks that no reference is left).
    core::RefCountPtr<EngineResource> r(new EngineResource(config_));
    if (budget_ >= 0) {
      std::string error;
      std::unique_ptr<engine::BlockStore> store = engine::OpenSlotFileBlockStore(
          spill_path_, name_, r->engine().block_bytes(), &error);
      if (store == nullptr) return errors::FailedPrecondition(error);
      r->engine().AttachStore(std::move(store), budget_, name_, tables_);
    }
    *out = r.release();
    return OkStatus();
  }

  engine::Config config_;
  int64_t budget_;
  std::string container_, name_, spill_path_, tables_;
};

// ------------------------------------------------------------------ lookup and apply
// Kernels that return rows: keys (input 1), init_keys (input 2), rows [u, dim] (output 0).
class RowsKernel : public EngineKernel {
 public:
  explicit RowsKernel(OpKernelConstruction* ctx) : EngineKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
  }

 protected:
  struct Batch : KeysBatch {
    const int64_t* init_keys = nullptr;
    float* rows = nullptr;
  };

  Status PrepareRows(OpKernelContext* ctx, Batch* b) {
    TF_RETURN_IF_ERROR(PrepareKeys(ctx, b));
    TF_RETURN_IF_ERROR(CheckDimAttr(b->engine(), dim_));
    const Tensor& init_t = ctx->input(2);
    TF_RETURN_IF_ERROR(CheckSameLength(init_t, b->n, "init_keys"));
    Tensor* rows_t = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({b->n, dim_}), &rows_t));
    b->init_keys = init_t.flat<int64_t>().data();
    b->rows = rows_t->flat<float>().data();
    return OkStatus();
  }

  int64_t dim_;
};

class EngineLookupOp : public RowsKernel {
 public:
  using RowsKernel::RowsKernel;

  void Compute(OpKernelContext* ctx) override {
    Batch b;
    OP_REQUIRES_OK(ctx, PrepareRows(ctx, &b));
    const Engine& e = b.engine();
    OP_REQUIRES_OK(ctx, b.Run(ctx, 100 + 4 * dim_, [&](int s, Span p) {
      e.Lookup(s, p, b.keys, b.init_keys, b.rows);
      return std::string();
    }));
  }
};

class EngineApplyGradientsOp : public RowsKernel {
 public:
  using RowsKernel::RowsKernel;

  void Compute(OpKernelContext* ctx) override {
    Batch b;
    OP_REQUIRES_OK(ctx, PrepareRows(ctx, &b));
    Engine& e = b.engine();
    const Tensor& grads_t = ctx->input(3);
    const Tensor& step_t = ctx->input(4);
    const Tensor& min_t = ctx->input(5);
    OP_REQUIRES_OK(ctx, CheckMatrix(grads_t, b.n, {dim_}, "grads"));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(step_t.shape()),
                errors::InvalidArgument("step must be a scalar, got shape ",
                                        step_t.shape().DebugString()));
    OP_REQUIRES_OK(ctx, ValidateVector(min_t, "min_counts"));
    OP_REQUIRES(ctx, min_t.NumElements() < engine::BlockHeader::kNoTable,
                errors::InvalidArgument("min_counts has more entries than tables can exist"));
    const float* grads = grads_t.flat<float>().data();
    const int64_t* min_counts = min_t.flat<int64_t>().data();
    const int num_tables = static_cast<int>(min_t.NumElements());
    const engine::StepConstants step =
        engine::MakeStepConstants(e.config(), step_t.scalar<int64_t>()());
    b.step_batch = true;
    OP_REQUIRES_OK(ctx, b.Run(ctx, 200 + 20 * dim_, [&](int s, Span p) {
      return e.ApplyGradients(s, p, b.keys, b.init_keys, grads, step, min_counts, num_tables,
                              b.rows);
    }));
  }
};

// ------------------------------------------------------------------ statistics
class EngineRecordOp : public EngineKernel {
 public:
  explicit EngineRecordOp(OpKernelConstruction* ctx) : EngineKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("overwrite_last_step", &overwrite_));
  }

  void Compute(OpKernelContext* ctx) override {
    KeysBatch b;
    OP_REQUIRES_OK(ctx, PrepareKeys(ctx, &b));
    const Tensor& tables_t = ctx->input(2);
    const Tensor& ids_t = ctx->input(3);
    const Tensor& counts_t = ctx->input(4);
    const Tensor& last_t = ctx->input(5);
    OP_REQUIRES_OK(ctx, CheckSameLength(tables_t, b.n, "tables"));
    OP_REQUIRES_OK(ctx, CheckSameLength(ids_t, b.n, "ids"));
    OP_REQUIRES_OK(ctx, CheckSameLength(counts_t, b.n, "counts"));
    const bool scalar_last = TensorShapeUtils::IsScalar(last_t.shape());
    if (!scalar_last) OP_REQUIRES_OK(ctx, CheckSameLength(last_t, b.n, "last_steps"));
    const int32_t* tables = tables_t.flat<int32_t>().data();
    const int64_t* counts = counts_t.flat<int64_t>().data();
    const int64_t* last = last_t.flat<int64_t>().data();
    // Checked before any write, so a bad batch changes nothing.
    for (int64_t i = 0; i < b.n; ++i) {
      OP_REQUIRES(ctx, tables[i] >= 0 && tables[i] < static_cast<int32_t>(engine::BlockHeader::kNoTable),
                  errors::InvalidArgument("tables[", i, "] = ", tables[i], " is not in [0, 65535)"));
      OP_REQUIRES(ctx, counts[i] >= 0,
                  errors::InvalidArgument("counts[", i, "] = ", counts[i], " is negative"));
    }
    for (int64_t i = 0; i < last_t.NumElements(); ++i) {  // the header keeps an int32
      OP_REQUIRES(ctx, last[i] >= INT32_MIN && last[i] <= INT32_MAX,
                  errors::InvalidArgument("last_steps[", i, "] = ", last[i],
                                          " does not fit the engine's int32 last step"));
    }
    const engine::RecordArgs args{b.keys, tables, ids_t.flat<int64_t>().data(), counts, last,
                                  scalar_last ? 0 : 1, overwrite_};
    Engine& e = b.engine();
    OP_REQUIRES_OK(ctx, b.Run(ctx, 150, [&](int s, Span p) { return e.Record(s, p, args); }));
  }

 private:
  bool overwrite_;
};

class EngineFindOp : public EngineKernel {
 public:
  using EngineKernel::EngineKernel;

  void Compute(OpKernelContext* ctx) override {
    KeysBatch b;
    OP_REQUIRES_OK(ctx, PrepareKeys(ctx, &b));
    std::vector<KeyFields> fields(b.n);
    const Engine& e = b.engine();
    OP_REQUIRES_OK(ctx, b.Run(ctx, 100, [&](int s, Span p) {
      e.Find(s, p, b.keys, fields.data());
      return std::string();
    }));
    WriteFields(ctx, fields, 0);
  }

  // Outputs first..first+4: stored, tables, ids, counts, last_steps of `fields`.
  static void WriteFields(OpKernelContext* ctx, const std::vector<KeyFields>& fields, int first) {
    const int64_t n = static_cast<int64_t>(fields.size());
    Tensor* out[5];
    for (int i = 0; i < 5; ++i) {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(first + i, TensorShape({n}), &out[i]));
    }
    auto stored = out[0]->flat<bool>();
    auto tables = out[1]->flat<int32_t>();
    auto ids = out[2]->flat<int64_t>(), counts = out[3]->flat<int64_t>(),
         last = out[4]->flat<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      stored(i) = fields[i].stored;
      tables(i) = fields[i].table;
      ids(i) = fields[i].id;
      counts(i) = fields[i].count;
      last(i) = fields[i].last_step;
    }
  }
};

// ------------------------------------------------------------------ rows in and out
class EngineGatherRowsOp : public EngineKernel {
 public:
  explicit EngineGatherRowsOp(OpKernelConstruction* ctx) : EngineKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_slots", &num_slots_));
  }

  void Compute(OpKernelContext* ctx) override {
    KeysBatch b;
    OP_REQUIRES_OK(ctx, PrepareKeys(ctx, &b));
    const Engine& e = b.engine();
    OP_REQUIRES_OK(ctx, CheckDimAttr(e, dim_));
    OP_REQUIRES_OK(ctx, CheckNumSlots(e, num_slots_));
    Tensor *values_t = nullptr, *slots_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({b.n, dim_}), &values_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({b.n, num_slots_, dim_}), &slots_t));
    float* values = values_t->flat<float>().data();
    float* slots = slots_t->flat<float>().data();
    OP_REQUIRES_OK(ctx, b.Run(ctx, 100 + 4 * dim_, [&](int s, Span p) {
      return e.GatherRows(s, p, b.keys, values, slots);
    }));
  }

 private:
  int64_t dim_, num_slots_;
};

class EngineWriteRowsOp : public EngineKernel {
 public:
  using EngineKernel::EngineKernel;

  void Compute(OpKernelContext* ctx) override {
    KeysBatch b;
    OP_REQUIRES_OK(ctx, PrepareKeys(ctx, &b));
    Engine& e = b.engine();
    const Tensor& values_t = ctx->input(2);
    const Tensor& slots_t = ctx->input(3);
    OP_REQUIRES_OK(ctx, CheckMatrix(values_t, b.n, {e.dim()}, "values"));
    OP_REQUIRES_OK(ctx, CheckMatrix(slots_t, b.n, {e.num_slots(), e.dim()}, "slots"));
    const float* values = values_t.flat<float>().data();
    const float* slots = slots_t.flat<float>().data();
    OP_REQUIRES_OK(ctx, b.Run(ctx, 150 + 4 * e.dim(), [&](int s, Span p) {
      e.WriteRows(s, p, b.keys, values, slots);
      return std::string();
    }));
  }
};

// Removes rows (kRows) or statistics of the keys.
template <bool kRows>
class EngineRemoveOp : public EngineKernel {
 public:
  using EngineKernel::EngineKernel;

  void Compute(OpKernelContext* ctx) override {
    KeysBatch b;
    OP_REQUIRES_OK(ctx, PrepareKeys(ctx, &b));
    Engine& e = b.engine();
    OP_REQUIRES_OK(ctx, b.Run(ctx, 150, [&](int s, Span p) {
      if (kRows) {
        e.RemoveRows(s, p, b.keys);
      } else {
        e.Forget(s, p, b.keys);
      }
      return std::string();
    }));
  }
};

// ------------------------------------------------------------------ prefetch
// Pins (pin) or unpins keys[0..n) in DRAM, shard-parallel.
Status PinKeys(OpKernelContext* ctx, Engine& e, const int64_t* keys, int64_t n, bool pin) {
  return ShardedBatch(ctx, e, keys, n).Run(ctx, 400, [&](int s, Span p) {
    return pin ? e.Pin(s, p, keys) : e.Unpin(s, p, keys);
  });
}

// Pins (kPin) or unpins keys in DRAM: reads their blocks from the SSD tier now and keeps
// them until as many unpins. Nothing to do without a tier.
template <bool kPin>
class EnginePinOp : public EngineKernel {
 public:
  using EngineKernel::EngineKernel;

  void Compute(OpKernelContext* ctx) override {
    KeysBatch b;
    OP_REQUIRES_OK(ctx, PrepareKeys(ctx, &b));
    if (b.engine().tiered()) OP_REQUIRES_OK(ctx, PinKeys(ctx, b.engine(), b.keys, b.n, kPin));
  }
};

// Pins a batch's keys until kPrefetchDepth later batches are prefetched (DBP's retrieval
// of batch t+1 during step t), then releases the oldest batch's pins.
class EnginePrefetchOp : public EngineKernel {
 public:
  using EngineKernel::EngineKernel;

  void Compute(OpKernelContext* ctx) override {
    KeysBatch b;
    OP_REQUIRES_OK(ctx, PrepareKeys(ctx, &b));
    Engine& e = b.engine();
    if (!e.tiered()) return;
    std::lock_guard<std::mutex> lock(b.resource->prefetch_mutex());
    // The new pins first, so a key of both batches never leaves DRAM in between.
    OP_REQUIRES_OK(ctx, PinKeys(ctx, e, b.keys, b.n, true));
    const std::vector<int64_t> old =
        b.resource->PushPrefetched(std::vector<int64_t>(b.keys, b.keys + b.n));
    OP_REQUIRES_OK(ctx, PinKeys(ctx, e, old.data(), static_cast<int64_t>(old.size()), false));
    // What stays pinned now, this batch and the one before, must fit the budget.
    const std::string error = e.CheckPinned();
    OP_REQUIRES(ctx, error.empty(), errors::InvalidArgument("embedding engine: ", error));
  }
};

// ------------------------------------------------------------------ export and size
class EngineExportOp : public OpKernel {
 public:
  explicit EngineExportOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("stored_only", &stored_only_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("with_rows", &with_rows_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_slots", &num_slots_));
  }

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<EngineResource> r;
    OP_REQUIRES_OK(ctx, GetEngine(ctx, &r));
    const Engine& e = r->engine();
    OP_REQUIRES_OK(ctx, CheckDimAttr(e, dim_));
    OP_REQUIRES_OK(ctx, CheckNumSlots(e, num_slots_));
    // Both tiers under every shard's lock, then one sort by key.
    std::vector<int64_t> keys;
    std::vector<KeyFields> fields;
    std::vector<float> values, slots;
    const std::string error = e.Export(stored_only_, &keys, &fields, with_rows_ ? &values : nullptr,
                                       with_rows_ ? &slots : nullptr);
    OP_REQUIRES(ctx, error.empty(), errors::Internal("embedding engine: ", error));
    const int64_t k = static_cast<int64_t>(keys.size());
    std::vector<int64_t> order(k);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return keys[a] < keys[b]; });
    Tensor* keys_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({k}), &keys_t));
    std::vector<KeyFields> sorted(k);
    for (int64_t i = 0; i < k; ++i) {
      keys_t->flat<int64_t>()(i) = keys[order[i]];
      sorted[i] = fields[order[i]];
    }
    EngineFindOp::WriteFields(ctx, sorted, 1);
    if (!ctx->status().ok()) return;
    const int64_t rows = with_rows_ ? k : 0, sd = num_slots_ * dim_;
    Tensor *values_t = nullptr, *slots_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(6, TensorShape({rows, dim_}), &values_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(7, TensorShape({rows, num_slots_, dim_}), &slots_t));
    float* v = values_t->flat<float>().data();
    float* sl = slots_t->flat<float>().data();
    for (int64_t i = 0; i < rows; ++i) {
      std::copy_n(values.data() + order[i] * dim_, dim_, v + i * dim_);
      std::copy_n(slots.data() + order[i] * sd, sd, sl + i * sd);
    }
  }

 private:
  bool stored_only_, with_rows_;
  int64_t dim_, num_slots_;
};

class EngineStoredKeysOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<EngineResource> r;
    OP_REQUIRES_OK(ctx, GetEngine(ctx, &r));
    std::vector<int64_t> keys;
    keys.reserve(r->engine().Size().stored);  // no regrowth: at most 16 bytes a key
    const std::string error = r->engine().StoredKeys(&keys);
    OP_REQUIRES(ctx, error.empty(), errors::Internal("embedding engine: ", error));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({static_cast<int64_t>(keys.size())}), &out));
    int64_t* k = out->flat<int64_t>().data();
    std::copy(keys.begin(), keys.end(), k);
    std::vector<int64_t>().swap(keys);
    std::sort(k, k + out->NumElements());
  }
};

class EngineSizeOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<EngineResource> r;
    OP_REQUIRES_OK(ctx, GetEngine(ctx, &r));
    const Engine::Sizes z = r->engine().Size();
    const int64_t values[4] = {z.stored, z.tracked, z.bytes_held, z.ssd_bytes};
    for (int i = 0; i < 4; ++i) {
      Tensor* t = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, TensorShape({}), &t));
      t->scalar<int64_t>()() = values[i];
    }
    Tensor* io = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({4}), &io));
    std::copy_n(z.ssd_io, 4, io->flat<int64_t>().data());
    Tensor* index = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(5, TensorShape({}), &index));
    index->scalar<int64_t>()() = z.ssd_index_bytes;
  }
};

// ------------------------------------------------------------------ checkpoints
// Input `index` of a checkpoint op, a scalar string named `what`.
Status ScalarString(OpKernelContext* ctx, int index, const char* what, std::string* out) {
  const Tensor& t = ctx->input(index);
  if (!TensorShapeUtils::IsScalar(t.shape()) || t.dtype() != DT_STRING) {
    return errors::InvalidArgument(what, " must be a scalar string");
  }
  *out = t.scalar<tstring>()();
  return OkStatus();
}

// The engine, the directory (input 1) and the owner of the recorded changes (input 2) of
// a checkpoint write.
Status CheckpointInputs(OpKernelContext* ctx, core::RefCountPtr<EngineResource>* r,
                        std::string* dir, std::string* owner) {
  TF_RETURN_IF_ERROR(GetEngine(ctx, r));
  TF_RETURN_IF_ERROR(ScalarString(ctx, 1, "directory", dir));
  return ScalarString(ctx, 2, "changes_for", owner);
}

// Writes an engine's blocks, both tiers, to a directory: a tiered engine's through its
// store's checkpoint, an untiered engine's as a new checkpoint of the same format; the
// engine then records changes for EngineWriteDelta by `changes_for` ("" : none).
class EngineWriteCheckpointOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<EngineResource> r;
    std::string dir, owner;
    OP_REQUIRES_OK(ctx, CheckpointInputs(ctx, &r, &dir, &owner));
    const std::string error = r->engine().WriteCheckpoint(dir, engine::WriteBlockCheckpoint, owner);
    OP_REQUIRES(ctx, error.empty(), errors::Internal("embedding engine: ", error));
  }
};

// Whether the engine records changes for an owner (EngineWriteDelta by it would follow
// its own last checkpoint write).
class EngineRecordsChangesForOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<EngineResource> r;
    OP_REQUIRES_OK(ctx, GetEngine(ctx, &r));
    std::string owner;
    OP_REQUIRES_OK(ctx, ScalarString(ctx, 1, "owner", &owner));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<bool>()() = r->engine().RecordsChangesFor(owner);
  }
};

// Writes the blocks changed since the last checkpoint (and deletions of the keys removed)
// to a directory, in the same format; counts: [blocks, deletions] written.
class EngineWriteDeltaOp : public OpKernel {
 public:
  explicit EngineWriteDeltaOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<EngineResource> r;
    std::string dir, owner;
    OP_REQUIRES_OK(ctx, CheckpointInputs(ctx, &r, &dir, &owner));
    Engine::DeltaCounts counts;
    const std::string error =
        r->engine().WriteDelta(dir, engine::WriteBlockCheckpoint, owner, &counts);
    OP_REQUIRES(ctx, error.empty(), errors::FailedPrecondition("embedding engine: ", error));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({2}), &out));
    out->flat<int64_t>()(0) = counts.blocks;
    out->flat<int64_t>()(1) = counts.deletions;
  }
};

// Puts the blocks this rank owns, out of every saving rank's checkpoint directory, into
// the engine (tiered or not), in batches of kBatch blocks. A delta's deletions (empty
// values) are applied on every rank: a deletion carries no ID to find its owner by, and
// erasing a key this rank does not hold changes nothing.
class EngineReadCheckpointOp : public EngineKernel {
 public:
  explicit EngineReadCheckpointOp(OpKernelConstruction* ctx) : EngineKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    KeysBatch b;
    OP_REQUIRES_OK(ctx, GetEngine(ctx, &b.resource));
    const Tensor& dirs = ctx->input(1);
    OP_REQUIRES_OK(ctx, ValidateVector(dirs, "directories"));
    const int32_t rank = ctx->input(2).scalar<int32_t>()();
    const int32_t num_ranks = ctx->input(3).scalar<int32_t>()();
    OP_REQUIRES(ctx, num_ranks > 0 && rank >= 0 && rank < num_ranks,
                errors::InvalidArgument("rank ", rank, " is not in [0, ", num_ranks, ")"));
    std::vector<int64_t> keys;
    std::vector<std::string> blocks;
    int64_t restored = 0;
    Status status;
    auto put = [&]() {
      b.keys = keys.data();
      b.n = static_cast<int64_t>(keys.size());
      status = b.Run(ctx, 400, [&](int s, Span p) {
        return b.engine().PutBlocks(s, p, keys.data(), blocks.data());
      });
      restored += b.n;
      keys.clear();
      blocks.clear();
    };
    for (int64_t d = 0; d < dirs.NumElements() && status.ok(); ++d) {
      const std::string dir = dirs.flat<tstring>()(d);
      const std::string error = engine::ReadBlockCheckpoint(dir, [&](int64_t key, const char* data,
                                                                      size_t size) {
        if (!status.ok()) return;
        if (size == 0) {  // a delta's deletion
          keys.push_back(key);
          blocks.emplace_back();
          if (keys.size() == kBatch) put();
          return;
        }
        BlockHeader h;
        if (size < sizeof(h)) {
          status = errors::DataLoss("checkpoint ", dir, ": the block of key ", key, " has ",
                                    size, " bytes, less than a header");
          return;
        }
        std::memcpy(static_cast<void*>(&h), data, sizeof(h));
        if (!h.tracked()) {
          status = errors::DataLoss("checkpoint ", dir, ": key ", key, " has no recorded "
                                    "(table, ID), so its owner rank is unknown");
          return;
        }
        if (OwnerRank(h.id, num_ranks) != rank) return;
        keys.push_back(key);
        blocks.emplace_back(data, size);
        if (keys.size() == kBatch) put();
      });
      OP_REQUIRES(ctx, error.empty(), errors::NotFound("embedding engine: ", error));
    }
    if (status.ok() && !keys.empty()) put();
    OP_REQUIRES_OK(ctx, status);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = restored;
  }

 private:
  static constexpr size_t kBatch = 65536;
};

}  // namespace

#define FUSEDEMB_ENGINE_KERNEL(name, cls) \
  REGISTER_KERNEL_BUILDER(Name("FusedEmb>" name).Device(DEVICE_CPU), cls)

FUSEDEMB_ENGINE_KERNEL("EngineHandle", EngineHandleOp);
FUSEDEMB_ENGINE_KERNEL("EngineLookup", EngineLookupOp);
FUSEDEMB_ENGINE_KERNEL("EngineApplyGradients", EngineApplyGradientsOp);
FUSEDEMB_ENGINE_KERNEL("EngineRecord", EngineRecordOp);
FUSEDEMB_ENGINE_KERNEL("EngineFind", EngineFindOp);
FUSEDEMB_ENGINE_KERNEL("EngineGatherRows", EngineGatherRowsOp);
FUSEDEMB_ENGINE_KERNEL("EngineWriteRows", EngineWriteRowsOp);
FUSEDEMB_ENGINE_KERNEL("EngineRemoveRows", EngineRemoveOp<true>);
FUSEDEMB_ENGINE_KERNEL("EngineForget", EngineRemoveOp<false>);
FUSEDEMB_ENGINE_KERNEL("EnginePin", EnginePinOp<true>);
FUSEDEMB_ENGINE_KERNEL("EngineUnpin", EnginePinOp<false>);
FUSEDEMB_ENGINE_KERNEL("EnginePrefetch", EnginePrefetchOp);
FUSEDEMB_ENGINE_KERNEL("EngineExport", EngineExportOp);
FUSEDEMB_ENGINE_KERNEL("EngineSize", EngineSizeOp);
FUSEDEMB_ENGINE_KERNEL("EngineStoredKeys", EngineStoredKeysOp);
FUSEDEMB_ENGINE_KERNEL("EngineWriteCheckpoint", EngineWriteCheckpointOp);
FUSEDEMB_ENGINE_KERNEL("EngineWriteDelta", EngineWriteDeltaOp);
FUSEDEMB_ENGINE_KERNEL("EngineRecordsChangesFor", EngineRecordsChangesForOp);
FUSEDEMB_ENGINE_KERNEL("EngineReadCheckpoint", EngineReadCheckpointOp);

}  // namespace fusedemb
}  // namespace tensorflow
