// The SSD tier's CPU per block moved, standalone (no TensorFlow runtime, no Python), so a
// change to the tier (engine_tier.h, slot_file_block_store.cc) is measured on its own:
// `make tier-bench` builds and runs it.
//
// One table (dim 16, Adagrad, 16 shards) grown to `rows` rows, then trained on `steps`
// batches of `batch` unique keys drawn as benchmarks.storage's ZipfKeys draws them (Zipf
// ranks, exponent 1.05, over the keys stored so far, the rest uniform; 2% new keys; keys
// are Fmix64 of the rank). A step is a training step's three engine calls, each between
// Pin and Unpin as the op runs them: Lookup, Record (statistics), ApplyGradients. The
// same batches run on the engine without a budget and with `fraction` of the table's
// payload as its budget, the shards in turn on one thread, so process CPU time is the
// tier's work and nothing else. `warm` untimed Zipf steps come first: the growth gives
// every key an access count of 1, and the victims are chosen by count, so the first Zipf
// steps measure how fast the counts tell the hot keys apart, not the tier's steady state
// (warm=0 measures from the growth on). Prints one JSON line:
//   per_block_us  (tiered CPU - all-DRAM CPU) / (blocks read back + blocks spilled)
//   hit_rate      1 - blocks read back / keys of the steps stored before them
//   dram_ms, tiered_ms  CPU per step; reads, spills  blocks per step
//   exact         every row of the tiered engine equals the untiered engine's, bit for bit
//
// Usage: engine_tier_bench [rows=200000] [batch=2000] [steps=200] [fraction=0.1]
//                          [spill_dir=/tmp] [warm=200]
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

#include "embedding_engine.h"
#include "slot_file_block_store.h"

namespace e = tensorflow::fusedemb::engine;

namespace {

constexpr int kDim = 16;

double CpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

void Check(const std::string& error) {
  if (error.empty()) return;
  std::fprintf(stderr, "%s\n", error.c_str());
  std::exit(1);
}

// Batches of unique ids: Zipf ranks over the ids stored so far (inverse CDF of r^-a on
// [1, stored]), then uniform ones while the heavy tail repeats itself, then new ids.
class ZipfIds {
 public:
  ZipfIds(int64_t batch, double exponent) : batch_(batch), a_(exponent), rng_(0) {}

  std::vector<int64_t> Next(double new_fraction, int64_t* old_ids) {
    const int64_t need = std::min<int64_t>(batch_ - static_cast<int64_t>(batch_ * new_fraction),
                                           next_id_);
    std::unordered_set<int64_t> seen;
    std::vector<int64_t> ids;
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (int64_t tries = 0; static_cast<int64_t>(ids.size()) < need && tries < 4 * need; ++tries) {
      // P(rank <= r) ~ (r^(1-a) - 1) / (n^(1-a) - 1) on [1, n].
      const double n1 = std::pow(static_cast<double>(next_id_), 1.0 - a_);
      const double r = std::pow(1.0 + u(rng_) * (n1 - 1.0), 1.0 / (1.0 - a_));
      const int64_t id = std::min<int64_t>(next_id_ - 1, static_cast<int64_t>(r) - 1);
      if (seen.insert(id).second) ids.push_back(id);
    }
    std::uniform_int_distribution<int64_t> any(0, std::max<int64_t>(0, next_id_ - 1));
    while (static_cast<int64_t>(ids.size()) < need) {
      const int64_t id = any(rng_);
      if (seen.insert(id).second) ids.push_back(id);
    }
    *old_ids = static_cast<int64_t>(ids.size());
    while (static_cast<int64_t>(ids.size()) < batch_) ids.push_back(next_id_++);
    std::shuffle(ids.begin(), ids.end(), rng_);
    for (int64_t& id : ids) id = static_cast<int64_t>(e::Fmix64(static_cast<uint64_t>(id)));
    return ids;
  }

 private:
  int64_t batch_, next_id_ = 0;
  double a_;
  std::mt19937_64 rng_;
};

e::Config AdagradConfig() {
  e::Config c;
  c.dim = kDim;
  c.optimizer = e::Optimizer::kAdagrad;
  c.learning_rate = 0.05f;
  c.init = e::Init::kUniform;
  c.init_loc = -0.05;
  c.init_scale = 0.1;
  c.num_shards = 16;
  return c;
}

// One engine call over every shard in turn, between Pin and Unpin when tiered.
template <typename F>
void EachShard(e::Engine& eng, const e::Partition& p, const int64_t* keys, F&& call) {
  for (int s = 0; s < eng.num_shards(); ++s) {
    const e::Span span = p.Of(s);
    Check(eng.Pin(s, span, keys));
    call(s, span);
    Check(eng.Unpin(s, span, keys));
  }
}

// A training step's engine calls on one batch: lookup, statistics, update.
void Step(e::Engine& eng, const std::vector<int64_t>& keys, int32_t step, bool lookup) {
  const int64_t n = static_cast<int64_t>(keys.size());
  const e::Partition p = eng.PartitionKeys(keys.data(), n);
  std::vector<float> rows(n * kDim), grads(n * kDim, 1e-3f);
  if (lookup) {
    EachShard(eng, p, keys.data(), [&](int s, e::Span span) {
      eng.Lookup(s, span, keys.data(), keys.data(), rows.data());
    });
  }
  std::vector<int32_t> tables(n, 0);
  std::vector<int64_t> ids(keys), counts(n, 1);
  const int64_t last_step = step;
  const e::RecordArgs args{keys.data(), tables.data(), ids.data(), counts.data(), &last_step, 0,
                           true};
  EachShard(eng, p, keys.data(), [&](int s, e::Span span) { Check(eng.Record(s, span, args)); });
  const e::StepConstants constants = e::MakeStepConstants(eng.config(), step);
  EachShard(eng, p, keys.data(), [&](int s, e::Span span) {
    Check(eng.ApplyGradients(s, span, keys.data(), keys.data(), grads.data(), constants, nullptr,
                             0, rows.data()));
  });
}

struct Run {
  double cpu_s = 0;
  int64_t reads = 0, spills = 0, old_keys = 0;
  std::vector<float> rows;  // every key's row at the end
};

Run Train(int64_t rows, int64_t batch, int warm, int steps, double fraction,
          const std::string& spill) {
  e::Engine eng(AdagradConfig());
  if (fraction < 1.0) {
    std::string error;
    auto store = e::OpenSlotFileBlockStore(spill, "tier_bench", eng.block_bytes(), &error);
    Check(error);
    const double payload = static_cast<double>(rows) * eng.block_bytes();
    eng.AttachStore(std::move(store), static_cast<int64_t>(payload * fraction), "tier_bench");
  }
  ZipfIds ids(batch, 1.05);
  int64_t old_keys = 0;
  int32_t step = 0;
  std::vector<int64_t> all;
  while (static_cast<int64_t>(all.size()) < rows) {  // grow: new keys only
    std::vector<int64_t> keys = ids.Next(1.0, &old_keys);
    Step(eng, keys, ++step, false);
    all.insert(all.end(), keys.begin(), keys.end());
  }
  for (int t = 0; t < warm; ++t) {  // untimed Zipf steps: the access counts' history
    std::vector<int64_t> keys = ids.Next(0.02, &old_keys);
    Step(eng, keys, ++step, true);
    all.insert(all.end(), keys.begin(), keys.end());
  }
  std::vector<std::vector<int64_t>> batches;
  std::vector<int64_t> old(steps);
  for (int t = 0; t < steps; ++t) {
    batches.push_back(ids.Next(0.02, &old[t]));
    all.insert(all.end(), batches.back().begin(), batches.back().end());
  }
  Run run;
  const auto before = eng.Size();
  const double start = CpuSeconds();
  for (int t = 0; t < steps; ++t) {
    Step(eng, batches[t], ++step, true);
    run.old_keys += old[t];
  }
  run.cpu_s = CpuSeconds() - start;
  const auto after = eng.Size();
  run.reads = after.ssd_io[0] - before.ssd_io[0];
  run.spills = after.ssd_io[2] - before.ssd_io[2];
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  run.rows.resize(all.size() * kDim);
  for (size_t at = 0; at < all.size(); at += batch) {  // a batch at a time: within the budget
    const int64_t* keys = all.data() + at;
    const int64_t n = std::min<int64_t>(batch, static_cast<int64_t>(all.size() - at));
    const e::Partition p = eng.PartitionKeys(keys, n);
    EachShard(eng, p, keys, [&](int s, e::Span span) {
      eng.Lookup(s, span, keys, keys, run.rows.data() + at * kDim);
    });
  }
  return run;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t rows = argc > 1 ? std::atoll(argv[1]) : 200000;
  const int64_t batch = argc > 2 ? std::atoll(argv[2]) : 2000;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 200;
  const double fraction = argc > 4 ? std::atof(argv[4]) : 0.1;
  const std::string dir = argc > 5 ? argv[5] : "/tmp";
  const int warm = argc > 6 ? std::atoi(argv[6]) : 200;
  const std::string spill = dir + "/engine_tier_bench_" + std::to_string(getpid());
  const Run dram = Train(rows, batch, warm, steps, 1.0, spill);
  const Run tiered = Train(rows, batch, warm, steps, fraction, spill);
  const bool exact = dram.rows.size() == tiered.rows.size() &&
                     std::memcmp(dram.rows.data(), tiered.rows.data(),
                                 dram.rows.size() * sizeof(float)) == 0;
  const int64_t moved = tiered.reads + tiered.spills;
  std::printf(
      "{\"rows\": %lld, \"batch\": %lld, \"warm\": %d, \"steps\": %d, \"fraction\": %g, "
      "\"per_block_us\": %.3f, \"hit_rate\": %.4f, \"dram_ms\": %.3f, \"tiered_ms\": %.3f, "
      "\"reads\": %.1f, \"spills\": %.1f, \"exact\": %s}\n",
      (long long)rows, (long long)batch, warm, steps, fraction,
      moved > 0 ? 1e6 * (tiered.cpu_s - dram.cpu_s) / moved : 0.0,
      1.0 - static_cast<double>(tiered.reads) / std::max<int64_t>(1, tiered.old_keys),
      1e3 * dram.cpu_s / steps, 1e3 * tiered.cpu_s / steps,
      static_cast<double>(tiered.reads) / steps, static_cast<double>(tiered.spills) / steps,
      exact ? "true" : "false");
  return exact ? 0 : 1;
}
