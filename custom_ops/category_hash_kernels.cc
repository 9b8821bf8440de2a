// CPU kernel of FusedEmb>CategoryHash. Statistics stay lossless: every unique key keeps
// the (category, id) pair that produced it, and hashed-mode collisions are detected by
// comparing that pair with each later pair that maps to the same key.
#include <algorithm>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "fusedemb_common.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace tensorflow {
namespace fusedemb {

template <typename T>
class CategoryHashOp : public OpKernel {
 public:
  explicit CategoryHashOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("categories", &categories_));
    std::string mode;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("mode", &mode));
    packed_ = mode == "packed";
    OP_REQUIRES_OK(ctx, ctx->GetAttr("id_bits", &id_bits_));
    int category_bits = 0;
    while ((int64_t{1} << category_bits) < static_cast<int64_t>(categories_.size())) ++category_bits;
    if (id_bits_ < 0) id_bits_ = 63 - category_bits;
    // Compared as id_bits <= 63 - category_bits: id_bits + category_bits could overflow int.
    OP_REQUIRES(ctx, !packed_ || (id_bits_ >= 1 && id_bits_ <= 63 - category_bits),
                errors::InvalidArgument("id_bits = ", id_bits_, " must lie in [1, ",
                                        63 - category_bits, "] so that ", categories_.size(),
                                        " categories (", category_bits,
                                        " bits) and the IDs fit in a non-negative int64"));
    for (const std::string& name : categories_) tags_.push_back(CategoryTag(name));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids_t = ctx->input(0);
    const Tensor& seg_t = ctx->input(1);
    OP_REQUIRES_OK(ctx, ValidateVector(ids_t, "ids"));
    OP_REQUIRES_OK(ctx, ValidateVector(seg_t, "segment_ids"));
    const int64_t n = ids_t.NumElements();
    OP_REQUIRES(ctx, seg_t.NumElements() == n,
                errors::InvalidArgument("segment_ids has ", seg_t.NumElements(),
                                        " elements but ids has ", n));
    const T* ids = ids_t.flat<T>().data();
    const int32_t* seg = seg_t.flat<int32_t>().data();
    const int64_t num_categories = static_cast<int64_t>(categories_.size());

    Tensor* inverse_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, ids_t.shape(), &inverse_t));
    int32_t* inverse = inverse_t->flat<int32_t>().data();
    // Scratch sized for the worst case (all keys distinct), trimmed when copied out.
    std::vector<int64_t> keys(n);
    std::vector<T> first_ids(n);
    std::vector<int32_t> first_segs(n), counts(n, 0);
    int64_t collisions = 0;
    PairSet seen;  // colliding pairs counted so far
    DenseIndexSet<int64_t> set;
    set.Reset(keys.data(), std::min<int64_t>(n, 1 << 16));
    for (int64_t i = 0; i < n; ++i) {
      const int32_t s = seg[i];
      OP_REQUIRES(ctx, s >= 0 && s < num_categories,
                  errors::InvalidArgument("segment_ids[", i, "] = ", s, " is out of range [0, ",
                                          num_categories, ") for ", num_categories,
                                          " categories"));
      const int64_t id = static_cast<int64_t>(ids[i]);
      int64_t key;
      if (packed_) {
        // uint64(id) >> id_bits == 0 <=> 0 <= id < 2^id_bits, also for id_bits = 63.
        OP_REQUIRES(ctx, (static_cast<uint64_t>(id) >> id_bits_) == 0,
                    errors::InvalidArgument("ids[", i, "] = ", id, " of category '",
                                            categories_[s], "' is outside [0, 2^", id_bits_,
                                            ") required by mode='packed'"));
        key = (static_cast<int64_t>(s) << id_bits_) | id;
      } else {
        key = HashedUnifiedKey(id, tags_[s]);
      }
      bool inserted;
      const int32_t j = set.FindOrInsert(key, &inserted);
      ++counts[j];
      if (inserted) {
        first_ids[j] = ids[i];
        first_segs[j] = s;
      } else if ((first_segs[j] != s || static_cast<int64_t>(first_ids[j]) != id) &&
                 seen.insert({s, id}).second) {
        // A different pair behind the same key is a collision, counted once per pair.
        ++collisions;
      }
      inverse[i] = j;
    }
    const int64_t u = set.size();
    Tensor *keys_t, *lids_t, *lsegs_t, *counts_t, *coll_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({u}), &keys_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({u}), &lids_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({u}), &lsegs_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({u}), &counts_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(5, TensorShape({}), &coll_t));
    std::copy_n(keys.data(), u, keys_t->flat<int64_t>().data());
    std::copy_n(first_ids.data(), u, lids_t->flat<T>().data());
    std::copy_n(first_segs.data(), u, lsegs_t->flat<int32_t>().data());
    std::copy_n(counts.data(), u, counts_t->flat<int32_t>().data());
    coll_t->scalar<int64_t>()() = collisions;
  }

 private:
  // Collisions are rare, so the exact (category, id) set is only built for colliders. A
  // hash set, not a list: crafted input (x of a, x ^ tag(a) ^ tag(b) of b, for many x)
  // makes every pair collide, and a linear scan per pair would be quadratic in n.
  struct PairHash {
    size_t operator()(const std::pair<int32_t, int64_t>& p) const {
      return static_cast<size_t>(Mix64(static_cast<uint64_t>(p.second) ^
                                       Mix64(static_cast<uint64_t>(p.first))));
    }
  };
  using PairSet = std::unordered_set<std::pair<int32_t, int64_t>, PairHash>;

  std::vector<std::string> categories_;
  std::vector<uint64_t> tags_;
  bool packed_ = false;
  int id_bits_ = -1;
};

#define REGISTER(T)                                                                  \
  REGISTER_KERNEL_BUILDER(                                                           \
      Name("FusedEmb>CategoryHash").Device(DEVICE_CPU).TypeConstraint<T>("T"),  \
      CategoryHashOp<T>);
REGISTER(int32_t);
REGISTER(int64_t);
#undef REGISTER

}  // namespace fusedemb
}  // namespace tensorflow
