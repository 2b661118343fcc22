// pkm_serve standalone C ABI (libpkm_cuda.so / libpkm_capi_cpu.so): the
// core's CPU forward/backward (fast and reference) on raw host pointers, for
// ctypes tests and benchmarks on machines without TensorFlow. The CUDA
// launchers of kernels/cuda/embedding_bag_cuda.h are exported from the same
// library when it is built with CUDA (pkm_capi_has_cuda() says which).
//
// Every function returns 0 on success; otherwise it writes a message naming
// the problem into err (NUL-terminated, truncated to err_len) and returns -1.
#ifndef PKM_KERNELS_CAPI_PKM_CAPI_H_
#define PKM_KERNELS_CAPI_PKM_CAPI_H_

#include <stddef.h>

#include "kernels/cuda/embedding_bag_cuda.h"  // PkmBags (kernels/core/bag_problem.h); no CUDA header

#ifdef __cplusplus
extern "C" {
#endif

// 1 when the library carries the CUDA launchers, else 0.
PKM_CUDA_API int pkm_capi_has_cuda(void);

// Host-pointer versions. bags->num_indices is checked against
// row_splits[num_bags] for ragged bags; an index the bags->index_policy does
// not allow is an error (default: >= num_rows). The fast path refuses
// PKM_OUT_OF_RANGE_IS_PADDING; `reference` = 1 runs the slow obviously-correct
// core version, which implements every policy (the GPU tests' reference).
// out is of the table's elem_type; float32 for an int8 (PKM_INT8) table.
// out and grad_out may be NULL when they have no elements (num_bags or dim 0,
// as an empty torch tensor's data_ptr); the ids are checked all the same.
PKM_CUDA_API int pkm_cpu_forward(const PkmBags* bags, void* out, int reference, char* err, size_t err_len);
PKM_CUDA_API int pkm_cpu_backward(const PkmBags* bags, const void* grad_out, void* d_table, void* d_weights,
                     int reference, char* err, size_t err_len);

// The core's row-sparse backward (pkm::SparseBackward) on host pointers:
// alloc is called once with the touched-row count and must set host buffers
// rows (U int64) and row_grads (U * dim of elem_type); non-zero aborts.
PKM_CUDA_API int pkm_cpu_sparse_backward(const PkmBags* bags, const void* grad_out,
                            pkm_cuda_sparse_alloc_fn alloc, void* alloc_ctx, void* d_weights,
                            char* err, size_t err_len);

// The core's fused backward + row-wise optimizer (pkm::FusedBackwardUpdate)
// on host pointers: bags->table is updated in place (the caller's buffer is
// writable), with opt's state; d_weights as in pkm_cpu_backward (may be NULL).
// num_threads > 1 splits the rows over that many threads (the result is
// bitwise the same for any count).
PKM_CUDA_API int pkm_cpu_fused_update(const PkmBags* bags, const void* grad_out, const PkmRowOptimizer* opt,
                                      void* d_weights, int num_threads, char* err, size_t err_len);

// The layout of PkmBags as this library was compiled: writes sizeof(PkmBags)
// to *size and the offsetof of its first min(num_offsets, fields) fields, in
// declaration order, to offsets; returns the number of fields. Lets a ctypes
// mirror (kernels/capi/pkm_capi.py) check itself against the C struct.
PKM_CUDA_API size_t pkm_bags_layout(size_t* size, size_t* offsets, size_t num_offsets);

// The core's shape rule set (kernels/core/shape_rules.h) on shapes alone, for
// front ends that hold tensors (ctypes, JAX, PyTorch) and want the op's
// messages before building a PkmBags: params [N, D], indices [..., K] (ragged:
// values [V] with row_splits [B + 1]; row_splits_dims NULL = dense), weights
// (NULL = has_weights false). combiner is a PKM_* value. On success writes the
// output shape to out_dims (room for indices_rank + 1) and *out_rank; returns
// 0, or -1 with the rule's message in err.
PKM_CUDA_API int pkm_check_shapes(const int64_t* params_dims, int params_rank, const int64_t* indices_dims,
                                  int indices_rank, const int64_t* row_splits_dims, int row_splits_rank,
                                  const int64_t* weights_dims, int weights_rank, int32_t combiner,
                                  int64_t* out_dims, int* out_rank, char* err, size_t err_len);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // PKM_KERNELS_CAPI_PKM_CAPI_H_
