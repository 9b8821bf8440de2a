// Initial rows: the row a key has before its first update, a pure function of the key
// and the configuration's initializer, bit-equal to tf_fusedemb.storage.initializers
// (float64 math, one cast to float32). Owns nothing but the per-column seeds.
//
// Part of the engine that embedding_engine.h composes; plain C++17, no TensorFlow header.
#ifndef TF_FUSEDEMB_ENGINE_INITIALIZER_H_
#define TF_FUSEDEMB_ENGINE_INITIALIZER_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "engine_config.h"

namespace tensorflow {
namespace fusedemb {
namespace engine {

constexpr uint64_t kInitSalt = 0x9E3779B97F4A7C15ULL;  // initializers.SALT
constexpr int kTruncatedDraws = 8;                     // initializers.TRUNCATED_DRAWS

// Rows of never-stored keys: b[k, j] = Fmix64(uint64(k) ^ Fmix64(j + SALT)), turned into
// a uniform / normal / truncated normal in float64 and cast to float32 once, exactly as
// tf_fusedemb.storage.initializers does (see its docstring for the bit layout).
class RowInitializer {
 public:
  explicit RowInitializer(const Config& c) : init_(c.init), loc_(c.init_loc), scale_(c.init_scale) {
    seeds_.resize(c.dim);
    for (int j = 0; j < c.dim; ++j) seeds_[j] = Fmix64(static_cast<uint64_t>(j) + kInitSalt);
  }

  void Fill(int64_t key, float* out) const {
    const int dim = static_cast<int>(seeds_.size());
    if (init_ == Init::kZeros) {
      std::fill(out, out + dim, 0.0f);
      return;
    }
    for (int j = 0; j < dim; ++j) {
      const uint64_t b = Fmix64(static_cast<uint64_t>(key) ^ seeds_[j]);
      // Two statements, so no compiler may contract them into an FMA (the mirrors round twice).
      const double scaled = scale_ * Standard(b);
      out[j] = static_cast<float>(loc_ + scaled);
    }
  }

 private:
  static double Uniform24(uint64_t bits24) { return static_cast<double>(bits24) * 0x1p-24; }

  // Box-Muller on bits 63..40 (u1 in (0, 1]) and 39..16 (u2 in [0, 1)) of one word.
  static double Normal(uint64_t b) {
    const double u1 = Uniform24((b >> 40) + 1);
    const double u2 = Uniform24((b >> 16) & 0xFFFFFF);
    const double two_pi_u2 = (2.0 * M_PI) * u2;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(two_pi_u2);
  }

  double Standard(uint64_t b) const {
    if (init_ == Init::kUniform) return Uniform24(b >> 40);
    double z = Normal(b);
    if (init_ == Init::kNormal) return z;
    // Truncated: redraw outside [-2, 2] from b_r = Fmix64(b_{r-1} + SALT), clip the last.
    for (int r = 1; r < kTruncatedDraws && !(std::fabs(z) <= 2.0); ++r) {
      b = Fmix64(b + kInitSalt);
      z = Normal(b);
    }
    return std::min(2.0, std::max(-2.0, z));
  }

  Init init_;
  double loc_, scale_;
  std::vector<uint64_t> seeds_;
};

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_ENGINE_INITIALIZER_H_
