// Interface of FusedEmb>SegmentUnique (FusedRec step a.2).
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "shape_fn_util.h"

namespace tensorflow {
namespace fusedemb {

using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

REGISTER_OP("FusedEmb>SegmentUnique")
    .Input("keys: T")
    .Input("segment_splits: int64")
    .Output("unique_keys: T")
    .Output("unique_segment_splits: int64")
    .Output("inverse: int32")
    .Output("counts: int32")
    .Attr("T: {int32, int64}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle keys, splits;
      TF_RETURN_IF_ERROR(InputWithRank(c, 0, 1, "keys", &keys));
      TF_RETURN_IF_ERROR(InputWithRank(c, 1, 1, "segment_splits", &splits));
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      c->set_output(1, splits);
      c->set_output(2, keys);
      c->set_output(3, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Removes duplicate keys inside each segment in one pass; equal keys of different
segments are kept. Segments stay in order, keys keep first-occurrence order.

keys: [n] the fused keys of M segments, segment-major.
segment_splits: [M+1] row splits of the segments.
unique_keys: [u] unique keys, unique_keys[inverse[i]] == keys[i].
unique_segment_splits: [M+1] row splits of unique_keys.
inverse: [n] position of keys[i] in unique_keys (the paper's I_u).
counts: [u] occurrences of each unique key.
)doc");

}  // namespace fusedemb
}  // namespace tensorflow
