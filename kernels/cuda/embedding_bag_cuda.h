// pkm_serve CUDA EmbeddingBag: plain C launchers on raw device pointers.
//
//   out[b, :] = combine_k  w[b, k] * table[idx[b, k], :]
//
// The problem is the core's C descriptor PkmBags (kernels/core/bag_problem.h).
// Same contract as kernels/core/embedding_bag.h (negative index = padding,
// combiners sum/mean/sqrtn, float32 accumulation, empty bag -> zeros), with one
// GPU-specific rule: the device cannot raise an error, so an index >= num_rows
// is treated like padding (never read, contributes nothing, not counted by
// mean/sqrtn, gets d_weight 0) and, when `invalid_index_count` is set, adds 1
// to that device counter per offending entry: index_policy
// PKM_OUT_OF_RANGE_IS_PADDING, whether the struct says that or
// PKM_NEGATIVE_IS_PADDING; PKM_NO_PADDING is refused (INVALID_ARGUMENT), as
// it needs an error from the device. Callers that need the CPU's
// InvalidArgument check the counter (or validate on the host first).
//
// No CUDA or TensorFlow header is needed to include this file: the stream is
// the driver's opaque CUstream_st*, the same type as cudaStream_t.
#ifndef PKM_KERNELS_CUDA_EMBEDDING_BAG_CUDA_H_
#define PKM_KERNELS_CUDA_EMBEDDING_BAG_CUDA_H_

#include <stddef.h>
#include <stdint.h>

#include "kernels/core/bag_problem.h"
#include "kernels/core/row_optimizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st* pkm_cuda_stream_t;

// Exported even from objects built with -fvisibility=hidden.
#if defined(__GNUC__)
#define PKM_CUDA_API __attribute__((visibility("default")))
#else
#define PKM_CUDA_API
#endif

// Return codes: 0 ok, PKM_CUDA_INVALID_ARGUMENT for a bad call (see
// pkm_cuda_last_error()), any positive value is the cudaError_t of a failed
// CUDA call or launch.
enum { PKM_CUDA_OK = 0, PKM_CUDA_INVALID_ARGUMENT = -1 };

// Tuning knobs; pass NULL for the defaults (what the benchmark picked).
typedef struct PkmCudaOptions {
  // Forward: 16-byte vectors each lane keeps per column tile (1, 2 or 4).
  // 0 = default.
  int32_t forward_vecs_per_lane;
  // Backward: a table row referenced by more entries than this is summed by
  // several warps in fixed-size pieces, then combined in a fixed order
  // (deterministic). 0 = default: 2 * dim, at least 512, at most 2048, and
  // long enough that the pieces' sums fit a float per index of scratch.
  int64_t long_segment_entries;
} PkmCudaOptions;

// out: [num_bags, dim] of elem_type.
PKM_CUDA_API int pkm_cuda_forward(const PkmBags* bags, void* out,
                     const PkmCudaOptions* options, pkm_cuda_stream_t stream);

// Device scratch bytes pkm_cuda_backward needs for these bags (O(indices)
// integers plus small float tables; never [indices, dim]).
PKM_CUDA_API size_t pkm_cuda_backward_workspace_bytes(const PkmBags* bags,
                                         const PkmCudaOptions* options);

// grad_out [num_bags, dim] of elem_type. d_table [num_rows, dim] of elem_type
// is fully overwritten (rows nobody references become 0); d_weights (one per
// entry, weights_type; padding and invalid entries get 0) needs weights. Either
// output may be NULL to skip it. Deterministic: no atomics, fixed summation
// order, bitwise identical across runs.
PKM_CUDA_API int pkm_cuda_backward(const PkmBags* bags, const void* grad_out, void* d_table,
                      void* d_weights, void* workspace, size_t workspace_bytes,
                      const PkmCudaOptions* options, pkm_cuda_stream_t stream);

// Row-sparse backward: the table gradient as the U distinct rows that valid
// entries touch (ascending) and their gradient rows, from the same sorted
// passes (no [indices, dim] buffer). U is known only after the sort, so the
// call synchronises `stream` once to read it and then calls
// alloc(alloc_ctx, U, &rows, &row_grads) on the calling thread; the callback
// returns 0 and sets device pointers rows (U int64) and row_grads (U * dim
// elements of elem_type), or returns non-zero to abort. d_weights as in
// pkm_cuda_backward (may be NULL). Deterministic like pkm_cuda_backward.
typedef int (*pkm_cuda_sparse_alloc_fn)(void* alloc_ctx, int64_t num_rows_touched, int64_t** rows,
                                        void** row_grads);
PKM_CUDA_API size_t pkm_cuda_sparse_backward_workspace_bytes(const PkmBags* bags,
                                                const PkmCudaOptions* options);
PKM_CUDA_API int pkm_cuda_sparse_backward(const PkmBags* bags, const void* grad_out,
                             pkm_cuda_sparse_alloc_fn alloc, void* alloc_ctx, void* d_weights,
                             void* workspace, size_t workspace_bytes, const PkmCudaOptions* options,
                             pkm_cuda_stream_t stream);

// Forward over a row-wise int8 table (elem_type PKM_INT8; row r is
// row_scales[r] * q + row_biases[r], PkmBags' int8-row fields): out
// [num_bags, dim] float32. Same bag, weight and index rules as
// pkm_cuda_forward; forward only (kernels/cuda/forward_int8.cu).
PKM_CUDA_API int pkm_cuda_forward_int8(const PkmBags* bags, float* out, pkm_cuda_stream_t stream);

// Fused backward + row-wise optimizer (kernels/core/row_optimizer.h): the
// backward's sorted passes, but each touched row's gradient tile is applied to
// bags->table in place (the table pointer is written through) and to opt's
// state (device pointers, float32) instead of being stored: no d_table, no
// [indices, dim] buffer. Untouched rows and their state do not move.
// d_weights as in pkm_cuda_backward (taken against the table before the
// update; may be NULL). `opt` is read on the host at the call. No host
// synchronisation. Deterministic like pkm_cuda_backward.
PKM_CUDA_API size_t pkm_cuda_fused_update_workspace_bytes(const PkmBags* bags, const PkmCudaOptions* options);
PKM_CUDA_API int pkm_cuda_fused_update(const PkmBags* bags, const void* grad_out, const PkmRowOptimizer* opt,
                                       void* d_weights, void* workspace, size_t workspace_bytes,
                                       const PkmCudaOptions* options, pkm_cuda_stream_t stream);

// Product-key selection of a PKM layer (kernels/cuda/product_keys.cu), all
// float32 device buffers: scores [rows, 2, n_keys] (each query's two half-key
// score vectors); per row the top knn of each half, then the top knn of the
// knn x knn sums of those. Out: best [rows, knn] (descending), index
// [rows, knn] = i1 * n_keys + i2, pos [rows, knn, 2] int32 = (i1, i2) for the
// backward. n_keys <= 1024, knn <= min(32, n_keys). Deterministic (ties go to
// the smaller position / index); one launch, no host synchronisation.
PKM_CUDA_API int pkm_cuda_product_topk(const float* scores, int64_t rows, int64_t n_keys, int knn, float* best,
                                       int64_t* index, int32_t* pos, pkm_cuda_stream_t stream);
// Its backward: d_scores [rows, 2, n_keys] = 0 but at the picked positions,
// which get the sum of their d_best [rows, knn] (in rank order).
PKM_CUDA_API int pkm_cuda_product_topk_backward(const float* d_best, const int32_t* pos, int64_t rows,
                                                int64_t n_keys, int knn, float* d_scores, pkm_cuda_stream_t stream);

// Message for the last PKM_CUDA_INVALID_ARGUMENT / CUDA error on this thread.
PKM_CUDA_API const char* pkm_cuda_last_error(void);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // PKM_KERNELS_CUDA_EMBEDDING_BAG_CUDA_H_
