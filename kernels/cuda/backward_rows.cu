// Phase 3-4 of the CUDA backward for a table gradient: the row pass of
// backward_rows.cuh with an epilogue that stores each row tile's gradient
// once, into d_table (dense: untouched rows get zeros) or into the row's
// sparse slot (touched rows only).
#include "kernels/cuda/backward_rows.cuh"

namespace pkm_cuda {
namespace {

struct StoreGradient {
  __device__ bool WantsGradient(const BackwardArgs& a) const { return a.d_table != nullptr; }

  template <typename T, int VEC, int U>
  __device__ void Apply(const BackwardArgs& a, int64_t row, int64_t lane_col, bool touched,
                        const float (&acc)[U][VEC]) const {
    if (a.d_table == nullptr || (a.slot_of_row != nullptr && !touched)) return;
    const int64_t dim = a.bags.dim;
    T* out = static_cast<T*>(a.d_table) + (a.slot_of_row ? a.slot_of_row[row] : row) * dim;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
      if (col < dim) StoreFloats<T, VEC>(out + col, acc[u]);
    }
  }
};

}  // namespace

int LaunchGradientRowPasses(const BackwardArgs& args, int64_t pieces, cudaStream_t stream) {
  if (PositionPassApplies(args)) return LaunchPositionPass(args, pieces, stream);
  const bool aligned = args.d_table == nullptr || Aligned16(args.d_table);
  switch (args.bags.elem_type) {
    case PKM_FLOAT16: return LaunchRowPasses<__half>(args, pieces, StoreGradient{}, aligned, stream);
    case PKM_BFLOAT16: return LaunchRowPasses<__nv_bfloat16>(args, pieces, StoreGradient{}, aligned, stream);
    default: return LaunchRowPasses<float>(args, pieces, StoreGradient{}, aligned, stream);
  }
}

}  // namespace pkm_cuda
