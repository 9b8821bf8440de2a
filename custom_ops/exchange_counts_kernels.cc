// CPU kernel of FusedEmb>ExchangeCounts. The splits are k-vectors (k = ranks in the
// collective's set), so the kernel is a loop over k; it exists to replace the ~20 small
// TF ops of each counted round, which cost more to schedule than to compute.
#include <vector>

#include "fusedemb_common.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace tensorflow {
namespace fusedemb {

namespace {
constexpr int kFields = 4;  // rounds, bytes_sent, bytes_received, messages
}  // namespace

class ExchangeCountsOp : public OpKernel {
 public:
  explicit ExchangeCountsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rank", &rank_));
    std::vector<bool> same_node;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("same_node", &same_node));
    same_node_.assign(same_node.begin(), same_node.end());
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& send_t = ctx->input(0);
    const Tensor& recv_t = ctx->input(1);
    OP_REQUIRES_OK(ctx, ValidateVector(send_t, "send_splits"));
    OP_REQUIRES_OK(ctx, ValidateVector(recv_t, "recv_splits"));
    const int64_t k = send_t.NumElements();
    OP_REQUIRES(ctx, recv_t.NumElements() == k,
                errors::InvalidArgument("send_splits and recv_splits differ in length: ", k,
                                        " and ", recv_t.NumElements()));
    OP_REQUIRES(ctx, rank_ < k,
                errors::InvalidArgument("rank ", rank_, " is outside the set of ", k));
    OP_REQUIRES(ctx, same_node_.empty() || static_cast<int64_t>(same_node_.size()) == k,
                errors::InvalidArgument("same_node has ", same_node_.size(),
                                        " entries for a set of ", k));
    const int64_t row_bytes = RowBytes(ctx->input(2));
    const bool classes = !same_node_.empty();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({classes ? 3 * kFields : kFields}),
                                             &out));
    auto counts = out->flat<int64_t>();
    counts.setZero();
    auto send = send_t.flat<int32_t>();
    auto recv = recv_t.flat<int32_t>();
    counts(0) = 1;  // the round itself, whoever it reaches
    for (int64_t m = 0; m < k; ++m) {
      if (classes) {
        // intra: the other members on this node; inter: the members on other nodes
        // (this rank is on its own node, so never inter).
        const int cls = same_node_[m] ? (m == rank_ ? -1 : 1) : 2;
        if (cls > 0) {
          counts(cls * kFields) = 1;
          Add(counts, cls * kFields, send(m), recv(m), row_bytes);
        }
      }
      if (m != rank_) Add(counts, 0, send(m), recv(m), row_bytes);
    }
  }

 private:
  static int64_t RowBytes(const Tensor& like) {
    int64_t elems = 1;
    for (int d = 1; d < like.dims(); ++d) elems *= like.dim_size(d);
    return elems * DataTypeSize(like.dtype());
  }

  template <typename Counts>
  static void Add(Counts& counts, int base, int32_t sent, int32_t received,
                  int64_t row_bytes) {
    counts(base + 1) += static_cast<int64_t>(sent) * row_bytes;
    counts(base + 2) += static_cast<int64_t>(received) * row_bytes;
    counts(base + 3) += sent > 0 ? 1 : 0;
  }

  int64_t rank_;
  std::vector<bool> same_node_;
};

REGISTER_KERNEL_BUILDER(Name("FusedEmb>ExchangeCounts").Device(DEVICE_CPU), ExchangeCountsOp);

}  // namespace fusedemb
}  // namespace tensorflow
