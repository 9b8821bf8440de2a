// CPU kernels of FusedEmb>RankwiseSort and FusedEmb>OwnerRank. The sort is a stable,
// parallel counting sort: per-chunk histograms, a prefix sum over (rank, chunk), then
// each chunk scatters its keys to their final places. O(n + chunks * N).
#include <vector>

#include "fusedemb_common.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace tensorflow {
namespace fusedemb {

namespace {
// RankwiseSort allocates O(num_ranks) (its rank_splits output and one histogram row per
// chunk), so a hostile num_ranks such as 2^31-1 would ask for ~24 GB and get the process
// killed; no Horovod job comes near this bound.
constexpr int32_t kMaxRanks = 1 << 20;

Status ReadNumRanks(const Tensor& t, int32_t* num_ranks, int32_t max_ranks = INT32_MAX) {
  if (t.dims() != 0) {
    return errors::InvalidArgument("num_ranks must be a scalar, got shape ",
                                   t.shape().DebugString());
  }
  *num_ranks = t.scalar<int32_t>()();
  if (*num_ranks <= 0) {
    return errors::InvalidArgument("num_ranks must be positive, got ", *num_ranks);
  }
  if (*num_ranks > max_ranks) {
    return errors::InvalidArgument("num_ranks = ", *num_ranks, " exceeds the supported maximum ",
                                   max_ranks);
  }
  return OkStatus();
}
}  // namespace

template <typename T>
class RankwiseSortOp : public OpKernel {
 public:
  explicit RankwiseSortOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys_t = ctx->input(0);
    OP_REQUIRES_OK(ctx, ValidateVector(keys_t, "keys"));
    const int64_t n = keys_t.NumElements();
    OP_REQUIRES_OK(ctx, ValidateSplits(ctx->input(1), n, "segment_splits"));
    int32_t num_ranks;
    OP_REQUIRES_OK(ctx, ReadNumRanks(ctx->input(2), &num_ranks, kMaxRanks));
    const T* keys = keys_t.flat<T>().data();
    auto splits = ctx->input(1).flat<int64_t>();
    const int64_t num_segments = splits.size() - 1;

    Tensor *sorted_t, *seg_t, *rank_splits_t, *indices_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys_t.shape(), &sorted_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, keys_t.shape(), &seg_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({num_ranks}), &rank_splits_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, keys_t.shape(), &indices_t));
    T* sorted = sorted_t->flat<T>().data();
    int32_t* sorted_seg = seg_t->flat<int32_t>().data();
    int32_t* rank_splits = rank_splits_t->flat<int32_t>().data();
    int32_t* indices = indices_t->flat<int32_t>().data();

    // Chunks small enough to parallelise, large enough that N counters per chunk stay cheap.
    const int64_t chunk = std::max<int64_t>(16384, 4 * static_cast<int64_t>(num_ranks));
    const int64_t num_chunks = n == 0 ? 0 : (n + chunk - 1) / chunk;
    std::vector<int32_t> owner(n);
    std::vector<int64_t> hist(num_chunks * num_ranks, 0);  // [chunk][rank]
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    pool->ParallelFor(num_chunks, chunk * 8, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        int64_t* h = &hist[c * num_ranks];
        for (int64_t i = c * chunk, e = std::min(n, i + chunk); i < e; ++i) {
          owner[i] = OwnerRank(static_cast<int64_t>(keys[i]), num_ranks);
          ++h[owner[i]];
        }
      }
    });
    // Exclusive prefix over (rank, chunk): chunk c's first slot for rank r.
    int64_t running = 0;
    for (int32_t r = 0; r < num_ranks; ++r) {
      int64_t rank_total = 0;
      for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t cnt = hist[c * num_ranks + r];
        hist[c * num_ranks + r] = running;
        running += cnt;
        rank_total += cnt;
      }
      rank_splits[r] = static_cast<int32_t>(rank_total);
    }
    pool->ParallelFor(num_chunks, chunk * 8, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        int64_t* next = &hist[c * num_ranks];
        const int64_t lo = c * chunk, hi = std::min(n, lo + chunk);
        // Segment of position lo, then walk the splits forward.
        int64_t s = std::upper_bound(splits.data(), splits.data() + num_segments + 1, lo) -
                    splits.data() - 1;
        for (int64_t i = lo; i < hi; ++i) {
          while (splits(s + 1) <= i) ++s;
          const int64_t pos = next[owner[i]]++;
          sorted[pos] = keys[i];
          sorted_seg[pos] = static_cast<int32_t>(s);
          indices[i] = static_cast<int32_t>(pos);
        }
      }
    });
  }
};

template <typename T>
class OwnerRankOp : public OpKernel {
 public:
  explicit OwnerRankOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys_t = ctx->input(0);
    int32_t num_ranks;
    OP_REQUIRES_OK(ctx, ReadNumRanks(ctx->input(1), &num_ranks));
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys_t.shape(), &out_t));
    const T* keys = keys_t.flat<T>().data();
    int32_t* out = out_t->flat<int32_t>().data();
    ctx->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(
        keys_t.NumElements(), 10, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) out[i] = OwnerRank(static_cast<int64_t>(keys[i]), num_ranks);
        });
  }
};

#define REGISTER(T)                                                                          \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name("FusedEmb>RankwiseSort").Device(DEVICE_CPU).TypeConstraint<T>("T").HostMemory("num_ranks"), \
      RankwiseSortOp<T>);                                                                    \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name("FusedEmb>OwnerRank").Device(DEVICE_CPU).TypeConstraint<T>("T"), OwnerRankOp<T>);
REGISTER(int32_t);
REGISTER(int64_t);
#undef REGISTER

}  // namespace fusedemb
}  // namespace tensorflow
