// Interfaces of the key exchange's wire format and the plan-independent unified key:
// FusedEmb>PackKeyMessages, FusedEmb>UnpackKeyMessages and FusedEmb>HashedUnifiedKeys.
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "shape_fn_util.h"

namespace tensorflow {
namespace fusedemb {

using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

namespace {
// Merges the lengths of the rank-1 inputs `indices` (all named in `names`) into `*n`.
Status SameLengthVectors(InferenceContext* c, std::initializer_list<int> indices,
                         std::initializer_list<const char*> names, ShapeHandle* n) {
  auto name = names.begin();
  bool first = true;
  for (int i : indices) {
    ShapeHandle v;
    TF_RETURN_IF_ERROR(InputWithRank(c, i, 1, *name, &v));
    if (first) {
      *n = v;
      first = false;
    } else if (!c->Merge(*n, v, n).ok()) {
      return errors::InvalidArgument(*names.begin(), " and ", *name,
                                     " must have the same length, got ",
                                     c->DebugString(c->input(*indices.begin())), " and ",
                                     c->DebugString(c->input(i)));
    }
    ++name;
  }
  return OkStatus();
}
}  // namespace

REGISTER_OP("FusedEmb>KeyMessageCategoryBits")
    .Output("category_bits: int32")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
The bits of a key message's table field (messages[:, 1] = count << bits | table): the one
definition of the wire format, read by tf_fusedemb.ops.key_messages.category_bits().
)doc");

REGISTER_OP("FusedEmb>PackKeyMessages")
    .Input("sorted_keys: T")
    .Input("sorted_segment_ids: int32")
    .Input("indices: int32")
    .Input("counts: Tcount")
    .Input("segment_table: int64")
    .Output("messages: int64")
    .Attr("T: {int32, int64}")
    .Attr("Tcount: {int32, int64}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle n, table;
      TF_RETURN_IF_ERROR(SameLengthVectors(
          c, {0, 1, 2, 3}, {"sorted_keys", "sorted_segment_ids", "indices", "counts"}, &n));
      TF_RETURN_IF_ERROR(InputWithRank(c, 4, 1, "segment_table", &table));
      c->set_output(0, c->Matrix(c->Dim(n, 0), 2));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Key messages of rank-sorted keys: messages[p] = (ID, count << 16 | table), in one pass.

For the key at sorted position p = indices[u]: ID = int64(sorted_keys[p]),
table = segment_table[sorted_segment_ids[p]], count = counts[u]. Replaces
gather(counts, invert_permutation(indices)), gather(segment_table, sorted_segment_ids),
the shifts and the stack.

sorted_keys: [n] keys grouped by owner (RankwiseSort's sorted_keys).
sorted_segment_ids: [n] segment of each sorted key, in [0, M).
indices: [n] a permutation of [0, n): sorted_keys[indices[u]] is unique key u (I_s).
counts: [n] occurrences of unique key u, in unique (pre-sort) order; in [0, 2^47).
segment_table: [M] table of each segment, in [0, 2^16 - 1) (2^16 - 1 marks a
  bad-input report).
messages: [n, 2] int64, in sorted order.
)doc");

REGISTER_OP("FusedEmb>UnpackKeyMessages")
    .Input("messages: int64")
    .Output("ids: int64")
    .Output("counts: int64")
    .Output("tables: int32")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle messages;
      DimensionHandle two;
      if (!c->WithRank(c->input(0), 2, &messages).ok() ||
          !c->WithValue(c->Dim(messages, 1), 2, &two).ok()) {
        return errors::InvalidArgument("messages must have shape [n, 2], got ",
                                       c->DebugString(c->input(0)));
      }
      ShapeHandle n = c->Vector(c->Dim(messages, 0));
      for (int i = 0; i < 3; ++i) c->set_output(i, n);
      return absl::OkStatus();
    })
    .Doc(R"doc(
Fields of key messages (ID, count << 16 | table): ids = messages[:, 0],
counts = messages[:, 1] >> 16 (arithmetic), tables = int32(messages[:, 1] & 0xFFFF).
Any message decodes, a bad-input report too (its table field is 0xFFFF).

messages: [n, 2] received key messages.
)doc");

REGISTER_OP("FusedEmb>HashedUnifiedKeys")
    .Input("ids: T")
    .Input("tables: Tidx")
    .Input("tags: int64")
    .Output("keys: int64")
    .Attr("T: {int32, int64}")
    .Attr("Tidx: {int32, int64}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle n, tags;
      TF_RETURN_IF_ERROR(SameLengthVectors(c, {0, 1}, {"ids", "tables"}, &n));
      TF_RETURN_IF_ERROR(InputWithRank(c, 2, 1, "tags", &tags));
      c->set_output(0, n);
      return absl::OkStatus();
    })
    .Doc(R"doc(
Plan-independent unified keys: keys[i] = int64(Mix64(uint64(ids[i]) XOR uint64(tags[tables[i]]))).

ids: [n] instance IDs (int32 IDs are sign-extended, as tf.cast does).
tables: [n] table index of each ID, in [0, T).
tags: [T] 64-bit table tags (uint64 bits as int64; tf_fusedemb.ops.hashing.category_tags).
keys: [n] int64.
)doc");

}  // namespace fusedemb
}  // namespace tensorflow
