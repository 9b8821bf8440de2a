// Interface of FusedEmb>FindKeys (NestPipe's key-set intersection between batches).
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "shape_fn_util.h"

namespace tensorflow {
namespace fusedemb {

using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

REGISTER_OP("FusedEmb>FindKeys")
    .Input("keys: int64")
    .Input("table_keys: int64")
    .Output("found: bool")
    .Output("index: int32")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle keys, table;
      TF_RETURN_IF_ERROR(InputWithRank(c, 0, 1, "keys", &keys));
      TF_RETURN_IF_ERROR(InputWithRank(c, 1, 1, "table_keys", &table));
      c->set_output(0, keys);
      c->set_output(1, keys);
      return absl::OkStatus();
    })
    .Doc(R"doc(
Where each key occurs in table_keys, in one op.

keys: [k] the keys looked for.
table_keys: [v] the keys looked in; of equal entries, the first one's position is given.
found: [k] whether keys[i] is in table_keys.
index: [k] the position of keys[i] in table_keys where found, 0 elsewhere.
)doc");

}  // namespace fusedemb
}  // namespace tensorflow
