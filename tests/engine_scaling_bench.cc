// How the storage engine scales with cores, standalone (no TensorFlow runtime), so that it
// can be rerun on any machine: `make engine-bench` builds and runs it.
//
// For each thread count it times, on one table (dim 16, Adagrad, every row stored):
//   - two floors: the same batches' Adagrad step on plain float arrays of the same rows
//     (random gather, update, scatter, the new row copied out), the batch cut into one
//     range per thread: "plain" keeps rows and accumulators in two arrays [rows, 16] and
//     reads them in batch order; "prefetched" keeps each row beside its accumulator (as
//     the engine's block does) and prefetches the rows 8 keys ahead: the best a table
//     without an index can do;
//   - the engine's update as the op runs it: the keys partitioned by shard (in parallel,
//     one range per thread), then the shards' ApplyGradients spread over the threads;
//   - the engine's lookups (Lookup per shard), as keys per second;
//   - the partition alone, serial, for its share of the update had it stayed serial.
// and prints one line per thread count, then one JSON object (the last line) with
// {"rows", "batch", "threads": [...], "update_vs_floor": [...] (the plain floor),
//  "update_vs_prefetched_floor": [...], "partition_share": [...],
//  "serial_partition_share": [...], "lookups_per_s": [...], "update_ms": [...],
//  "floor_ms": [...], "prefetched_floor_ms": [...]}.
//
// Usage: engine_scaling_bench [rows=50000000] [threads=1,2,4,...,cores] [batch=262144]
//                             [steps=10]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "embedding_engine.h"

namespace e = tensorflow::fusedemb::engine;

namespace {

constexpr int kDim = 16;
constexpr float kLearningRate = 0.05f;

// A fixed set of threads that runs fn(q) for q in [0, parts), parts taken in turn, so that
// timings do not include starting threads.
class Pool {
 public:
  explicit Pool(int threads) {
    for (int t = 1; t < threads; ++t) workers_.emplace_back([this] { Work(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }
  void Run(int parts, const std::function<void(int)>& fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      parts_ = parts;
      next_.store(0);
      active_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    Drain();
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return active_ == 0; });
  }

 private:
  void Drain() {
    for (int q; (q = next_.fetch_add(1)) < parts_;) (*fn_)(q);
  }
  void Work() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      Drain();
      std::lock_guard<std::mutex> lock(mu_);
      if (--active_ == 0) done_.notify_one();
    }
  }
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* fn_ = nullptr;
  std::atomic<int> next_{0};
  int parts_ = 0, active_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// `steps` batches of `batch` distinct keys in [0, rows), uniformly drawn.
std::vector<std::vector<int64_t>> Batches(int64_t rows, int64_t batch, int steps) {
  std::mt19937_64 rng(1);
  std::uniform_int_distribution<int64_t> key(0, rows - 1);
  std::vector<std::vector<int64_t>> out(steps);
  for (auto& keys : out) {
    while (static_cast<int64_t>(keys.size()) < batch) {
      for (int64_t i = static_cast<int64_t>(keys.size()); i < batch; ++i) keys.push_back(key(rng));
      std::sort(keys.begin(), keys.end());
      keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
    }
    std::shuffle(keys.begin(), keys.end(), rng);
  }
  return out;
}

e::Config AdagradConfig() {
  e::Config c;
  c.dim = kDim;
  c.optimizer = e::Optimizer::kAdagrad;
  c.learning_rate = kLearningRate;
  c.init = e::Init::kUniform;
  c.init_loc = -0.05;
  c.init_scale = 0.1;
  return c;
}

// The engine's shard-parallel part of an op: fn(shard, span) over the shards, in turn.
void ForShards(Pool& pool, const e::Engine& eng, const e::Partition& p,
               const std::function<void(int, e::Span)>& fn) {
  pool.Run(eng.num_shards(), [&](int s) {
    const e::Span span = p.Of(s);
    if (span.size > 0) fn(s, span);
  });
}

e::Partition Partition(Pool& pool, int threads, const e::Engine& eng,
                       const std::vector<int64_t>& keys) {
  return eng.PartitionKeys(keys.data(), static_cast<int64_t>(keys.size()), threads,
                           [&pool](int parts, const std::function<void(int)>& fn) {
                             pool.Run(parts, fn);
                           });
}

// Every row of [0, rows) stored, as training would leave it.
void Fill(Pool& pool, int threads, e::Engine& eng, int64_t rows) {
  const int64_t chunk = int64_t{1} << 20;
  std::vector<int64_t> keys;
  std::vector<float> grads(chunk * kDim, 0.0f), out(chunk * kDim);
  const e::StepConstants step = e::MakeStepConstants(eng.config(), 1);
  for (int64_t lo = 0; lo < rows; lo += chunk) {
    keys.resize(std::min(chunk, rows - lo));
    for (size_t i = 0; i < keys.size(); ++i) keys[i] = lo + static_cast<int64_t>(i);
    ForShards(pool, eng, Partition(pool, threads, eng, keys), [&](int s, e::Span span) {
      eng.ApplyGradients(s, span, keys.data(), keys.data(), grads.data(), step, nullptr, 0,
                         out.data());
    });
  }
}

struct Timing {
  double floor_s = 0, prefetched_floor_s = 0, update_s = 0, partition_s = 0;
  double serial_partition_s = 0, lookup_s = 0;
};

// The plain floor's step on keys [begin, end): rows and accumulators float[rows, kDim].
void PlainFloorStep(float* rows, float* acc, const int64_t* keys, const float* grads,
                    float* out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float* row = rows + keys[i] * kDim;
    float* a = acc + keys[i] * kDim;
    const float* g = grads + i * kDim;
    for (int j = 0; j < kDim; ++j) {
      a[j] += g[j] * g[j];
      row[j] -= kLearningRate * g[j] / std::sqrt(a[j] + 1e-7f);
      out[i * kDim + j] = row[j];
    }
  }
}

// The prefetched floor's step on keys [begin, end): `table` holds each row followed by
// its accumulator (float[rows, 2 * kDim]).
void FloorStep(float* table, const int64_t* keys, const float* grads, float* out,
               int64_t begin, int64_t end) {
  constexpr int64_t kAhead = 8;
  for (int64_t i = begin; i < end; ++i) {
    if (i + kAhead < end) {
      const float* next = table + keys[i + kAhead] * 2 * kDim;
      __builtin_prefetch(next, 1);
      __builtin_prefetch(next + kDim, 1);
    }
    float* row = table + keys[i] * 2 * kDim;
    float* a = row + kDim;
    const float* g = grads + i * kDim;
    for (int j = 0; j < kDim; ++j) {
      a[j] += g[j] * g[j];
      row[j] -= kLearningRate * g[j] / std::sqrt(a[j] + 1e-7f);
      out[i * kDim + j] = row[j];
    }
  }
}

// The arrays of both floors.
struct Floors {
  std::vector<float> rows, acc, table;
  explicit Floors(int64_t n) : rows(n * kDim, 0.01f), acc(n * kDim, 0.1f), table(n * 2 * kDim, 0.1f) {}
};

Timing Measure(int threads, e::Engine& eng, Floors& floors,
               const std::vector<std::vector<int64_t>>& batches) {
  Pool pool(threads);
  Timing t;
  const int64_t batch = static_cast<int64_t>(batches[0].size());
  std::vector<float> grads(batch * kDim, 1e-3f), out(batch * kDim);
  for (size_t b = 0; b < batches.size(); ++b) {
    const std::vector<int64_t>& keys = batches[b];
    auto start = std::chrono::steady_clock::now();
    pool.Run(threads, [&](int q) {
      PlainFloorStep(floors.rows.data(), floors.acc.data(), keys.data(), grads.data(),
                     out.data(), batch * q / threads, batch * (q + 1) / threads);
    });
    t.floor_s += Seconds(start);

    start = std::chrono::steady_clock::now();
    pool.Run(threads, [&](int q) {
      FloorStep(floors.table.data(), keys.data(), grads.data(), out.data(), batch * q / threads,
                batch * (q + 1) / threads);
    });
    t.prefetched_floor_s += Seconds(start);

    start = std::chrono::steady_clock::now();
    eng.PartitionKeys(keys.data(), batch);
    t.serial_partition_s += Seconds(start);

    start = std::chrono::steady_clock::now();
    const e::Partition p = Partition(pool, threads, eng, keys);
    t.partition_s += Seconds(start);
    const e::StepConstants step = e::MakeStepConstants(eng.config(), static_cast<int64_t>(b) + 2);
    ForShards(pool, eng, p, [&](int s, e::Span span) {
      eng.ApplyGradients(s, span, keys.data(), keys.data(), grads.data(), step, nullptr, 0,
                         out.data());
    });
    t.update_s += Seconds(start);

    start = std::chrono::steady_clock::now();
    const e::Partition q = Partition(pool, threads, eng, keys);
    ForShards(pool, eng, q, [&](int s, e::Span span) {
      eng.Lookup(s, span, keys.data(), keys.data(), out.data());
    });
    t.lookup_s += Seconds(start);
  }
  return t;
}

std::vector<int> ThreadCounts(const char* arg) {
  std::vector<int> out;
  if (arg != nullptr) {
    for (const char* p = arg; *p;) {
      out.push_back(std::atoi(p));
      while (*p && *p != ',') ++p;
      if (*p == ',') ++p;
    }
    return out;
  }
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int t = 1; t < cores; t *= 2) out.push_back(t);
  out.push_back(cores);
  return out;
}

std::string Json(const std::vector<double>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%s%.4g", i ? ", " : "", v[i]);
    s += buf;
  }
  return s + "]";
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t rows = argc > 1 ? std::atoll(argv[1]) : 50000000;
  const std::vector<int> threads = ThreadCounts(argc > 2 ? argv[2] : nullptr);
  const int64_t batch = argc > 3 ? std::atoll(argv[3]) : 262144;
  const int steps = argc > 4 ? std::atoi(argv[4]) : 10;
  if (rows < 2 * batch || batch < 1 || steps < 1 || threads.empty()) {
    std::fprintf(stderr, "usage: engine_scaling_bench [rows] [threads,..] [batch] [steps] "
                         "(rows >= 2 * batch)\n");
    return 2;
  }
  const int most = *std::max_element(threads.begin(), threads.end());
  e::Engine eng(AdagradConfig());
  {
    Pool pool(most);
    const auto start = std::chrono::steady_clock::now();
    Fill(pool, most, eng, rows);
    std::fprintf(stderr, "filled %lld rows in %.1f s (%.1f bytes per row in DRAM)\n",
                 static_cast<long long>(rows), Seconds(start),
                 static_cast<double>(eng.Size().bytes_held) / static_cast<double>(rows));
  }
  Floors floors(rows);
  const auto batches = Batches(rows, batch, steps);
  Measure(most, eng, floors, {batches[0]});  // warm-up: page in what a step touches
  std::vector<double> ratio, prefetched_ratio, share, serial_share, lookups, update_ms,
      floor_ms, prefetched_floor_ms;
  for (int t : threads) {
    const Timing m = Measure(t, eng, floors, batches);
    ratio.push_back(m.floor_s / m.update_s);
    prefetched_ratio.push_back(m.prefetched_floor_s / m.update_s);
    prefetched_floor_ms.push_back(1e3 * m.prefetched_floor_s / steps);
    share.push_back(m.partition_s / m.update_s);
    serial_share.push_back(m.serial_partition_s / (m.update_s - m.partition_s + m.serial_partition_s));
    lookups.push_back(static_cast<double>(batch) * steps / m.lookup_s);
    update_ms.push_back(1e3 * m.update_s / steps);
    floor_ms.push_back(1e3 * m.floor_s / steps);
    std::printf("threads %2d: update %.2f ms, floors %.2f / %.2f ms (plain / prefetched), "
                "update vs floors %.3f / %.3f, partition %.1f%% of the update (serial: %.1f%%), "
                "lookups %.1f M/s\n",
                t, update_ms.back(), floor_ms.back(), prefetched_floor_ms.back(), ratio.back(),
                prefetched_ratio.back(), 100 * share.back(),
                100 * serial_share.back(), lookups.back() / 1e6);
  }
  std::vector<double> counts(threads.begin(), threads.end());
  std::printf("{\"rows\": %lld, \"batch\": %lld, \"threads\": %s, \"update_vs_floor\": %s, "
              "\"update_vs_prefetched_floor\": %s, \"partition_share\": %s, \"serial_partition_share\": %s, "
              "\"lookups_per_s\": %s, \"update_ms\": %s, \"floor_ms\": %s, "
              "\"prefetched_floor_ms\": %s}\n",
              static_cast<long long>(rows), static_cast<long long>(batch), Json(counts).c_str(),
              Json(ratio).c_str(), Json(prefetched_ratio).c_str(), Json(share).c_str(), Json(serial_share).c_str(),
              Json(lookups).c_str(),
              Json(update_ms).c_str(), Json(floor_ms).c_str(), Json(prefetched_floor_ms).c_str());
  return 0;
}
