// Interfaces of the recovery ops (FusedRec step c.1): rebuild the fused dense layout from
// the received, deduplicated and rank-sorted rows, optionally pooling per sample.
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "shape_fn_util.h"

namespace tensorflow {
namespace fusedemb {

using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

REGISTER_OP("FusedEmb>RecoveryGather")
    .Input("rows: T")
    .Input("sort_indices: int32")
    .Input("unique_inverse: int32")
    .Output("output: T")
    .Output("recover_indices: int32")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle rows, inv;
      ShapeHandle sort;
      TF_RETURN_IF_ERROR(InputWithRank(c, 0, 2, "rows", &rows));
      TF_RETURN_IF_ERROR(InputWithRank(c, 1, 1, "sort_indices", &sort));
      TF_RETURN_IF_ERROR(InputWithRank(c, 2, 1, "unique_inverse", &inv));
      c->set_output(0, c->Matrix(c->Dim(inv, 0), c->Dim(rows, 1)));
      c->set_output(1, inv);
      return absl::OkStatus();
    })
    .Doc(R"doc(
I_r = sort_indices[unique_inverse]; output = rows[I_r], in one pass.

rows: [m, D] rows received back from the owners, in rank-sorted order.
sort_indices: [u] the paper's I_s (unique position -> sorted position), values in [0, m).
unique_inverse: [n] the paper's I_u (key -> unique position), values in [0, u).
output: [n, D] one row per original key, in the fused key order.
recover_indices: [n] I_r.
)doc");

REGISTER_OP("FusedEmb>RecoveryPool")
    .Input("rows: T")
    .Input("recover_indices: int32")
    .Input("pool_splits: int64")
    .Input("feature_pool_splits: int64")
    .Output("output: T")
    .Attr("T: {float, double}")
    .Attr("combiners: list({'sum', 'mean', 'sqrtn'}) >= 1")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle rows, splits;
      ShapeHandle rec, fsplits;
      TF_RETURN_IF_ERROR(InputWithRank(c, 0, 2, "rows", &rows));
      TF_RETURN_IF_ERROR(InputWithRank(c, 1, 1, "recover_indices", &rec));
      TF_RETURN_IF_ERROR(InputWithRank(c, 2, 1, "pool_splits", &splits));
      TF_RETURN_IF_ERROR(InputWithRank(c, 3, 1, "feature_pool_splits", &fsplits));
      DimensionHandle pooled;
      if (!c->Subtract(c->Dim(splits, 0), 1, &pooled).ok()) {
        return errors::InvalidArgument("pool_splits must have at least one element");
      }
      c->set_output(0, c->Matrix(pooled, c->Dim(rows, 1)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
output[p] = combine_f(rows[recover_indices[j]] for j in [pool_splits[p], pool_splits[p+1])),
where f is the feature of pool segment p. Empty segments give zeros.

rows: [m, D] received rows.
recover_indices: [n] I_r, values in [0, m).
pool_splits: [P+1] row splits of the P pooled outputs (samples of all features) over n.
feature_pool_splits: [F+1] row splits of the F features over the P pooled outputs.
combiners: F strings, the pooling of each feature ('sum', 'mean' or 'sqrtn').
output: [P, D].
)doc");

REGISTER_OP("FusedEmb>RecoveryPoolGrad")
    .Input("grad: T")
    .Input("recover_indices: int32")
    .Input("pool_splits: int64")
    .Input("feature_pool_splits: int64")
    .Input("num_rows: int32")
    .Output("rows_grad: T")
    .Attr("T: {float, double}")
    .Attr("combiners: list({'sum', 'mean', 'sqrtn'}) >= 1")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle grad;
      TF_RETURN_IF_ERROR(InputWithRank(c, 0, 2, "grad", &grad));
      DimensionHandle m;
      TF_RETURN_IF_ERROR(CountInput(c, 4, 0, "num_rows", &m));
      c->set_output(0, c->Matrix(m, c->Dim(grad, 1)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Gradient of RecoveryPool: an unsorted segment sum of the weighted pooled gradients
by recover_indices, rows_grad: [num_rows, D].
)doc");

}  // namespace fusedemb
}  // namespace tensorflow
