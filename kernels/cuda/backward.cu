// The CUDA backward's host launchers (pkm_cuda_backward, pkm_cuda_sparse_backward;
// embedding_bag_cuda.h): argument checks, then the phases of backward.cuh as
// named steps — sort the entries by row (backward_sort.cu), assign sparse
// slots, the row pass (backward_rows.cu), d_weights (backward_weights.cu).
#include <string>

#include "kernels/cuda/backward.cuh"

namespace pkm_cuda {
namespace {

template <typename IdxT>
int LaunchBackward(const PkmBags& bags, const Layout& l, const void* grad_out, void* d_table, void* d_weights,
                   char* ws, cudaStream_t stream, const SparseOutputs* sparse = nullptr) {
  BackwardArgs args;
  if (int status = SortEntriesByRow<IdxT>(bags, l, d_weights, ws, stream, &args)) return status;
  args.grad = grad_out;
  args.d_table = d_table;
  if (sparse != nullptr) {
    if (int status = AssignSparseSlots(l, ws, *sparse, stream, &args)) return status;
  }
  args.dots = DotsBuffer(l, ws, args, d_weights);
  // Sum: d_weights is the raw dot, which the position pass can store itself.
  const bool direct_weights = d_weights != nullptr && bags.combiner == PKM_SUM && l.tiles == 1 &&
                              PositionPassApplies(args);
#ifndef PKM_BWD_SEPARATE_WEIGHTS  // -D for an A/B against the d_weights kernel
  if (direct_weights) args.d_weights = d_weights;
#endif
  if (int status = LaunchGradientRowPasses(args, l.pieces, stream)) return status;
  if (args.d_weights != nullptr) return PKM_CUDA_OK;
  return LaunchWeightsGrad(bags, l.num_indices, l.tiles, args.dots, d_weights, stream);
}

}  // namespace
}  // namespace pkm_cuda

extern "C" size_t pkm_cuda_backward_workspace_bytes(const PkmBags* bags,
                                                    const PkmCudaOptions* options) {
  using namespace pkm_cuda;
  if (ValidateCommon(bags) != PKM_CUDA_OK) return 0;
  Layout layout;
  if (MakeLayout(*bags, options, &layout) != PKM_CUDA_OK) return 0;
  return layout.total;
}

extern "C" int pkm_cuda_backward(const PkmBags* bags, const void* grad_out, void* d_table,
                                 void* d_weights, void* workspace, size_t workspace_bytes,
                                 const PkmCudaOptions* options, pkm_cuda_stream_t stream) {
  using namespace pkm_cuda;
  int status = ValidateCommon(bags);
  if (status != PKM_CUDA_OK) return status;
  if (d_weights != nullptr && bags->weights == nullptr)
    return SetInvalid("backward: d_weights requested but the bags have no weights");
  if (d_table == nullptr && d_weights == nullptr) return PKM_CUDA_OK;
  Layout layout;
  status = MakeLayout(*bags, options, &layout);
  if (status != PKM_CUDA_OK) return status;
  const int64_t n = layout.num_indices;
  if (bags->dim == 0 || n == 0 || bags->num_rows == 0) {
    // Nothing is gathered: every gradient is zero (all-zero bits are 0.0 in
    // each element type).
    const size_t elem = bags->elem_type == PKM_FLOAT32 ? 4 : 2;
    if (d_table != nullptr && bags->num_rows * bags->dim > 0) {
      status = CheckCuda(cudaMemsetAsync(d_table, 0, bags->num_rows * bags->dim * elem, stream),
                         "memset d_table");
      if (status != PKM_CUDA_OK) return status;
    }
    if (d_weights != nullptr && n > 0) {
      const size_t wsize = bags->weights_type == PKM_FLOAT32 ? 4 : 2;
      status = CheckCuda(cudaMemsetAsync(d_weights, 0, n * wsize, stream), "memset d_weights");
    }
    return status;
  }
  if (grad_out == nullptr) return SetInvalid("backward: grad_out is null");
  if (workspace_bytes < layout.total || (layout.total > 0 && workspace == nullptr))
    return SetInvalid("backward: workspace of " + std::to_string(workspace_bytes) +
                      " bytes is too small, need " + std::to_string(layout.total) +
                      " (pkm_cuda_backward_workspace_bytes)");
  char* ws = static_cast<char*>(workspace);
  return bags->indices_int64
             ? LaunchBackward<int64_t>(*bags, layout, grad_out, d_table, d_weights, ws, stream)
             : LaunchBackward<int32_t>(*bags, layout, grad_out, d_table, d_weights, ws, stream);
}

extern "C" size_t pkm_cuda_sparse_backward_workspace_bytes(const PkmBags* bags,
                                                           const PkmCudaOptions* options) {
  using namespace pkm_cuda;
  if (ValidateCommon(bags) != PKM_CUDA_OK) return 0;
  Layout layout;
  if (MakeLayout(*bags, options, &layout, Extra::kSparseSlots) != PKM_CUDA_OK) return 0;
  return layout.total;
}

extern "C" int pkm_cuda_sparse_backward(const PkmBags* bags, const void* grad_out,
                                        pkm_cuda_sparse_alloc_fn alloc, void* alloc_ctx, void* d_weights,
                                        void* workspace, size_t workspace_bytes,
                                        const PkmCudaOptions* options, pkm_cuda_stream_t stream) {
  using namespace pkm_cuda;
  int status = ValidateCommon(bags);
  if (status != PKM_CUDA_OK) return status;
  if (alloc == nullptr) return SetInvalid("sparse backward: alloc is null");
  if (d_weights != nullptr && bags->weights == nullptr)
    return SetInvalid("sparse backward: d_weights requested but the bags have no weights");
  Layout layout;
  status = MakeLayout(*bags, options, &layout, Extra::kSparseSlots);
  if (status != PKM_CUDA_OK) return status;
  const int64_t n = layout.num_indices;
  if (n == 0 || bags->num_rows == 0) {  // nothing touched
    int64_t* rows = nullptr;
    void* row_grads = nullptr;
    if (alloc(alloc_ctx, 0, &rows, &row_grads) != 0)
      return SetInvalid("sparse backward: the output allocation callback failed for 0 rows");
    if (d_weights != nullptr && n > 0) {
      const size_t wsize = bags->weights_type == PKM_FLOAT32 ? 4 : 2;
      return CheckCuda(cudaMemsetAsync(d_weights, 0, n * wsize, stream), "memset d_weights");
    }
    return PKM_CUDA_OK;
  }
  if (grad_out == nullptr && bags->dim > 0) return SetInvalid("sparse backward: grad_out is null");
  if (workspace_bytes < layout.total || (layout.total > 0 && workspace == nullptr))
    return SetInvalid("sparse backward: workspace of " + std::to_string(workspace_bytes) +
                      " bytes is too small, need " + std::to_string(layout.total) +
                      " (pkm_cuda_sparse_backward_workspace_bytes)");
  SparseOutputs out;
  out.alloc = alloc;
  out.alloc_ctx = alloc_ctx;
  char* ws = static_cast<char*>(workspace);
  return bags->indices_int64
             ? LaunchBackward<int64_t>(*bags, layout, grad_out, nullptr, d_weights, ws, stream, &out)
             : LaunchBackward<int32_t>(*bags, layout, grad_out, nullptr, d_weights, ws, stream, &out);
}
