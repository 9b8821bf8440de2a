// CPU kernel of FusedEmb>FindKeys: table_keys' positions sorted by key once (stable, so
// of equal keys the first position comes first), then one binary search per key:
// O((v + k) log v) on keys only, as the stock-op version it replaces (argsort, gather,
// LowerBound), without its thirty-odd ops of shape bookkeeping per call.
#include <algorithm>
#include <numeric>
#include <vector>

#include "fusedemb_common.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace tensorflow {
namespace fusedemb {

class FindKeysOp : public OpKernel {
 public:
  explicit FindKeysOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys_t = ctx->input(0);
    const Tensor& table_t = ctx->input(1);
    OP_REQUIRES_OK(ctx, ValidateVector(keys_t, "keys"));
    OP_REQUIRES_OK(ctx, ValidateVector(table_t, "table_keys"));
    const auto keys = keys_t.flat<int64_t>();
    const auto table = table_t.flat<int64_t>();
    const int64_t k = keys.size(), v = table.size();
    Tensor *found_t = nullptr, *index_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys_t.shape(), &found_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, keys_t.shape(), &index_t));
    auto found = found_t->flat<bool>();
    auto index = index_t->flat<int32_t>();

    std::vector<int32_t> order(v);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return table(a) < table(b); });
    for (int64_t i = 0; i < k; ++i) {
      const int64_t key = keys(i);
      const auto pos = std::lower_bound(order.begin(), order.end(), key,
                                        [&](int32_t p, int64_t x) { return table(p) < x; });
      const bool hit = pos != order.end() && table(*pos) == key;
      found(i) = hit;
      index(i) = hit ? *pos : 0;
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("FusedEmb>FindKeys").Device(DEVICE_CPU), FindKeysOp);

}  // namespace fusedemb
}  // namespace tensorflow
