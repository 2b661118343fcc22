// pkm_serve kernel core: framework-free EmbeddingBag forward and backward.
//
//   out[b, :] = combine_k  w[b, k] * table[idx[b, k], :]
//
// Every runtime (TF CPU kernels, the TFLite kernel/delegate, tests) calls the
// functions below on raw pointers; adapters only translate tensors, threads
// and errors. All element offsets are int64_t: tables over 2^31 elements work.
//
// Semantics (see DESIGN.md "The op"):
//  - negative index = padding: contributes nothing, not counted by mean/sqrtn
//    (Bags::index_policy can make it an error instead, see IndexPolicy);
//  - index >= num_rows is an error (the backward reports it before writing
//    anything; the forward may have written the output of other bags);
//  - combiner sum: sum w*x; mean: sum(w*x)/sum(w); sqrtn: sum(w*x)/sqrt(sum w^2);
//    a zero denominator (empty bag, all padding, weights summing to 0) gives 0;
//  - combiner max (torch's mode="max"): elementwise max over the bag's valid
//    rows, 0 for an empty bag, NaN where a row holds NaN (np.max's and TF's
//    reduce_max's rule; torch's CPU bag drops a NaN after the first row);
//    weights are refused (CheckCombiner); the gradient goes to the row
//    holding each maximum (the first NaN), ties to the first (lowest bag position);
//  - accumulation is float32 for every element type.
#ifndef PKM_KERNELS_CORE_EMBEDDING_BAG_H_
#define PKM_KERNELS_CORE_EMBEDDING_BAG_H_

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>

#include "kernels/core/bag_problem.h"

namespace pkm {

// The values come from the C descriptor (bag_problem.h), defined there once.
enum class Combiner : int { kSum = PKM_SUM, kMean = PKM_MEAN, kSqrtn = PKM_SQRTN, kMax = PKM_MAX };

// Storage type of a table, of weights, of outputs. Half types are raw 16-bit
// patterns (IEEE binary16 / bfloat16); kInt8 is only valid for tables and
// needs per-row scales (dequantised value = scale[row] * q + bias[row]).
enum class ElemType : int {
  kFloat32 = PKM_FLOAT32,
  kFloat16 = PKM_FLOAT16,
  kBFloat16 = PKM_BFLOAT16,
  kInt8 = PKM_INT8,
};

// Parses "sum" | "mean" | "sqrtn" | "max"; returns false for anything else.
bool ParseCombiner(const std::string& name, Combiner* out);
const char* CombinerName(Combiner c);
int64_t ElemSize(ElemType t);

// Work splitter supplied by the adapter (TF: the intra-op thread pool; TFLite:
// its own pool; tests: serial). Calls fn(begin, end) on disjoint ranges that
// cover [0, total); cost_per_unit is a rough cycle count per unit of work.
using RangeFn = std::function<void(int64_t begin, int64_t end)>;
using ParallelFor =
    std::function<void(int64_t total, int64_t cost_per_unit, const RangeFn& fn)>;
// Runs fn(0, total) on the calling thread.
ParallelFor SerialFor();

struct Status {
  bool ok = true;
  std::string message;
  static Status Ok() { return Status(); }
  static Status Error(std::string msg) { return Status{false, std::move(msg)}; }
};

// The one rule on a combiner and weights, for every runtime (Forward,
// Backward, SparseBackward and FromBagProblem call it; the TF/XLA shape rules
// and the TFLite kernel call it before anything runs): the combiner is one of
// the four, and max takes no weights (as torch refuses per_sample_weights with
// mode="max"). Python (pkm_serve/ops.py) raises ValueError with the same text.
inline constexpr char kMaxWithWeightsError[] =
    "combiner 'max' takes no weights (as torch's embedding_bag mode='max' refuses per_sample_weights): "
    "pass weights=None";
Status CheckCombiner(Combiner combiner, bool has_weights);

// The table: [num_rows, dim] row-major.
struct Table {
  const void* data = nullptr;
  ElemType type = ElemType::kFloat32;
  int64_t num_rows = 0;
  int64_t dim = 0;
  // kInt8 only (row-wise / axis-0 quantisation): row r dequantises as
  // row_scales[r] * q + row_biases[r], both of row_params_type (kFloat32 or
  // kFloat16); row_biases may be null (= 0). The layout of PkmBags'
  // row_scales / row_biases / row_params_type, shared by every runtime
  // (TFLite's scale * (q - zero_point) becomes bias = -scale * zero_point).
  const void* row_scales = nullptr;
  const void* row_biases = nullptr;
  ElemType row_params_type = ElemType::kFloat32;
};

// Which indices ValidateBags accepts. An index in [0, num_rows) is always a
// row; the policy decides what the others are.
enum class IndexPolicy : int {
  // Negative = padding (the op's contract); >= num_rows is an error.
  kNegativeIsPadding = PKM_NEGATIVE_IS_PADDING,
  // Anything outside [0, num_rows) is an error, as stock TFLite GATHER: a
  // fused GATHER chain must fail where the stock graph does.
  kNoPadding = PKM_NO_PADDING,
  // Anything outside [0, num_rows) is padding: the CUDA launchers' rule, as a
  // device cannot raise an error (it counts such entries instead). ValidateBags
  // then checks only the layout; the CPU Forward/Backward reject this policy
  // (their loops skip negatives only, so an index >= num_rows would be read).
  kOutOfRangeIsPadding = PKM_OUT_OF_RANGE_IS_PADDING,
};

// The bags. Dense: num_bags bags of bag_size each (indices [num_bags*bag_size]).
// Ragged: row_splits[num_bags + 1] (non-decreasing, row_splits[0] == 0), bag b
// holds entries [row_splits[b], row_splits[b+1]) of indices/weights.
// A row_splits[0] of kMismatchedWeightsSplit marks bags whose weights are not laid
// out like the ids (ragged weights of another row partition, sparse weights at other
// positions): the Python wrappers set it where the graph's own check of that is an
// Assert, which XLA drops when it compiles the graph later, and the TFLite converter
// drops too. ValidateLayout names that problem instead of the split (the CUDA kernels
// clamp splits into [0, num_values] and do not refuse it). INT32_MIN, so int32 and
// int64 splits can hold it.
constexpr int64_t kMismatchedWeightsSplit = -2147483648LL;

struct Bags {
  const void* indices = nullptr;
  bool indices_int64 = false;
  int64_t num_bags = 0;
  int64_t bag_size = 0;              // dense layout
  const void* row_splits = nullptr;  // ragged layout when non-null
  bool row_splits_int64 = false;
  int64_t num_values = -1;           // ragged (required): length of indices,
                                     // checked against row_splits[num_bags]
  const void* weights = nullptr;     // null = all ones; else one per index
  ElemType weights_type = ElemType::kFloat32;  // kFloat32/kFloat16/kBFloat16
  IndexPolicy index_policy = IndexPolicy::kNegativeIsPadding;
  int64_t NumIndices() const;        // total entries (ragged: row_splits[num_bags])
  int64_t Begin(int64_t bag) const;  // first entry of a bag
  int64_t End(int64_t bag) const;    // one past its last entry
};

// The C descriptor (bag_problem.h) <-> Table/Bags/Combiner: the only two
// translations between them. FromBagProblem checks the enum values (int8
// tables need row_scales) and gives ragged bags
// num_values = num_indices. ToBagProblem fills every field for the CUDA
// launchers without reading the buffers (they may be device pointers):
// num_indices = num_values (ragged) or num_bags * bag_size, no counter.
Status FromBagProblem(const PkmBags& problem, Table* table, Bags* bags, Combiner* combiner);
PkmBags ToBagProblem(const Table& table, const Bags& bags, Combiner combiner);

// Checks layout and indices: row_splits well formed, every index valid under
// bags.index_policy. The message names the first offending position and value
// and the policy, e.g.
// "indices[3] = 70000 is out of range [0, 65536) (negative indices are padding)"
// or "indices[40] = -1 is out of range [0, 200) (stock GATHER allows no padding)".
// Backward calls it itself and Forward makes the same checks block by block
// as it goes (an error then leaves `out` partly written); exposed for
// adapters that want to fail early (and for the GPU path, which cannot report
// errors from the device).
Status ValidateBags(const Table& table, const Bags& bags, const ParallelFor& pf);

// out: [num_bags, dim] of out_type (kFloat32/kFloat16/kBFloat16).
Status Forward(const Table& table, const Bags& bags, Combiner combiner,
               void* out, ElemType out_type, const ParallelFor& pf);

// Gradients of Forward w.r.t. the table and the weights.
//  grad_out:     [num_bags, dim] of grad_type
//  d_table:      [num_rows, dim] of d_table_type, fully overwritten (dense);
//                may be null to skip
//  d_weights:    one per index, of bags.weights_type; may be null to skip.
//                Padding entries get 0.
// No [indices, dim] buffer; temporaries: DESIGN.md "The op" (row groups sized
// by the indices or, for a counting sort, by num_rows; a [num_bags, dim]
// float32 copy of a half-type grad_out).
// table.type must be a float type (no gradients for int8 tables).
Status Backward(const Table& table, const Bags& bags, Combiner combiner,
                const void* grad_out, ElemType grad_type, void* d_table,
                ElemType d_table_type, void* d_weights, const ParallelFor& pf);

// Row-sparse gradient w.r.t. the table, from the same row-grouped pass as
// Backward: the U distinct rows that valid indices touch (ascending) and one
// gradient row each, U <= min(num_rows, valid indices). U is known only after
// grouping, so the caller allocates the outputs through `alloc`, which must set
// *rows to U int64 and *row_grads to U * dim elements of row_grads_type (both
// may be null when U == 0) or return an error that SparseBackward passes on.
// d_weights as in Backward (may be null). No [indices, dim] buffer;
// temporaries as in Backward.
using SparseRowsAlloc = std::function<Status(int64_t num_rows_touched, int64_t** rows, void** row_grads)>;
Status SparseBackward(const Table& table, const Bags& bags, Combiner combiner, const void* grad_out,
                      ElemType grad_type, const SparseRowsAlloc& alloc, ElemType row_grads_type,
                      void* d_weights, const ParallelFor& pf);

// The row-grouped backward with the table gradient handed out row by row:
// fn(row, grad) is called once per distinct row that valid indices touch, with
// grad[dim] that row's float32 gradient (fn may overwrite it). Calls for
// different rows may run concurrently (one row on one thread); each row's
// grad . row products for d_weights are taken before fn sees the row, so fn
// may update table row `row` in place (the fused optimizer does). d_weights
// as in Backward (may be null). No [indices, dim] buffer.
using RowGradientFn = std::function<void(int64_t row, float* grad)>;
Status RowGradients(const Table& table, const Bags& bags, Combiner combiner, const void* grad_out,
                    ElemType grad_type, void* d_weights, const ParallelFor& pf, const RowGradientFn& fn);

// Slow, obviously-correct versions of the two, for tests (serial, double
// accumulation is not used on purpose: float32 like the contract).
Status ReferenceForward(const Table& table, const Bags& bags, Combiner combiner,
                        void* out, ElemType out_type);
Status ReferenceBackward(const Table& table, const Bags& bags, Combiner combiner,
                         const void* grad_out, ElemType grad_type, void* d_table,
                         ElemType d_table_type, void* d_weights);

// Scalar conversions shared by adapters and tests.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);          // round to nearest even
// bfloat16 is the top half of a float32: inline and branch-free, so the
// vector loops that use them vectorise.
inline float BFloat16ToFloat(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline uint16_t FloatToBFloat16(float f) {  // round to nearest even; nan stays (quiet) nan
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const bool is_nan = (x & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(is_nan ? ((x >> 16) | 0x40u) : rounded);
}

}  // namespace pkm

#endif  // PKM_KERNELS_CORE_EMBEDDING_BAG_H_
