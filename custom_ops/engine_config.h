// The storage engine's configuration: what one engine (a fused group's table on one rank)
// is made of (dim, optimizer and its hyperparameters, initializer, row dtype, shard
// count), the names the ops parse them from, their validation, and Fmix64, the one hash
// that shards the keys, places them in the index and seeds their initial rows.
//
// Part of the engine that embedding_engine.h composes; plain C++17, no TensorFlow header.
#ifndef TF_FUSEDEMB_ENGINE_CONFIG_H_
#define TF_FUSEDEMB_ENGINE_CONFIG_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace tensorflow {
namespace fusedemb {
namespace engine {

// fmix64, the library's one hash (fusedemb_common.h's Mix64, tf_fusedemb.ops.hashing.mix64);
// restated here so the engine needs no TensorFlow header. Initial rows depend on it bit
// for bit, which the tests check against the Python mirrors.
inline uint64_t Fmix64(uint64_t x) {
  x = (x ^ (x >> 33)) * 0xff51afd7ed558ccdULL;
  x = (x ^ (x >> 33)) * 0xc4ceb9fe1a85ec53ULL;
  return x ^ (x >> 33);
}

enum class Optimizer { kSgd, kAdagrad, kFtrl, kAdam };
enum class Init { kZeros, kUniform, kNormal, kTruncatedNormal };

struct Config {
  int dim = 0;
  Optimizer optimizer = Optimizer::kSgd;
  float learning_rate = 0.0f;
  float initial_accumulator = 0.1f;  // adagrad, ftrl
  float beta1 = 0.9f, beta2 = 0.999f, epsilon = 1e-7f;  // adam
  float lr_power = -0.5f, l1 = 0.0f, l2 = 0.0f;         // ftrl
  bool bf16_rows = false;  // rows stored as bfloat16; slots and the optimizer stay float32
  Init init = Init::kUniform;
  double init_loc = 0.0, init_scale = 0.0;  // uniform: (minval, maxval - minval); normal: (mean, stddev)
  int num_shards = 16;                      // a power of two
};

// The value named `name` in a table of (name, value) pairs; false if none is.
template <typename T, size_t N>
bool ParseName(const std::pair<const char*, T> (&names)[N], const std::string& name, T* out) {
  for (const auto& p : names) {
    if (name == p.first) return *out = p.second, true;
  }
  return false;
}

inline bool ParseOptimizer(const std::string& name, Optimizer* out) {
  static const std::pair<const char*, Optimizer> kNames[] = {
      {"sgd", Optimizer::kSgd}, {"adagrad", Optimizer::kAdagrad},
      {"ftrl", Optimizer::kFtrl}, {"adam", Optimizer::kAdam}};
  return ParseName(kNames, name, out);
}

inline bool ParseInit(const std::string& name, Init* out) {
  static const std::pair<const char*, Init> kNames[] = {
      {"zeros", Init::kZeros}, {"uniform", Init::kUniform},
      {"normal", Init::kNormal}, {"truncated_normal", Init::kTruncatedNormal}};
  return ParseName(kNames, name, out);
}

// Optimizer slots per row, each float[dim].
inline int NumSlots(Optimizer o) {
  switch (o) {
    case Optimizer::kSgd: return 0;
    case Optimizer::kAdagrad: return 1;
    default: return 2;  // ftrl (accumulator, linear), adam (m, v)
  }
}

// "" when the config is usable, else what is wrong with it.
inline std::string ValidateConfig(const Config& c) {
  if (c.dim <= 0) return "dim must be > 0, got " + std::to_string(c.dim);
  if (c.num_shards <= 0 || c.num_shards > 4096 || (c.num_shards & (c.num_shards - 1)) != 0) {
    return "num_shards must be a power of two in [1, 4096], got " + std::to_string(c.num_shards);
  }
  if (!(c.learning_rate > 0.0f)) return "learning_rate must be > 0";
  if (!std::isfinite(c.init_loc) || !std::isfinite(c.init_scale)) {
    return "initializer parameters must be finite";
  }
  return "";
}

}  // namespace engine
}  // namespace fusedemb
}  // namespace tensorflow

#endif  // TF_FUSEDEMB_ENGINE_CONFIG_H_
