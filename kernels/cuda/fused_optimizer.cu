// Fused backward + row-wise optimizer on the GPU (pkm_cuda_fused_update,
// embedding_bag_cuda.h): the backward's sorted passes (backward.cuh), with a
// row-pass epilogue that applies the update of kernels/core/row_optimizer.h
// to the table row tile in place instead of storing its gradient. Nothing of
// size [num_rows, dim] or [indices, dim] is written besides the table and its
// state; untouched rows are skipped. The dots for d_weights are taken in the
// same pass from the row tile before it is updated (one warp owns a row tile).
//
// Row-wise Adagrad needs the whole row's mean square: with one tile per row
// (dim <= 1024) the warp has it; with more, a first row pass leaves per-tile
// sums of squares, a per-row kernel folds them into the accumulator, and a
// second row pass (no dots) applies the update.
#include <cmath>
#include <string>

#include "kernels/core/fused_optimizer.h"
#include "kernels/cuda/backward_rows.cuh"

namespace pkm_cuda {
namespace {

// Plain (coherent) loads of the table row being updated; __ldg's read-only
// path is for data no kernel writes.
template <typename T, int VEC>
__device__ __forceinline__ void LoadForUpdate(const T* ptr, float (&out)[VEC]) {
  Pack<T, VEC> pack;
  if constexpr (VEC == 1) pack.raw = ptr[0]; else pack.raw = *reinterpret_cast<const uint4*>(ptr);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = ToFloat<T>(pack.elems[i]);
}

// VEC float32 state values (16-byte accesses when VEC is a multiple of 4).
template <int VEC>
__device__ __forceinline__ void LoadState(const float* p, float (&x)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int i = 0; i < VEC; i += 4) {
      const float4 q = *reinterpret_cast<const float4*>(p + i);
      x[i] = q.x; x[i + 1] = q.y; x[i + 2] = q.z; x[i + 3] = q.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) x[i] = p[i];
  }
}

template <int VEC>
__device__ __forceinline__ void StoreState(float* p, const float (&x)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int i = 0; i < VEC; i += 4) *reinterpret_cast<float4*>(p + i) = make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) p[i] = x[i];
  }
}

// The sum of squares of a row tile's gradient over the whole warp.
template <int VEC, int U>
__device__ __forceinline__ float WarpSumSquares(const float (&g)[U][VEC]) {
  float sq = 0.f;
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int v = 0; v < VEC; ++v) sq = fmaf(g[u][v], g[u][v], sq);
  return WarpSum(sq);
}

enum class Pass { kUpdate, kSumSquares, kScaledUpdate };

struct Update {
  int kind;
  Pass pass;
  float step_size, epsilon, keep_1, keep_2;
  float* state0;
  float* state1;
  float* row_partials;  // kSumSquares: [num_rows, tiles]; kScaledUpdate: the row's denominator at [row * tiles]

  __device__ bool WantsGradient(const BackwardArgs&) const { return true; }

  // sqrt(acc + epsilon) of a touched row when the warp holds the whole row.
  template <int VEC, int U>
  __device__ float AdagradDenominator(const BackwardArgs& a, int64_t row, const float (&g)[U][VEC]) const {
    const float sq = WarpSumSquares<VEC, U>(g);
    float acc = 0.f;
    if (threadIdx.x % kWarp == 0) {
      acc = state0[row] + sq / static_cast<float>(a.bags.dim);
      state0[row] = acc;
    }
    return sqrtf(__shfl_sync(kFullMask, acc, 0) + epsilon);
  }

  template <typename T, int VEC, int U>
  __device__ void Apply(const BackwardArgs& a, int64_t row, int64_t lane_col, bool touched,
                        const float (&g)[U][VEC]) const {
    if (!touched) return;  // lazy: untouched rows and their state stay
    const int64_t dim = a.bags.dim;
    if (pass == Pass::kSumSquares) {
      const float sq = WarpSumSquares<VEC, U>(g);
      if (threadIdx.x % kWarp == 0) row_partials[row * a.tiles + lane_col / kTileCols] = sq;
      return;
    }
    float denom = 1.f;
    if (kind == PKM_OPT_ROWWISE_ADAGRAD)
      denom = pass == Pass::kScaledUpdate ? row_partials[row * a.tiles] : AdagradDenominator<VEC, U>(a, row, g);
    T* w_row = static_cast<T*>(const_cast<void*>(a.bags.table)) + row * dim;
    // fp32 Adam: batched loads (ApplyAdam). 16-bit tables keep the per-vector
    // loop: batching there raised their kernels' spills (0 -> 380 bytes, D=1024).
    if (kind == PKM_OPT_ADAM && sizeof(T) == 4) return ApplyAdam<T, VEC, U>(w_row, row * dim, lane_col, dim, g);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
      if (col >= dim) continue;
      float w[VEC];
      LoadForUpdate<T, VEC>(w_row + col, w);
      if (kind == PKM_OPT_ADAM) {
        float m[VEC], v[VEC];
        LoadState<VEC>(state0 + row * dim + col, m);
        LoadState<VEC>(state1 + row * dim + col, v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          m[i] += (g[u][i] - m[i]) * keep_1;
          v[i] += (g[u][i] * g[u][i] - v[i]) * keep_2;
          w[i] -= step_size * m[i] / (sqrtf(v[i]) + epsilon);
        }
        StoreState<VEC>(state0 + row * dim + col, m);
        StoreState<VEC>(state1 + row * dim + col, v);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) w[i] -= step_size * g[u][i] / denom;
      }
      StoreFloats<T, VEC>(w_row + col, w);
    }
  }

  // Adam on this lane's columns of one row tile, kAdamBatch vectors at a time:
  // a batch's table, m and v vectors are all loaded before any is stored (the
  // stores could alias later loads as far as the compiler knows, so loads
  // interleaved with stores would wait one memory latency per vector).
  template <typename T, int VEC, int U>
  __device__ void ApplyAdam(T* w_row, int64_t row_offset, int64_t lane_col, int64_t dim,
                            const float (&g)[U][VEC]) const {
    constexpr int kAdamBatch = U < 8 / VEC ? U : (8 / VEC > 0 ? 8 / VEC : 1);
#pragma unroll
    for (int u0 = 0; u0 < U; u0 += kAdamBatch) {
      float w[kAdamBatch][VEC], m[kAdamBatch][VEC], v[kAdamBatch][VEC];
#pragma unroll
      for (int b = 0; b < kAdamBatch; ++b) {
        const int64_t col = lane_col + static_cast<int64_t>(u0 + b) * kWarp * VEC;
        if (u0 + b >= U || col >= dim) continue;
        LoadForUpdate<T, VEC>(w_row + col, w[b]);
        LoadState<VEC>(state0 + row_offset + col, m[b]);
        LoadState<VEC>(state1 + row_offset + col, v[b]);
      }
#pragma unroll
      for (int b = 0; b < kAdamBatch; ++b) {
        const int u = u0 + b;
        const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
        if (u >= U || col >= dim) continue;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          m[b][i] += (g[u][i] - m[b][i]) * keep_1;
          v[b][i] += (g[u][i] * g[u][i] - v[b][i]) * keep_2;
          w[b][i] -= step_size * m[b][i] / (sqrtf(v[b][i]) + epsilon);
        }
        StoreState<VEC>(state0 + row_offset + col, m[b]);
        StoreState<VEC>(state1 + row_offset + col, v[b]);
        StoreFloats<T, VEC>(w_row + col, w[b]);
      }
    }
  }
};

// Multi-tile Adagrad: acc[row] += sum of the tiles' squares / dim; leaves
// sqrt(acc + epsilon) at row_partials[row * tiles].
__global__ void AdagradAccumulateKernel(const uint32_t* seg_begin, int64_t num_rows, int64_t tiles, int64_t dim,
                                        float epsilon, float* acc, float* row_partials) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= num_rows || seg_begin[row + 1] == seg_begin[row]) return;
  float sq = 0.f;
  for (int64_t t = 0; t < tiles; ++t) sq += row_partials[row * tiles + t];
  const float value = acc[row] + sq / static_cast<float>(dim);
  acc[row] = value;
  row_partials[row * tiles] = sqrtf(value + epsilon);
}

int LaunchUpdate(const BackwardArgs& args, int64_t pieces, const Update& update, cudaStream_t stream) {
  // The vector path also reads the Adam moments 16 bytes at a time.
  const bool aligned = update.kind != PKM_OPT_ADAM || (Aligned16(update.state0) && Aligned16(update.state1) &&
                                                       args.bags.dim % 4 == 0);
  switch (args.bags.elem_type) {
    case PKM_FLOAT16: return LaunchRowPasses<__half>(args, pieces, update, aligned, stream);
    case PKM_BFLOAT16: return LaunchRowPasses<__nv_bfloat16>(args, pieces, update, aligned, stream);
    default: return LaunchRowPasses<float>(args, pieces, update, aligned, stream);
  }
}

Update MakeUpdate(const PkmRowOptimizer& opt, const Layout& l, char* ws) {
  Update u;
  u.kind = opt.kind;
  u.pass = Pass::kUpdate;
  u.step_size = pkm::RowOptimizerStepSize(opt);
  u.epsilon = opt.epsilon;
  u.keep_1 = 1.f - opt.beta_1;
  u.keep_2 = 1.f - opt.beta_2;
  u.state0 = opt.state0;
  u.state1 = opt.state1;
  u.row_partials = reinterpret_cast<float*>(ws + l.row_partials);
  return u;
}

// The row passes of the update: one, or three steps for multi-tile Adagrad.
int LaunchUpdatePasses(BackwardArgs args, const Layout& l, Update update, cudaStream_t stream) {
  if (update.kind != PKM_OPT_ROWWISE_ADAGRAD || l.tiles == 1) return LaunchUpdate(args, l.pieces, update, stream);
  update.pass = Pass::kSumSquares;
  if (int status = LaunchUpdate(args, l.pieces, update, stream)) return status;
  AdagradAccumulateKernel<<<Blocks(args.bags.num_rows, 256), 256, 0, stream>>>(
      args.seg_begin, args.bags.num_rows, l.tiles, args.bags.dim, update.epsilon, update.state0, update.row_partials);
  if (int status = CheckLaunch("fused adagrad accumulators")) return status;
  update.pass = Pass::kScaledUpdate;
  args.dots = nullptr;  // taken by the first pass, before any row moved
  return LaunchUpdate(args, l.pieces, update, stream);
}

template <typename IdxT>
int LaunchFused(const PkmBags& bags, const Layout& l, const void* grad_out, const PkmRowOptimizer& opt,
                void* d_weights, char* ws, cudaStream_t stream) {
  BackwardArgs args;
  if (int status = SortEntriesByRow<IdxT>(bags, l, d_weights, ws, stream, &args)) return status;
  args.grad = grad_out;
  args.dots = DotsBuffer(l, ws, args, d_weights);
  if (int status = LaunchUpdatePasses(args, l, MakeUpdate(opt, l, ws), stream)) return status;
  return LaunchWeightsGrad(bags, l.num_indices, l.tiles, args.dots, d_weights, stream);
}

Extra ExtraFor(const PkmRowOptimizer* opt) {
  return opt != nullptr && opt->kind == PKM_OPT_ROWWISE_ADAGRAD ? Extra::kRowPartials : Extra::kNone;
}

}  // namespace
}  // namespace pkm_cuda

extern "C" size_t pkm_cuda_fused_update_workspace_bytes(const PkmBags* bags, const PkmCudaOptions* options) {
  using namespace pkm_cuda;
  if (ValidateCommon(bags) != PKM_CUDA_OK) return 0;
  Layout layout;
  // The per-row partials of multi-tile Adagrad are counted for every kind.
  if (MakeLayout(*bags, options, &layout, Extra::kRowPartials) != PKM_CUDA_OK) return 0;
  return layout.total;
}

extern "C" int pkm_cuda_fused_update(const PkmBags* bags, const void* grad_out, const PkmRowOptimizer* opt,
                                     void* d_weights, void* workspace, size_t workspace_bytes,
                                     const PkmCudaOptions* options, pkm_cuda_stream_t stream) {
  using namespace pkm_cuda;
  int status = ValidateCommon(bags);
  if (status != PKM_CUDA_OK) return status;
  if (opt == nullptr) return SetInvalid("fused update: opt is null");
  const pkm::Status checked = pkm::CheckRowOptimizer(*opt, bags->num_rows, bags->dim);
  if (!checked.ok) return SetInvalid("fused update: " + checked.message);
  if (d_weights != nullptr && bags->weights == nullptr)
    return SetInvalid("fused update: d_weights requested but the bags have no weights");
  Layout layout;
  status = MakeLayout(*bags, options, &layout, ExtraFor(opt));
  if (status != PKM_CUDA_OK) return status;
  const int64_t n = layout.num_indices;
  if (bags->dim == 0 || n == 0 || bags->num_rows == 0) {  // nothing touched: nothing moves
    if (d_weights != nullptr && n > 0) {
      const size_t wsize = bags->weights_type == PKM_FLOAT32 ? 4 : 2;
      return CheckCuda(cudaMemsetAsync(d_weights, 0, n * wsize, stream), "memset d_weights");
    }
    return PKM_CUDA_OK;
  }
  if (grad_out == nullptr) return SetInvalid("fused update: grad_out is null");
  if (workspace_bytes < layout.total || (layout.total > 0 && workspace == nullptr))
    return SetInvalid("fused update: workspace of " + std::to_string(workspace_bytes) + " bytes is too small, need " +
                      std::to_string(layout.total) + " (pkm_cuda_fused_update_workspace_bytes)");
  char* ws = static_cast<char*>(workspace);
  return bags->indices_int64 ? LaunchFused<int64_t>(*bags, layout, grad_out, *opt, d_weights, ws, stream)
                             : LaunchFused<int32_t>(*bags, layout, grad_out, *opt, d_weights, ws, stream);
}
