// Interface of FusedEmb>CategoryHash: deferred category hashing and the owner-side
// unique (FusedRec step b.1).
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "shape_fn_util.h"

namespace tensorflow {
namespace fusedemb {

using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

REGISTER_OP("FusedEmb>CategoryHash")
    .Input("ids: T")
    .Input("segment_ids: int32")
    .Output("lookup_keys: int64")
    .Output("lookup_ids: T")
    .Output("lookup_segment_ids: int32")
    .Output("inverse: int32")
    .Output("counts: int32")
    .Output("num_collisions: int64")
    .Attr("T: {int32, int64}")
    .Attr("categories: list(string) >= 1")
    .Attr("mode: {'hashed', 'packed'} = 'hashed'")
    .Attr("id_bits: int = -1")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids, seg;
      TF_RETURN_IF_ERROR(InputWithRank(c, 0, 1, "ids", &ids));
      TF_RETURN_IF_ERROR(InputWithRank(c, 1, 1, "segment_ids", &seg));
      if (!c->Merge(ids, seg, &ids).ok()) {
        return errors::InvalidArgument("ids and segment_ids must have the same length, got ",
                                       c->DebugString(c->input(0)), " and ",
                                       c->DebugString(c->input(1)));
      }
      auto unknown = c->Vector(InferenceContext::kUnknownDim);
      c->set_output(0, unknown);
      c->set_output(1, unknown);
      c->set_output(2, unknown);
      c->set_output(3, ids);
      c->set_output(4, unknown);
      c->set_output(5, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
Unified keys H(category, id) computed on the owner, then unique over them.

mode='hashed': H = Mix64(uint64(id) XOR tag(category)), tag = Mix64(FNV1a64(name)).
  Never collides within a category; ids x of a and y of b collide iff
  x XOR y == tag(a) XOR tag(b). Colliding pairs share one row; they are counted.
mode='packed': H = (segment << id_bits) | id, exact; ids must lie in [0, 2^id_bits).
  id_bits defaults to 63 - ceil(log2(M)).

ids: [n] received instance IDs.
segment_ids: [n] category index of each ID, in [0, M).
lookup_keys: [u] unique unified keys, first-occurrence order.
lookup_ids: [u] instance ID of the first (category, id) pair behind each key.
lookup_segment_ids: [u] category of that pair.
inverse: [n] lookup_keys[inverse[i]] == H(segment_ids[i], ids[i]) (the paper's I_l).
counts: [u] occurrences of each key.
num_collisions: distinct (category, id) pairs that met a key held by another pair.
)doc");

}  // namespace fusedemb
}  // namespace tensorflow
