// Interface of FusedEmb>ExchangeCounts: one AlltoAll round's communication counters
// (tf_fusedemb.comm.counters) in one op, instead of some twenty small TF ops per round.
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "shape_fn_util.h"

namespace tensorflow {
namespace fusedemb {

using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

REGISTER_OP("FusedEmb>ExchangeCounts")
    .Input("send_splits: int32")
    .Input("recv_splits: int32")
    .Input("like: T")
    .Output("counts: int64")
    .Attr("T: type")
    .Attr("rank: int >= 0")
    .Attr("same_node: list(bool) = []")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle send, recv;
      TF_RETURN_IF_ERROR(InputWithRank(c, 0, 1, "send_splits", &send));
      TF_RETURN_IF_ERROR(InputWithRank(c, 1, 1, "recv_splits", &recv));
      std::vector<bool> same_node;
      TF_RETURN_IF_ERROR(c->GetAttr("same_node", &same_node));
      c->set_output(0, c->Vector(same_node.empty() ? 4 : 12));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The counter increments of one AlltoAll round among k ranks, this one at position `rank`.

send_splits: [k] rows sent to each member of the collective's set.
recv_splits: [k] rows received from each member.
like: the tensor exchanged; only its shape and dtype are read (bytes per row: the
  product of its dimensions after the first, times the dtype's size).
same_node: [k] whether each member is on this rank's node, or empty for totals only.
counts: [4] (rounds, bytes_sent, bytes_received, messages) over the other members; with
  same_node, [12]: those, then the same four over the other members on this node
  (intra), then over the members on other nodes (inter). An intra or inter round counts
  1 when the set has at least one member of that class.
)doc");

}  // namespace fusedemb
}  // namespace tensorflow
