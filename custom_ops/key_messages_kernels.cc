// CPU kernels of FusedEmb>PackKeyMessages, FusedEmb>UnpackKeyMessages and
// FusedEmb>HashedUnifiedKeys: the key exchange's wire format (ID, count << 16 | table)
// and the plan-independent key Mix64(id ^ tag[table]), each one pass over the keys in
// place of a chain of TF gathers and bitwise ops.
#include <algorithm>
#include <atomic>
#include <limits>

#include "fusedemb_common.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace tensorflow {
namespace fusedemb {

namespace {
// The layout of a key message's second word, its one definition (Python reads it through
// FusedEmb>KeyMessageCategoryBits).
constexpr int kCategoryBits = 16;
constexpr int64_t kTableMask = (int64_t{1} << kCategoryBits) - 1;
// The table field of a bad-input report (tf_fusedemb.layers.exchange.BAD_INPUT): no table's.
constexpr int64_t kBadInput = kTableMask;
// count << kCategoryBits must stay a non-negative int64.
constexpr int64_t kCountLimit = int64_t{1} << (63 - kCategoryBits);
// A message word whose count is not written yet (pass 1 of PackKeyMessages): the sign bit,
// which no written word has.
constexpr int64_t kUnset = std::numeric_limits<int64_t>::min();

Status SameLength(const Tensor& t, int64_t n, const char* name, const char* other) {
  if (t.NumElements() != n) {
    return errors::InvalidArgument(name, " has ", t.NumElements(), " elements but ", other,
                                   " has ", n);
  }
  return OkStatus();
}
}  // namespace

template <typename T, typename C>
class PackKeyMessagesOp : public OpKernel {
 public:
  explicit PackKeyMessagesOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys_t = ctx->input(0);
    const Tensor& segs_t = ctx->input(1);
    const Tensor& indices_t = ctx->input(2);
    const Tensor& counts_t = ctx->input(3);
    const Tensor& table_t = ctx->input(4);
    OP_REQUIRES_OK(ctx, ValidateVector(keys_t, "sorted_keys"));
    OP_REQUIRES_OK(ctx, ValidateVector(segs_t, "sorted_segment_ids"));
    OP_REQUIRES_OK(ctx, ValidateVector(indices_t, "indices"));
    OP_REQUIRES_OK(ctx, ValidateVector(counts_t, "counts"));
    OP_REQUIRES_OK(ctx, ValidateVector(table_t, "segment_table"));
    const int64_t n = keys_t.NumElements();
    OP_REQUIRES_OK(ctx, SameLength(segs_t, n, "sorted_segment_ids", "sorted_keys"));
    OP_REQUIRES_OK(ctx, SameLength(indices_t, n, "indices", "sorted_keys"));
    OP_REQUIRES_OK(ctx, SameLength(counts_t, n, "counts", "sorted_keys"));
    const int64_t num_segments = table_t.NumElements();
    const int64_t* table = table_t.flat<int64_t>().data();
    for (int64_t s = 0; s < num_segments; ++s) {
      OP_REQUIRES(ctx, table[s] >= 0 && table[s] < kBadInput,
                  errors::InvalidArgument("segment_table[", s, "] = ", table[s],
                                          " is out of range [0, ", kBadInput, "): a key "
                                          "message's table field has ", kCategoryBits,
                                          " bits and ", kBadInput, " marks a bad-input report"));
    }
    const T* keys = keys_t.flat<T>().data();
    const int32_t* segs = segs_t.flat<int32_t>().data();
    const int32_t* indices = indices_t.flat<int32_t>().data();
    const C* counts = counts_t.flat<C>().data();

    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, 2}), &out_t));
    int64_t* out = out_t->flat<int64_t>().data();
    // Pass 1, sorted order: the ID and the table, the count marked unset.
    for (int64_t p = 0; p < n; ++p) {
      const int32_t s = segs[p];
      OP_REQUIRES(ctx, s >= 0 && s < num_segments,
                  errors::InvalidArgument("sorted_segment_ids[", p, "] = ", s,
                                          " is out of range [0, ", num_segments,
                                          ") for a segment_table of ", num_segments,
                                          " segments"));
      out[2 * p] = static_cast<int64_t>(keys[p]);
      out[2 * p + 1] = kUnset | table[s];
    }
    // Pass 2, unique order: each key's count to its sorted position. Every position is
    // written once exactly when indices is a permutation (n writes, none repeated).
    for (int64_t u = 0; u < n; ++u) {
      const int32_t p = indices[u];
      OP_REQUIRES(ctx, p >= 0 && p < n,
                  errors::InvalidArgument("indices[", u, "] = ", p, " is out of range [0, ", n,
                                          "); indices must be a permutation (RankwiseSort's)"));
      int64_t& word = out[2 * p + 1];
      OP_REQUIRES(ctx, word < 0,
                  errors::InvalidArgument("indices[", u, "] = ", p, " repeats an earlier "
                                          "index; indices must be a permutation of [0, ", n,
                                          ") (RankwiseSort's)"));
      const int64_t count = static_cast<int64_t>(counts[u]);
      OP_REQUIRES(ctx, count >= 0 && count < kCountLimit,
                  errors::InvalidArgument("counts[", u, "] = ", count, " does not fit a key "
                                          "message: counts must lie in [0, 2^",
                                          63 - kCategoryBits, ")"));
      word = (count << kCategoryBits) | (word & kTableMask);
    }
  }
};

class UnpackKeyMessagesOp : public OpKernel {
 public:
  explicit UnpackKeyMessagesOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& messages_t = ctx->input(0);
    OP_REQUIRES(ctx, messages_t.dims() == 2 && messages_t.dim_size(1) == 2,
                errors::InvalidArgument("messages must have shape [n, 2], got ",
                                        messages_t.shape().DebugString()));
    const int64_t n = messages_t.dim_size(0);
    Tensor *ids_t, *counts_t, *tables_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &ids_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &counts_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({n}), &tables_t));
    const int64_t* m = messages_t.flat<int64_t>().data();
    int64_t* ids = ids_t->flat<int64_t>().data();
    int64_t* counts = counts_t->flat<int64_t>().data();
    int32_t* tables = tables_t->flat<int32_t>().data();
    for (int64_t i = 0; i < n; ++i) {
      ids[i] = m[2 * i];
      counts[i] = m[2 * i + 1] >> kCategoryBits;  // arithmetic, as tf.bitwise.right_shift
      tables[i] = static_cast<int32_t>(m[2 * i + 1] & kTableMask);
    }
  }
};

template <typename T, typename I>
class HashedUnifiedKeysOp : public OpKernel {
 public:
  explicit HashedUnifiedKeysOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids_t = ctx->input(0);
    const Tensor& tables_t = ctx->input(1);
    const Tensor& tags_t = ctx->input(2);
    OP_REQUIRES_OK(ctx, ValidateVector(ids_t, "ids"));
    OP_REQUIRES_OK(ctx, ValidateVector(tables_t, "tables"));
    OP_REQUIRES_OK(ctx, ValidateVector(tags_t, "tags"));
    const int64_t n = ids_t.NumElements();
    OP_REQUIRES_OK(ctx, SameLength(tables_t, n, "tables", "ids"));
    const int64_t num_tables = tags_t.NumElements();
    Tensor* keys_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ids_t.shape(), &keys_t));
    const T* ids = ids_t.flat<T>().data();
    const I* tables = tables_t.flat<I>().data();
    const int64_t* tags = tags_t.flat<int64_t>().data();
    int64_t* keys = keys_t->flat<int64_t>().data();
    // The first out-of-range table index (n: none), reported after the parallel pass.
    std::atomic<int64_t> first_bad{n};
    ctx->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(
        n, 12, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) {
            const int64_t t = static_cast<int64_t>(tables[i]);
            if (t < 0 || t >= num_tables) {
              int64_t seen = first_bad.load(std::memory_order_relaxed);
              while (i < seen && !first_bad.compare_exchange_weak(seen, i)) {
              }
              keys[i] = 0;
              continue;
            }
            keys[i] = HashedUnifiedKey(static_cast<int64_t>(ids[i]),
                                       static_cast<uint64_t>(tags[t]));
          }
        });
    const int64_t bad = first_bad.load();
    OP_REQUIRES(ctx, bad == n,
                errors::InvalidArgument("tables[", bad, "] = ",
                                        bad < n ? static_cast<int64_t>(tables[bad]) : 0,
                                        " is out of range [0, ", num_tables, ") for ",
                                        num_tables, " tags"));
  }
};

#define REGISTER_PACK(T, C)                                                           \
  REGISTER_KERNEL_BUILDER(Name("FusedEmb>PackKeyMessages")                            \
                              .Device(DEVICE_CPU)                                     \
                              .TypeConstraint<T>("T")                                 \
                              .TypeConstraint<C>("Tcount"),                           \
                          PackKeyMessagesOp<T, C>);
#define REGISTER_HASH(T, I)                                                           \
  REGISTER_KERNEL_BUILDER(Name("FusedEmb>HashedUnifiedKeys")                          \
                              .Device(DEVICE_CPU)                                     \
                              .TypeConstraint<T>("T")                                 \
                              .TypeConstraint<I>("Tidx"),                             \
                          HashedUnifiedKeysOp<T, I>);
REGISTER_PACK(int32_t, int32_t);
REGISTER_PACK(int32_t, int64_t);
REGISTER_PACK(int64_t, int32_t);
REGISTER_PACK(int64_t, int64_t);
REGISTER_HASH(int32_t, int32_t);
REGISTER_HASH(int32_t, int64_t);
REGISTER_HASH(int64_t, int32_t);
REGISTER_HASH(int64_t, int64_t);
#undef REGISTER_PACK
#undef REGISTER_HASH

// The wire format's one definition, for Python (tf_fusedemb.ops.key_messages).
class KeyMessageCategoryBitsOp : public OpKernel {
 public:
  explicit KeyMessageCategoryBitsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int32>()() = kCategoryBits;
  }
};

REGISTER_KERNEL_BUILDER(Name("FusedEmb>KeyMessageCategoryBits").Device(DEVICE_CPU),
                        KeyMessageCategoryBitsOp);

REGISTER_KERNEL_BUILDER(Name("FusedEmb>UnpackKeyMessages").Device(DEVICE_CPU),
                        UnpackKeyMessagesOp);

}  // namespace fusedemb
}  // namespace tensorflow
