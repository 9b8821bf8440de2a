// CPU kernels of the recovery ops. Gathers and pooling run in parallel over output rows;
// the pooling gradient is a scatter-add, serial because rows are shared between samples.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "fusedemb_common.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace tensorflow {
namespace fusedemb {

namespace {

enum Combiner { kSum, kMean, kSqrtn };

Status ParseCombiners(OpKernelConstruction* ctx, std::vector<Combiner>* out) {
  std::vector<std::string> names;
  TF_RETURN_IF_ERROR(ctx->GetAttr("combiners", &names));
  for (const auto& n : names) out->push_back(n == "sum" ? kSum : n == "mean" ? kMean : kSqrtn);
  return OkStatus();
}

Status CheckIndices(const int32_t* idx, int64_t n, int64_t limit, const char* name,
                    const char* limit_name) {
  for (int64_t i = 0; i < n; ++i) {
    if (idx[i] < 0 || idx[i] >= limit) {
      return errors::InvalidArgument(name, "[", i, "] = ", idx[i], " is out of range [0, ",
                                     limit, ") of ", limit_name);
    }
  }
  return OkStatus();
}

Status CheckRows(const Tensor& rows, const char* name) {
  if (rows.dims() != 2) {
    return errors::InvalidArgument(name, " must be a matrix [m, D], got shape ",
                                   rows.shape().DebugString());
  }
  return OkStatus();
}

// Validates the two split vectors of the pooling ops against n keys and F combiners.
Status CheckPoolSplits(const Tensor& pool_splits, const Tensor& feature_splits, int64_t n,
                       size_t num_combiners) {
  TF_RETURN_IF_ERROR(ValidateSplits(pool_splits, n, "pool_splits"));
  const int64_t pooled = pool_splits.NumElements() - 1;
  TF_RETURN_IF_ERROR(ValidateSplits(feature_splits, pooled, "feature_pool_splits"));
  if (static_cast<size_t>(feature_splits.NumElements() - 1) != num_combiners) {
    return errors::InvalidArgument("combiners has ", num_combiners, " entries but ",
                                   "feature_pool_splits describes ",
                                   feature_splits.NumElements() - 1, " features");
  }
  return OkStatus();
}

// Weight of each element of a pooled segment of `len` elements.
inline double PoolWeight(Combiner c, int64_t len) {
  if (len == 0 || c == kSum) return 1.0;
  return c == kMean ? 1.0 / len : 1.0 / std::sqrt(static_cast<double>(len));
}

// Feature of pooled segment p, given the feature splits (walk forward from a hint).
inline int64_t FeatureOf(const int64_t* fsplits, int64_t num_features, int64_t p, int64_t f) {
  while (f + 1 < num_features && fsplits[f + 1] <= p) ++f;
  return f;
}

}  // namespace

template <typename T>
class RecoveryGatherOp : public OpKernel {
 public:
  explicit RecoveryGatherOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& rows_t = ctx->input(0);
    const Tensor& sort_t = ctx->input(1);
    const Tensor& inv_t = ctx->input(2);
    OP_REQUIRES_OK(ctx, CheckRows(rows_t, "rows"));
    OP_REQUIRES_OK(ctx, ValidateVector(sort_t, "sort_indices"));
    OP_REQUIRES_OK(ctx, ValidateVector(inv_t, "unique_inverse"));
    const int64_t m = rows_t.dim_size(0), d = rows_t.dim_size(1);
    const int64_t u = sort_t.NumElements(), n = inv_t.NumElements();
    const int32_t* sort_idx = sort_t.flat<int32_t>().data();
    const int32_t* inv = inv_t.flat<int32_t>().data();
    OP_REQUIRES_OK(ctx, CheckIndices(sort_idx, u, m, "sort_indices", "the rows"));
    OP_REQUIRES_OK(ctx, CheckIndices(inv, n, u, "unique_inverse", "sort_indices"));
    Tensor *out_t, *rec_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, d}), &out_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, inv_t.shape(), &rec_t));
    const T* rows = rows_t.flat<T>().data();
    T* out = out_t->flat<T>().data();
    int32_t* rec = rec_t->flat<int32_t>().data();
    ctx->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(
        n, 4 * d + 10, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) {
            const int32_t r = sort_idx[inv[i]];
            rec[i] = r;
            // D == 0: both buffers may be null, and memcpy(nullptr, ...) is UB even for
            // 0 bytes (found by UBSan, `make sanitize`).
            if (d > 0) std::memcpy(out + i * d, rows + r * d, d * sizeof(T));
          }
        });
  }
};

template <typename T>
class RecoveryPoolOp : public OpKernel {
 public:
  explicit RecoveryPoolOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseCombiners(ctx, &combiners_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& rows_t = ctx->input(0);
    const Tensor& rec_t = ctx->input(1);
    OP_REQUIRES_OK(ctx, CheckRows(rows_t, "rows"));
    OP_REQUIRES_OK(ctx, ValidateVector(rec_t, "recover_indices"));
    const int64_t m = rows_t.dim_size(0), d = rows_t.dim_size(1), n = rec_t.NumElements();
    OP_REQUIRES_OK(ctx, CheckPoolSplits(ctx->input(2), ctx->input(3), n, combiners_.size()));
    const int32_t* rec = rec_t.flat<int32_t>().data();
    OP_REQUIRES_OK(ctx, CheckIndices(rec, n, m, "recover_indices", "the rows"));
    const int64_t* splits = ctx->input(2).flat<int64_t>().data();
    const int64_t* fsplits = ctx->input(3).flat<int64_t>().data();
    const int64_t pooled = ctx->input(2).NumElements() - 1;
    const int64_t num_features = combiners_.size();
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({pooled, d}), &out_t));
    const T* rows = rows_t.flat<T>().data();
    T* out = out_t->flat<T>().data();
    const int64_t avg = pooled > 0 ? n / pooled + 1 : 1;
    ctx->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(
        pooled, avg * d * 2 + 10, [&](int64_t b, int64_t e) {
          int64_t f = std::upper_bound(fsplits, fsplits + num_features + 1, b) - fsplits - 1;
          for (int64_t p = b; p < e; ++p) {
            f = FeatureOf(fsplits, num_features, p, f);
            T* o = out + p * d;
            std::fill(o, o + d, T(0));
            const int64_t lo = splits[p], hi = splits[p + 1];
            for (int64_t j = lo; j < hi; ++j) {
              const T* r = rows + static_cast<int64_t>(rec[j]) * d;
              for (int64_t k = 0; k < d; ++k) o[k] += r[k];
            }
            const T w = static_cast<T>(PoolWeight(combiners_[f], hi - lo));
            if (w != T(1)) for (int64_t k = 0; k < d; ++k) o[k] *= w;
          }
        });
  }

 private:
  std::vector<Combiner> combiners_;
};

template <typename T>
class RecoveryPoolGradOp : public OpKernel {
 public:
  explicit RecoveryPoolGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseCombiners(ctx, &combiners_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& grad_t = ctx->input(0);
    const Tensor& rec_t = ctx->input(1);
    OP_REQUIRES_OK(ctx, CheckRows(grad_t, "grad"));
    OP_REQUIRES_OK(ctx, ValidateVector(rec_t, "recover_indices"));
    const int64_t n = rec_t.NumElements(), d = grad_t.dim_size(1);
    OP_REQUIRES_OK(ctx, CheckPoolSplits(ctx->input(2), ctx->input(3), n, combiners_.size()));
    const int64_t pooled = ctx->input(2).NumElements() - 1;
    OP_REQUIRES(ctx, grad_t.dim_size(0) == pooled,
                errors::InvalidArgument("grad has ", grad_t.dim_size(0), " rows but pool_splits ",
                                        "describes ", pooled, " pooled outputs"));
    OP_REQUIRES(ctx, ctx->input(4).dims() == 0,
                errors::InvalidArgument("num_rows must be a scalar"));
    const int64_t m = ctx->input(4).scalar<int32_t>()();
    OP_REQUIRES(ctx, m >= 0, errors::InvalidArgument("num_rows must be >= 0, got ", m));
    const int32_t* rec = rec_t.flat<int32_t>().data();
    OP_REQUIRES_OK(ctx, CheckIndices(rec, n, m, "recover_indices", "num_rows"));
    const int64_t* splits = ctx->input(2).flat<int64_t>().data();
    const int64_t* fsplits = ctx->input(3).flat<int64_t>().data();
    const int64_t num_features = combiners_.size();
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, d}), &out_t));
    const T* grad = grad_t.flat<T>().data();
    T* out = out_t->flat<T>().data();
    std::fill(out, out + m * d, T(0));
    int64_t f = 0;
    for (int64_t p = 0; p < pooled; ++p) {
      f = FeatureOf(fsplits, num_features, p, f);
      const int64_t lo = splits[p], hi = splits[p + 1];
      const T w = static_cast<T>(PoolWeight(combiners_[f], hi - lo));
      const T* g = grad + p * d;
      for (int64_t j = lo; j < hi; ++j) {
        T* o = out + static_cast<int64_t>(rec[j]) * d;
        for (int64_t k = 0; k < d; ++k) o[k] += w * g[k];
      }
    }
  }

 private:
  std::vector<Combiner> combiners_;
};

#define REGISTER(T)                                                                          \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name("FusedEmb>RecoveryGather").Device(DEVICE_CPU).TypeConstraint<T>("T"),        \
      RecoveryGatherOp<T>);                                                                  \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name("FusedEmb>RecoveryPool").Device(DEVICE_CPU).TypeConstraint<T>("T"),          \
      RecoveryPoolOp<T>);                                                                    \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name("FusedEmb>RecoveryPoolGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"),      \
      RecoveryPoolGradOp<T>);
REGISTER(float);
REGISTER(double);
#undef REGISTER

}  // namespace fusedemb
}  // namespace tensorflow
