// The TensorFlow framework headers that the op and kernel sources share. setup.py
// compiles this header once per build into a precompiled header and has each source that
// includes a TensorFlow framework header read it first: parsing these headers took about
// 3.4 of the 4 seconds each such source took to compile (14 of the library's sources).
// Nothing includes this file by name; without the precompiled header (another compiler,
// other flags) each source's own includes do the same, as they always do.
#ifndef TF_FUSEDEMB_TF_FRAMEWORK_H_
#define TF_FUSEDEMB_TF_FRAMEWORK_H_

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

#endif  // TF_FUSEDEMB_TF_FRAMEWORK_H_
