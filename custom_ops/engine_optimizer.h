// The optimizers: one step of SGD, Adagrad, FTRL or Adam on one row and its slots, in
// float32, operation for operation as tf_fusedemb.storage.optimizers (TF's formulas), and
// the slots' initial values. Stateless: a row's slots live in its block (engine_rows.h).
//
// Part of the engine that embedding_engine.h composes; plain C++17, no TensorFlow header.
#ifndef TF_FUSEDEMB_ENGINE_OPTIMIZER_H_
#define TF_FUSEDEMB_ENGINE_OPTIMIZER_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include "engine_config.h"

namespace tensorflow {
namespace fusedemb {
namespace engine {

constexpr float kAdagradEpsilon = 1e-7f;  // optimizers.ADAGRAD_EPSILON

// Per-batch constants of the optimizer step (Adam's bias-corrected learning rate).
struct StepConstants {
  float lr_t = 0.0f;
};

inline StepConstants MakeStepConstants(const Config& c, int64_t step) {
  StepConstants s;
  if (c.optimizer == Optimizer::kAdam) {
    // As TF computes it: float32 t, float32 pow (Eigen's pow is std::pow on floats).
    const float t = static_cast<float>(step);
    const float num = std::sqrt(1.0f - std::pow(c.beta2, t));
    s.lr_t = c.learning_rate * num / (1.0f - std::pow(c.beta1, t));
  }
  return s;
}

// Initial value of every element of slot `k`.
inline float InitialSlotValue(const Config& c, int k) {
  if (c.optimizer == Optimizer::kAdagrad || c.optimizer == Optimizer::kFtrl) {
    return k == 0 ? c.initial_accumulator : 0.0f;
  }
  return 0.0f;
}

// One optimizer step on one row, in place: row float[dim], slots float[num_slots*dim]
// (slot k at slots + k*dim), grad float[dim]. Each expression keeps the operation order
// of optimizers.py, so float32 results agree with TF's to rounding (usually exactly).
inline void ApplyOptimizer(const Config& c, const StepConstants& s, float* row, float* slots,
                           const float* g) {
  const int d = c.dim;
  const float lr = c.learning_rate;
  switch (c.optimizer) {
    case Optimizer::kSgd:
      for (int j = 0; j < d; ++j) row[j] = row[j] + (-g[j]) * lr;
      return;
    case Optimizer::kAdagrad: {
      int j = 0;
#if defined(__SSE2__)
      // 4 lanes at a time: _mm_sqrt_ps and _mm_div_ps round exactly like the scalar ops
      // (IEEE), but std::sqrt's errno path keeps the compiler from vectorizing the loop.
      const __m128 neg_lr = _mm_set1_ps(-lr), eps = _mm_set1_ps(kAdagradEpsilon);
      for (; j + 4 <= d; j += 4) {
        const __m128 gj = _mm_loadu_ps(g + j);
        const __m128 acc = _mm_add_ps(_mm_loadu_ps(slots + j), _mm_mul_ps(gj, gj));
        _mm_storeu_ps(slots + j, acc);
        const __m128 delta = _mm_div_ps(_mm_mul_ps(neg_lr, gj), _mm_sqrt_ps(_mm_add_ps(acc, eps)));
        _mm_storeu_ps(row + j, _mm_add_ps(_mm_loadu_ps(row + j), delta));
      }
#endif
      for (; j < d; ++j) {
        const float acc = slots[j] + g[j] * g[j];
        slots[j] = acc;
        row[j] = row[j] + (-lr * g[j]) / std::sqrt(acc + kAdagradEpsilon);
      }
      return;
    }
    case Optimizer::kFtrl: {
      const float power = -c.lr_power;
      float* acc = slots;
      float* linear = slots + d;
      for (int j = 0; j < d; ++j) {
        const float new_acc = acc[j] + std::pow(g[j], 2.0f);
        const float new_pow = std::pow(new_acc, power);
        const float lin = linear[j] + (g[j] - (new_pow - std::pow(acc[j], power)) / lr * row[j]);
        const float quadratic = new_pow / lr + 2.0f * c.l2;
        row[j] = (std::min(c.l1, std::max(-c.l1, lin)) - lin) / quadratic;
        acc[j] = new_acc;
        linear[j] = lin;
      }
      return;
    }
    case Optimizer::kAdam: {
      float* m = slots;
      float* v = slots + d;
      const float b1 = c.beta1, b2 = c.beta2;
      for (int j = 0; j < d; ++j) {
        const float gm = (1.0f - b1) * g[j];
        m[j] = b1 * m[j] + gm;
        const float gv = (1.0f - b2) * (g[j] * g[j]);
        v[j] = b2 * v[j] + gv;
        row[j] = row[j] - s.lr_t * m[j] / (std::sqrt(v[j]) + c.epsilon);
      }
      return;
    }
  }
}

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_ENGINE_OPTIMIZER_H_
