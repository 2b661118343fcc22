/* pkm_serve's one C descriptor of a bag problem: the table, the bags, their
 * weights, the combiner and the index policy, on raw pointers. Plain C (no
 * C++, CUDA or TensorFlow header), so every side of the project takes the
 * same struct: the CUDA launchers (kernels/cuda), the C ABI for ctypes
 * (kernels/capi, mirrored field by field in kernels/capi/pkm_capi.py) and,
 * through pkm::FromBagProblem / pkm::ToBagProblem (embedding_bag.h), the
 * core, TF, XLA and TFLite adapters. The enums below are the only definition
 * of their values: pkm::ElemType, pkm::Combiner and pkm::IndexPolicy take
 * theirs from here.
 *
 * Semantics: kernels/core/embedding_bag.h (DESIGN.md "The op"). */
#ifndef PKM_KERNELS_CORE_BAG_PROBLEM_H_
#define PKM_KERNELS_CORE_BAG_PROBLEM_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types of tables, weights, outputs. Half types are raw 16-bit
 * patterns; PKM_INT8 is a table type only (row-wise quantised: it needs
 * row_scales below; forward only, outputs are a float type). */
enum { PKM_FLOAT32 = 0, PKM_FLOAT16 = 1, PKM_BFLOAT16 = 2, PKM_INT8 = 3 };

/* Combiners. PKM_MAX is torch's mode="max": elementwise max over the bag's
 * valid rows (empty bag: 0; a NaN propagates), no weights, gradient to the row
 * holding each maximum (the first NaN; ties to the lowest bag position). */
enum { PKM_SUM = 0, PKM_MEAN = 1, PKM_SQRTN = 2, PKM_MAX = 3 };

/* What an index outside [0, num_rows) is (see pkm::IndexPolicy):
 * NEGATIVE_IS_PADDING: negative = padding, >= num_rows an error (the op);
 * NO_PADDING: any of them an error (stock TFLite GATHER);
 * OUT_OF_RANGE_IS_PADDING: any of them padding (the device's rule). */
enum {
  PKM_NEGATIVE_IS_PADDING = 0,
  PKM_NO_PADDING = 1,
  PKM_OUT_OF_RANGE_IS_PADDING = 2
};

typedef struct PkmBags {
  /* Table [num_rows, dim], row-major, of elem_type. On the CUDA launchers,
   * outputs, the upstream gradient and d_table share elem_type. */
  const void* table;
  int32_t elem_type;
  int64_t num_rows;
  int64_t dim;
  /* Indices: int32 or int64. Dense layout: num_bags * bag_size entries.
   * Ragged layout (row_splits != NULL): row_splits[num_bags + 1], bag b holds
   * entries [row_splits[b], row_splits[b+1]); num_indices is the length of
   * `indices` (the core checks row_splits[num_bags] against it; the CUDA
   * launchers clamp splits to it: a malformed split never reads past). */
  const void* indices;
  int32_t indices_int64;
  int64_t num_bags;
  int64_t bag_size;
  const void* row_splits;
  int32_t row_splits_int64;
  int64_t num_indices; /* dense: ignored (num_bags * bag_size) */
  /* Optional per-entry weights (NULL = all ones) of weights_type. */
  const void* weights;
  int32_t weights_type;
  int32_t combiner;
  /* CUDA launchers only: optional device int32 counter, incremented once per
   * index >= num_rows. */
  int32_t* invalid_index_count;
  /* PKM_NEGATIVE_IS_PADDING (0, what a zeroed struct gets) or another policy
   * above. Last, so the fields before keep their offsets. */
  int32_t index_policy;
  /* Row-wise int8 tables (elem_type PKM_INT8) only: row r dequantises as
   * row_scales[r] * q + row_biases[r], both [num_rows] of row_params_type
   * (PKM_FLOAT32 or PKM_FLOAT16); row_biases may be NULL (= 0). Appended, so
   * the fields before keep their offsets. */
  const void* row_scales;
  const void* row_biases;
  int32_t row_params_type;
} PkmBags;

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif /* PKM_KERNELS_CORE_BAG_PROBLEM_H_ */
