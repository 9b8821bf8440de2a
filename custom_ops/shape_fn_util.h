// Helpers of the ops' shape functions: errors that name the argument ("keys must have
// rank 1, got shape [2,2]") instead of TF's "Shape must be rank 1 but is rank 2 for node".
#ifndef TF_FUSEDEMB_SHAPE_FN_UTIL_H_
#define TF_FUSEDEMB_SHAPE_FN_UTIL_H_

#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/errors.h"

namespace tensorflow {
namespace fusedemb {

// c->WithRank(input(index), rank) with an error naming the input.
inline Status InputWithRank(shape_inference::InferenceContext* c, int index, int rank,
                            const char* name, shape_inference::ShapeHandle* out) {
  if (!c->WithRank(c->input(index), rank, out).ok()) {
    return errors::InvalidArgument(name, " must have rank ", rank, ", got shape ",
                                   c->DebugString(c->input(index)));
  }
  return OkStatus();
}

// c->MakeDimForScalarInput(index) for a count input that must be >= min_value.
inline Status CountInput(shape_inference::InferenceContext* c, int index, int64_t min_value,
                         const char* name, shape_inference::DimensionHandle* out) {
  if (!c->MakeDimForScalarInput(index, out).ok() ||
      (c->ValueKnown(*out) && c->Value(*out) < min_value)) {
    return errors::InvalidArgument(name, " must be a scalar >= ", min_value);
  }
  return OkStatus();
}

}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_SHAPE_FN_UTIL_H_
