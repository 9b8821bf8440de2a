// Standalone tests of custom_ops/embedding_engine.h (and the engine_*.h it composes), no
// TensorFlow runtime: the arena's chunk arithmetic, a model-based test against
// std::unordered_map, and a stress test of parallel upserts (8 writer threads + readers,
// across many index doublings) that checks no row is lost. Built and run by `make
// sanitize` under ThreadSanitizer and under AddressSanitizer + UBSan (absl's out-of-line
// symbols come from TensorFlow's libtensorflow_framework.so.2, the same copy the op
// library links).
//
// Usage: engine_stress_test [keys_per_thread] [rounds]   exit status 0 = all passed.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "embedding_engine.h"

namespace e = tensorflow::fusedemb::engine;

namespace {

int failures = 0;

#define CHECK_TRUE(cond, ...)                          \
  do {                                                 \
    if (!(cond)) {                                     \
      std::fprintf(stderr, "FAILED %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);               \
      std::fprintf(stderr, "\n");                      \
      if (++failures > 20) std::exit(1);               \
    }                                                  \
  } while (0)

// Runs fn(shard, span) for every shard of the partition of keys[0..n).
template <typename F>
void ForShards(const e::Engine& eng, const std::vector<int64_t>& keys, F&& fn) {
  const e::Partition p = eng.PartitionKeys(keys.data(), static_cast<int64_t>(keys.size()));
  for (int s = 0; s < eng.num_shards(); ++s) fn(s, p.Of(s));
}

void TestArenaLocate() {
  uint64_t expected_chunk = 0, offset = 0;
  for (uint64_t i = 0; i < (uint64_t{1} << 22); ++i) {
    int c;
    uint64_t off;
    e::Arena::Locate(i, &c, &off);
    CHECK_TRUE(c == static_cast<int>(expected_chunk) && off == offset,
               "Locate(%llu) = (%d, %llu), expected (%llu, %llu)", (unsigned long long)i, c,
               (unsigned long long)off, (unsigned long long)expected_chunk,
               (unsigned long long)offset);
    if (++offset == e::Arena::ChunkBlocks(static_cast<int>(expected_chunk))) {
      ++expected_chunk;
      offset = 0;
    }
  }
}

e::Config SgdConfig(int dim, int shards) {
  e::Config c;
  c.dim = dim;
  c.optimizer = e::Optimizer::kSgd;
  c.learning_rate = 1.0f;
  c.init = e::Init::kZeros;
  c.num_shards = shards;
  return c;
}

// Model-based: random applies, records, row removals and forgets against a reference.
// With bfloat16 rows too: the values stay small integers, which bfloat16 holds exactly, so
// the same reference applies while the sanitizers check the other block layout.
void TestAgainstModel(bool bf16_rows) {
  struct Ref {
    bool stored = false, tracked = false;
    float value = 0;
    int64_t count = 0, id = 0, last = 0;
    int32_t table = -1;
  };
  e::Config config = SgdConfig(2, 4);
  config.bf16_rows = bf16_rows;
  e::Engine eng(config);
  std::unordered_map<int64_t, Ref> model;
  std::mt19937_64 rng(7);
  const int64_t min_counts[2] = {0, 3};
  for (int round = 0; round < 300; ++round) {
    std::vector<int64_t> keys;
    std::unordered_map<int64_t, bool> seen;
    for (int i = 0; i < 64; ++i) {
      const int64_t k = static_cast<int64_t>(rng() % 500) - 250;
      if (!seen[k]) keys.push_back(k), seen[k] = true;
    }
    const int op = static_cast<int>(rng() % 4);
    const int n = static_cast<int>(keys.size());
    if (op == 0) {  // record
      std::vector<int32_t> tables(n);
      std::vector<int64_t> ids(n), counts(n);
      const int64_t step = round;
      for (int i = 0; i < n; ++i) tables[i] = static_cast<int32_t>(rng() % 2), ids[i] = keys[i] * 3, counts[i] = 1 + rng() % 2;
      e::RecordArgs a{keys.data(), tables.data(), ids.data(), counts.data(), &step, 0, true};
      ForShards(eng, keys, [&](int s, e::Span p) { CHECK_TRUE(eng.Record(s, p, a).empty(), "record"); });
      for (int i = 0; i < n; ++i) {
        Ref& r = model[keys[i]];
        r.tracked = true, r.table = tables[i], r.id = ids[i], r.count += counts[i], r.last = step;
      }
    } else if (op == 1) {  // apply, with admission every other round
      const bool admit = round % 2 == 0;
      std::vector<float> grads(2 * n, 1.0f), out(2 * n);
      const e::StepConstants st = e::MakeStepConstants(eng.config(), round + 1);
      ForShards(eng, keys, [&](int s, e::Span p) {
        CHECK_TRUE(eng.ApplyGradients(s, p, keys.data(), keys.data(), grads.data(), st,
                                      min_counts, admit ? 2 : 0, out.data()).empty(), "apply");
      });
      for (int i = 0; i < n; ++i) {
        Ref& r = model[keys[i]];
        const bool ok = !admit || r.stored || !r.tracked || r.count >= min_counts[r.table];
        if (ok) r.stored = true, r.value -= 1.0f;
        CHECK_TRUE(out[2 * i] == (ok ? r.value : 0.0f), "apply out key %lld", (long long)keys[i]);
      }
    } else if (op == 2) {  // remove rows
      ForShards(eng, keys, [&](int s, e::Span p) { eng.RemoveRows(s, p, keys.data()); });
      for (int64_t k : keys) model[k].stored = false, model[k].value = 0;
    } else {  // forget statistics
      ForShards(eng, keys, [&](int s, e::Span p) { eng.Forget(s, p, keys.data()); });
      for (int64_t k : keys) {
        Ref& r = model[k];
        r.tracked = false, r.table = -1, r.count = 0, r.id = 0, r.last = 0;
      }
    }
    // Every key of the universe agrees with the model.
    std::vector<int64_t> all;
    for (int64_t k = -250; k < 250; ++k) all.push_back(k);
    std::vector<e::KeyFields> f(all.size());
    std::vector<float> rows(2 * all.size());
    ForShards(eng, all, [&](int s, e::Span p) {
      eng.Find(s, p, all.data(), f.data());
      eng.Lookup(s, p, all.data(), all.data(), rows.data());
    });
    int64_t stored = 0, tracked = 0;
    for (size_t i = 0; i < all.size(); ++i) {
      const Ref r = model.count(all[i]) ? model[all[i]] : Ref();
      stored += r.stored, tracked += r.tracked;
      CHECK_TRUE(f[i].stored == r.stored && f[i].table == r.table && f[i].count == r.count &&
                     f[i].id == r.id && f[i].last_step == r.last && rows[2 * i] == r.value,
                 "round %d key %lld: engine (%d %d %lld %lld %lld %g) model (%d %d %lld %lld %lld %g)",
                 round, (long long)all[i], f[i].stored, f[i].table, (long long)f[i].count,
                 (long long)f[i].id, (long long)f[i].last_step, rows[2 * i], r.stored, r.table,
                 (long long)r.count, (long long)r.id, (long long)r.last, r.value);
    }
    const e::Engine::Sizes z = eng.Size();
    CHECK_TRUE(z.stored == stored && z.tracked == tracked, "sizes %lld/%lld vs %lld/%lld",
               (long long)z.stored, (long long)z.tracked, (long long)stored, (long long)tracked);
  }
}

// 8 writers upsert overlapping key sets (every key by two threads), 2 readers look up
// meanwhile; each key gets exactly 2 * rounds updates of -1 (SGD, lr 1, zeros init).
void TestParallelUpserts(int64_t keys_per_thread, int rounds) {
  const int kWriters = 8, kBatch = 4096;
  e::Engine eng(SgdConfig(4, 16));
  const int64_t universe = keys_per_thread * kWriters / 2;
  std::atomic<bool> done{false};
  std::atomic<int64_t> bad_reads{0};
  auto writer = [&](int t) {
    // Thread t covers the keys of half-universe t/2... two threads per half-slice.
    const int64_t begin = (t / 2) * keys_per_thread, end = begin + keys_per_thread;
    std::mt19937_64 rng(t);
    for (int r = 0; r < rounds; ++r) {
      std::vector<int64_t> order;
      for (int64_t k = begin; k < end; ++k) order.push_back(k * 7919 + 11);
      std::shuffle(order.begin(), order.end(), rng);
      for (size_t off = 0; off < order.size(); off += kBatch) {
        std::vector<int64_t> keys(order.begin() + off,
                                  order.begin() + std::min(order.size(), off + kBatch));
        std::vector<float> grads(4 * keys.size(), 1.0f), out(4 * keys.size());
        ForShards(eng, keys, [&](int s, e::Span p) {
          eng.ApplyGradients(s, p, keys.data(), keys.data(), grads.data(), e::StepConstants(),
                             nullptr, 0, out.data());
        });
      }
    }
  };
  auto reader = [&]() {
    std::mt19937_64 rng(99);
    while (!done.load()) {
      std::vector<int64_t> keys(1024);
      for (auto& k : keys) k = static_cast<int64_t>(rng() % universe) * 7919 + 11;
      std::vector<float> rows(4 * keys.size());
      ForShards(eng, keys, [&](int s, e::Span p) {
        eng.Lookup(s, p, keys.data(), keys.data(), rows.data());
      });
      for (size_t i = 0; i < keys.size(); ++i) {  // whole updates only: -integer, same in a row
        const float v = rows[4 * i];
        if (v > 0 || v < -2 * rounds || v != static_cast<int>(v) || rows[4 * i + 3] != v) ++bad_reads;
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kWriters; ++t) threads.emplace_back(writer, t);
  std::thread r1(reader), r2(reader);
  for (auto& t : threads) t.join();
  done = true;
  r1.join();
  r2.join();
  CHECK_TRUE(bad_reads == 0, "%lld torn or impossible reads", (long long)bad_reads.load());
  std::vector<int64_t> all;
  for (int64_t k = 0; k < universe; ++k) all.push_back(k * 7919 + 11);
  std::vector<float> rows(4 * all.size());
  ForShards(eng, all, [&](int s, e::Span p) { eng.Lookup(s, p, all.data(), all.data(), rows.data()); });
  int64_t wrong = 0;
  for (size_t i = 0; i < all.size(); ++i) wrong += rows[4 * i] != -2.0f * rounds;
  const e::Engine::Sizes z = eng.Size();
  CHECK_TRUE(wrong == 0 && z.stored == universe, "%lld of %lld keys wrong, %lld stored",
             (long long)wrong, (long long)universe, (long long)z.stored);
  std::printf("parallel upserts: %lld keys x %d rounds x 2 writers each, %lld bytes held (%.1f per row)\n",
              (long long)universe, rounds, (long long)z.bytes_held,
              static_cast<double>(z.bytes_held) / universe);
}

}  // namespace

// The parallel partition (ranges on threads of their own) equals the serial one, for
// sizes below, at and above the smallest range, and more ranges than threads.
void TestParallelPartition() {
  e::Engine eng(SgdConfig(2, 16));
  std::mt19937_64 rng(3);
  auto on_threads = [](int parts, const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int q = 0; q < parts; ++q) threads.emplace_back(fn, q);
    for (auto& t : threads) t.join();
  };
  for (int64_t n : {int64_t{0}, int64_t{5}, e::kMinKeysPerPart, 7 * e::kMinKeysPerPart + 3}) {
    std::vector<int64_t> keys(n);
    for (auto& k : keys) k = static_cast<int64_t>(rng() % 100000);  // repeats too
    const e::Partition want = eng.PartitionKeys(keys.data(), n);
    for (int parts : {2, 3, 8}) {
      const e::Partition got = eng.PartitionKeys(keys.data(), n, parts, on_threads);
      CHECK_TRUE(got.order == want.order && got.begin == want.begin,
                 "parallel partition of %lld keys in %d ranges differs", (long long)n, parts);
    }
  }
}

int main(int argc, char** argv) {
  const int64_t keys_per_thread = argc > 1 ? std::atoll(argv[1]) : 80000;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 3;
  TestArenaLocate();
  TestAgainstModel(false);
  TestAgainstModel(true);
  TestParallelPartition();
  TestParallelUpserts(keys_per_thread, rounds);
  if (failures) {
    std::fprintf(stderr, "%d failures\n", failures);
    return 1;
  }
  std::printf("engine_stress_test: all passed\n");
  return 0;
}
