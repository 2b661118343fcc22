// Forward over row-wise int8 tables (Table::type == kInt8): the core's
// Forward hands them here after its type and index checks. Its own file so the
// int8 inner loop stays fast on its own, whatever the float loops become.
#ifndef PKM_KERNELS_CORE_FORWARD_INT8_H_
#define PKM_KERNELS_CORE_FORWARD_INT8_H_

#include <atomic>
#include <cstdint>

#include "kernels/core/embedding_bag.h"

namespace pkm {
namespace internal {

// Checks the int8 table's row parameters (row_scales present, row_params_type
// kFloat32 or kFloat16).
Status CheckInt8Table(const Table& table);

// out[b] = combine over the bag of w * (scale[r] * q[r] + bias[r]), float32
// accumulation. Assumes CheckTypes passed. Each block of bags checks its own
// indices (the short rows as they go, the others through CheckedBagsFor), the
// first invalid entry found going to *first_bad, as in Forward.
Status ForwardInt8(const Table& table, const Bags& bags, Combiner combiner, void* out, ElemType out_type,
                   const ParallelFor& unchecked_pf, std::atomic<int64_t>* first_bad);

}  // namespace internal
}  // namespace pkm

#endif  // PKM_KERNELS_CORE_FORWARD_INT8_H_
