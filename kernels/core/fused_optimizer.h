// Fused backward + row-wise optimizer on the CPU: the row-grouped backward
// (RowGradients, embedding_bag.h) hands each touched row's gradient straight
// to the update of that row, so no table gradient is ever written (neither
// [num_rows, dim] nor [indices, dim]; one float32 row per thread). The update
// rules are in row_optimizer.h. Deterministic: a row's gradient is summed in
// entry order and updated by one thread, so the same inputs give bitwise the
// same table and state whatever the thread count.
#ifndef PKM_KERNELS_CORE_FUSED_OPTIMIZER_H_
#define PKM_KERNELS_CORE_FUSED_OPTIMIZER_H_

#include "kernels/core/embedding_bag.h"
#include "kernels/core/row_optimizer.h"

namespace pkm {

// Checks the kind, the hyperparameters (learning_rate finite; epsilon >= 0;
// Adam: 0 <= beta < 1, step >= 1) and that the state the kind needs is set.
Status CheckRowOptimizer(const PkmRowOptimizer& opt, int64_t num_rows, int64_t dim);

// Adam's step size lr * sqrt(1 - beta_2^step) / (1 - beta_1^step), in float32
// as Keras computes it; the learning rate itself for the other kinds.
float RowOptimizerStepSize(const PkmRowOptimizer& opt);

// Updates table row `row` (dim elements of `type` at row_data) and its state
// from the float32 gradient g; step_size from RowOptimizerStepSize.
void ApplyRowUpdate(const PkmRowOptimizer& opt, float step_size, int64_t row, int64_t dim, const float* g,
                    void* row_data, ElemType type);

// The backward of Forward(table, bags, combiner) for upstream gradient
// grad_out, applied to the table in place by `opt`. `table.data` is the table
// that is updated (the caller owns it writable). d_weights as in Backward
// (taken against the table before the update; may be null).
Status FusedBackwardUpdate(const Table& table, const Bags& bags, Combiner combiner, const void* grad_out,
                           ElemType grad_type, const PkmRowOptimizer& opt, void* d_weights,
                           const ParallelFor& pf);

}  // namespace pkm

#endif  // PKM_KERNELS_CORE_FUSED_OPTIMIZER_H_
