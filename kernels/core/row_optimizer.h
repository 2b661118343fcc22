/* The row-wise optimizer that a fused backward applies in place (plain C, for
 * the core, the CUDA launchers and the C ABI alike; mirrored in
 * kernels/capi/pkm_capi.py). For a table row r touched by the bags, with g its
 * float32 gradient (the row-grouped backward's sum over r's entries):
 *
 *   SGD:              w[r] -= lr * g
 *   ROWWISE_ADAGRAD:  acc[r] += mean(g * g);  w[r] -= lr * g / sqrt(acc[r] + epsilon)
 *                     (pkm_serve.optimizers.RowwiseAdagrad, FBGEMM's row-wise Adagrad)
 *   ADAM (lazy):      m[r] += (g - m[r]) * (1 - beta_1);  v[r] += (g * g - v[r]) * (1 - beta_2);
 *                     w[r] -= alpha * m[r] / (sqrt(v[r]) + epsilon),
 *                     alpha = lr * sqrt(1 - beta_2^step) / (1 - beta_1^step)
 *                     (pkm_serve.optimizers.LazyAdam on an IndexedSlices gradient)
 *
 * Rows no entry touches, and their state, are left as they are. State is
 * float32 whatever the table's type. */
#ifndef PKM_KERNELS_CORE_ROW_OPTIMIZER_H_
#define PKM_KERNELS_CORE_ROW_OPTIMIZER_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { PKM_OPT_SGD = 0, PKM_OPT_ROWWISE_ADAGRAD = 1, PKM_OPT_ADAM = 2 };

typedef struct PkmRowOptimizer {
  int32_t kind;
  float learning_rate;
  float epsilon;  /* Adagrad, Adam */
  float beta_1;   /* Adam */
  float beta_2;   /* Adam */
  int64_t step;   /* Adam: this update's 1-based step (Keras: iterations + 1) */
  float* state0;  /* Adagrad: accumulator [num_rows]; Adam: m [num_rows, dim]; SGD: unused */
  float* state1;  /* Adam: v [num_rows, dim]; otherwise unused */
} PkmRowOptimizer;

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif /* PKM_KERNELS_CORE_ROW_OPTIMIZER_H_ */
