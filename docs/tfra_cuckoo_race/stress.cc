// Two threads insert disjoint halves of n unique int64 keys (as TFRA's Shard does for
// one upsert), then the table's size() is compared with what an iteration finds.
#include <array>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>
#include <cstdlib>
#include "cuckoohash_map.hh"
struct HybridHash {
  std::size_t operator()(int64_t const& key) const noexcept {
    uint64_t k = static_cast<uint64_t>(key);
    k ^= k >> 33; k *= UINT64_C(0xff51afd7ed558ccd); k ^= k >> 33;
    k *= UINT64_C(0xc4ceb9fe1a85ec53); k ^= k >> 33; return k;
  }
};
using V = std::array<float, 16>;
using Table = cuckoohash_map<int64_t, V, HybridHash>;
int main(int argc, char** argv) {
  size_t n = atol(argv[1]); int reps = atoi(argv[2]); int threads = atoi(argv[3]);
  size_t init = argc > 4 ? atol(argv[4]) : 8192;
  int bad = 0;
  for (int rep = 0; rep < reps; ++rep) {
    std::mt19937_64 rng(rep);
    std::vector<int64_t> keys(n);
    for (auto& k : keys) k = static_cast<int64_t>(rng());
    Table t(init);
    std::vector<std::thread> ts;
    size_t per = (n + threads - 1) / threads;
    for (int w = 0; w < threads; ++w)
      ts.emplace_back([&, w] {
        V v{}; for (size_t i = w * per; i < std::min(n, (w + 1) * per); ++i) {
          v[0] = float(i); t.insert_or_assign(keys[i], v); } });
    for (auto& th : ts) th.join();
    size_t size = t.size(), iterated = 0, found = 0;
    { auto lt = t.lock_table(); for (auto it = lt.begin(); it != lt.end(); ++it) ++iterated; }
    for (auto k : keys) found += t.contains(k);
    if (size != iterated || found != n) { ++bad; printf("BAD rep %d n=%zu size=%zu iterated=%zu found=%zu\n", rep, n, size, iterated, found); }
  }
  printf("bad %d of %d\n", bad, reps);
}
