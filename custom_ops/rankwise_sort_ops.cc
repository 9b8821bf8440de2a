// Interfaces of FusedEmb>RankwiseSort (FusedRec step a.3) and FusedEmb>OwnerRank.
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "shape_fn_util.h"

namespace tensorflow {
namespace fusedemb {

using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

REGISTER_OP("FusedEmb>RankwiseSort")
    .Input("keys: T")
    .Input("segment_splits: int64")
    .Input("num_ranks: int32")
    .Output("sorted_keys: T")
    .Output("sorted_segment_ids: int32")
    .Output("rank_splits: int32")
    .Output("indices: int32")
    .Attr("T: {int32, int64}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle keys, splits, ranks;
      TF_RETURN_IF_ERROR(InputWithRank(c, 0, 1, "keys", &keys));
      TF_RETURN_IF_ERROR(InputWithRank(c, 1, 1, "segment_splits", &splits));
      TF_RETURN_IF_ERROR(InputWithRank(c, 2, 0, "num_ranks", &ranks));
      DimensionHandle num_ranks;
      TF_RETURN_IF_ERROR(CountInput(c, 2, 1, "num_ranks", &num_ranks));
      c->set_output(0, keys);
      c->set_output(1, keys);
      c->set_output(2, c->Vector(num_ranks));
      c->set_output(3, keys);
      return absl::OkStatus();
    })
    .Doc(R"doc(
Stable counting sort of keys by owner rank, owner = Mix64(uint64(key)) mod num_ranks.

keys: [n] keys of M segments, segment-major (the output of SegmentUnique).
segment_splits: [M+1] row splits of the segments.
num_ranks: scalar, number of ranks N > 0.
sorted_keys: [n] keys grouped by owner, input order kept within an owner.
sorted_segment_ids: [n] segment of each sorted key.
rank_splits: [N] number of keys per owner (the splits hvd.alltoall takes).
indices: [n] position of keys[i] in sorted_keys (the paper's I_s).
)doc");

REGISTER_OP("FusedEmb>OwnerRank")
    .Input("keys: T")
    .Input("num_ranks: int32")
    .Output("owners: int32")
    .Attr("T: {int32, int64}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ranks;
      TF_RETURN_IF_ERROR(InputWithRank(c, 1, 0, "num_ranks", &ranks));
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Owner rank of each key: Mix64(uint64(key)) mod num_ranks (the rule RankwiseSort uses).
)doc");

}  // namespace fusedemb
}  // namespace tensorflow
