// CPU kernel of FusedEmb>SegmentUnique: one hash pass per segment, segments in parallel
// on TF's intra-op pool. Segment s writes its uniques into scratch rows
// [splits[s], splits[s] + u_s) (u_s <= its length, so no allocation per segment); a
// prefix sum then compacts them.
#include <algorithm>
#include <memory>
#include <vector>

#include "fusedemb_common.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace tensorflow {
namespace fusedemb {

template <typename T>
class SegmentUniqueOp : public OpKernel {
 public:
  explicit SegmentUniqueOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys_t = ctx->input(0);
    const Tensor& splits_t = ctx->input(1);
    OP_REQUIRES_OK(ctx, ValidateVector(keys_t, "keys"));
    const int64_t n = keys_t.NumElements();
    OP_REQUIRES_OK(ctx, ValidateSplits(splits_t, n, "segment_splits"));
    const T* keys = keys_t.flat<T>().data();
    const int64_t* splits = splits_t.flat<int64_t>().data();
    const int64_t num_segments = splits_t.NumElements() - 1;

    Tensor* inverse_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, keys_t.shape(), &inverse_t));
    int32_t* inverse = inverse_t->flat<int32_t>().data();
    // Uninitialised scratch: every slot read below was written first.
    std::unique_ptr<T[]> scratch_keys(new T[n]);
    std::unique_ptr<int32_t[]> scratch_counts(new int32_t[n]);
    std::vector<int64_t> seg_unique(num_segments, 0);

    // Phase 1: per segment, uniques and counts into scratch; inverse holds local indices.
    auto unique_segments = [&](int64_t begin, int64_t end) {
      DenseIndexSet<T> set;
      for (int64_t s = begin; s < end; ++s) {
        const int64_t lo = splits[s], hi = splits[s + 1];
        set.Reset(scratch_keys.get() + lo, std::min<int64_t>(hi - lo, 256));
        int32_t* counts = scratch_counts.get() + lo;
        for (int64_t i = lo; i < hi; ++i) {
          bool inserted;
          const int32_t j = set.FindOrInsert(keys[i], &inserted);
          counts[j] = inserted ? 1 : counts[j] + 1;
          inverse[i] = j;
        }
        seg_unique[s] = set.size();
      }
    };
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    const int64_t avg_len = num_segments > 0 ? n / num_segments + 1 : 1;
    // One segment per task: categories differ 1000x in cardinality, so contiguous blocks
    // of segments would balance badly between threads.
    using Pool = thread::ThreadPool;
    pool->ParallelFor(num_segments,
                      Pool::SchedulingParams(Pool::SchedulingStrategy::kFixedBlockSize,
                                             std::nullopt, /*block_size=*/1),
                      unique_segments);

    // Phase 2: offsets of each segment's uniques, then compact and shift the inverse.
    Tensor* out_splits_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, splits_t.shape(), &out_splits_t));
    int64_t* out_splits = out_splits_t->flat<int64_t>().data();
    out_splits[0] = 0;
    for (int64_t s = 0; s < num_segments; ++s) out_splits[s + 1] = out_splits[s] + seg_unique[s];
    const int64_t u = out_splits[num_segments];
    Tensor *unique_t = nullptr, *counts_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({u}), &unique_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({u}), &counts_t));
    T* unique = unique_t->flat<T>().data();
    int32_t* counts = counts_t->flat<int32_t>().data();
    pool->ParallelFor(num_segments, avg_len * 2, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) {
        const int64_t lo = splits[s], off = out_splits[s];
        std::copy_n(scratch_keys.get() + lo, seg_unique[s], unique + off);
        std::copy_n(scratch_counts.get() + lo, seg_unique[s], counts + off);
        for (int64_t i = lo; i < splits[s + 1]; ++i) inverse[i] += static_cast<int32_t>(off);
      }
    });
  }
};

#define REGISTER(T)                                                                  \
  REGISTER_KERNEL_BUILDER(                                                           \
      Name("FusedEmb>SegmentUnique").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      SegmentUniqueOp<T>);
REGISTER(int32_t);
REGISTER(int64_t);
#undef REGISTER

}  // namespace fusedemb
}  // namespace tensorflow
