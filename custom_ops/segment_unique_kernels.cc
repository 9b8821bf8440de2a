// CPU kernel of FusedEmb>SegmentUnique: one hash-map pass per segment, segments in
// parallel on TF's intra-op pool, then a prefix sum places each segment's uniques.
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
    auto keys = keys_t.flat<T>();
    auto splits = splits_t.flat<int64_t>();
    const int64_t num_segments = splits.size() - 1;

    Tensor* inverse_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, keys_t.shape(), &inverse_t));
    auto inverse = inverse_t->flat<int32_t>();

    // Phase 1: per segment, local unique keys and counts; inverse holds local indices.
    std::vector<std::vector<T>> seg_keys(num_segments);
    std::vector<std::vector<int32_t>> seg_counts(num_segments);
    auto unique_segments = [&](int64_t begin, int64_t end) {
      IndexMap map(0);
      for (int64_t s = begin; s < end; ++s) {
        const int64_t lo = splits(s), hi = splits(s + 1);
        map.Reset(std::min<int64_t>(hi - lo, 1 << 12));
        std::vector<T>& uk = seg_keys[s];
        std::vector<int32_t>& uc = seg_counts[s];
        for (int64_t i = lo; i < hi; ++i) {
          bool inserted;
          const int32_t j = map.FindOrInsert(static_cast<int64_t>(keys(i)), &inserted);
          if (inserted) {
            uk.push_back(keys(i));
            uc.push_back(1);
          } else {
            ++uc[j];
          }
          inverse(i) = j;
        }
      }
    };
    const int64_t avg_len = num_segments > 0 ? n / num_segments + 1 : 1;
    ctx->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(
        num_segments, avg_len * 40, unique_segments);

    // Phase 2: offsets of each segment's uniques, then copy and shift the inverse.
    Tensor* out_splits_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, splits_t.shape(), &out_splits_t));
    auto out_splits = out_splits_t->flat<int64_t>();
    out_splits(0) = 0;
    for (int64_t s = 0; s < num_segments; ++s) {
      out_splits(s + 1) = out_splits(s) + static_cast<int64_t>(seg_keys[s].size());
    }
    const int64_t u = out_splits(num_segments);
    Tensor *unique_t = nullptr, *counts_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({u}), &unique_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({u}), &counts_t));
    T* unique = unique_t->flat<T>().data();
    int32_t* counts = counts_t->flat<int32_t>().data();
    auto place_segments = [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) {
        const int64_t off = out_splits(s);
        std::copy(seg_keys[s].begin(), seg_keys[s].end(), unique + off);
        std::copy(seg_counts[s].begin(), seg_counts[s].end(), counts + off);
        for (int64_t i = splits(s); i < splits(s + 1); ++i) inverse(i) += off;
      }
    };
    ctx->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(
        num_segments, avg_len * 2, place_segments);
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
