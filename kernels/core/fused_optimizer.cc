// Fused backward + row-wise optimizer (CPU): see fused_optimizer.h.
#include "kernels/core/fused_optimizer.h"

#include <cmath>
#include <string>
#include <vector>

#include "kernels/core/vector_ops.h"

namespace pkm {

Status CheckRowOptimizer(const PkmRowOptimizer& opt, int64_t num_rows, int64_t dim) {
  if (opt.kind != PKM_OPT_SGD && opt.kind != PKM_OPT_ROWWISE_ADAGRAD && opt.kind != PKM_OPT_ADAM)
    return Status::Error("optimizer kind must be sgd (0), rowwise_adagrad (1) or adam (2), got " +
                         std::to_string(opt.kind));
  if (!std::isfinite(opt.learning_rate))
    return Status::Error("learning_rate must be finite, got " + std::to_string(opt.learning_rate));
  if (opt.kind == PKM_OPT_SGD) return Status::Ok();
  if (!(opt.epsilon >= 0.f)) return Status::Error("epsilon must be >= 0, got " + std::to_string(opt.epsilon));
  const bool has_rows = num_rows > 0 && dim > 0;
  if (opt.kind == PKM_OPT_ROWWISE_ADAGRAD) {
    if (has_rows && opt.state0 == nullptr) return Status::Error("rowwise_adagrad needs its accumulator (state0)");
    return Status::Ok();
  }
  if (!(opt.beta_1 >= 0.f && opt.beta_1 < 1.f) || !(opt.beta_2 >= 0.f && opt.beta_2 < 1.f))
    return Status::Error("adam needs 0 <= beta_1, beta_2 < 1, got " + std::to_string(opt.beta_1) + ", " +
                         std::to_string(opt.beta_2));
  if (opt.step < 1) return Status::Error("adam step must be >= 1 (1-based), got " + std::to_string(opt.step));
  if (has_rows && (opt.state0 == nullptr || opt.state1 == nullptr))
    return Status::Error("adam needs both moments (state0 = m, state1 = v)");
  return Status::Ok();
}

float RowOptimizerStepSize(const PkmRowOptimizer& opt) {
  if (opt.kind != PKM_OPT_ADAM) return opt.learning_rate;
  const float t = static_cast<float>(opt.step);
  return opt.learning_rate * std::sqrt(1.f - std::pow(opt.beta_2, t)) / (1.f - std::pow(opt.beta_1, t));
}

namespace {

// The updates' column loops, one clone per CPU generation. __builtin_sqrtf
// with the core's -fno-math-errno (sources.bzl): std::sqrt is a
// default-target function that an arch= clone does not inline, and a sqrt
// that may set errno keeps the loop scalar (a call to sqrtf per column: Adam
// took 1.83 ns a float32 column on the Xeon model 207, one thread; 0.37
// now). The loops that divide stop at AVX2: with an AVX-512 clone, Adagrad's
// update took 1.2-1.27x the time on that Xeon.
#if defined(PKM_X86_F16C)
#define PKM_DIVIDING_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PKM_DIVIDING_CLONES
#endif

PKM_MULTIVERSION
void SgdColumns(float step_size, const float* __restrict g, float* __restrict w, int64_t n) {
  for (int64_t c = 0; c < n; ++c) w[c] -= step_size * g[c];
}

PKM_DIVIDING_CLONES
void ScaledColumns(float step_size, float denom, const float* __restrict g, float* __restrict w, int64_t n) {
  for (int64_t c = 0; c < n; ++c) w[c] -= step_size * g[c] / denom;
}

PKM_DIVIDING_CLONES
void AdamColumns(float step_size, float epsilon, float keep_1, float keep_2, const float* __restrict g,
                 float* __restrict w, float* __restrict m, float* __restrict v, int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    m[c] += (g[c] - m[c]) * keep_1;
    v[c] += (g[c] * g[c] - v[c]) * keep_2;
    w[c] -= step_size * m[c] / (__builtin_sqrtf(v[c]) + epsilon);
  }
}

#undef PKM_DIVIDING_CLONES

}  // namespace

void ApplyRowUpdate(const PkmRowOptimizer& opt, float step_size, int64_t row, int64_t dim, const float* g,
                    void* row_data, ElemType type) {
  const bool f32 = type == ElemType::kFloat32;
  // Half-type rows go through a float32 copy, rounded once at the end.
  thread_local std::vector<float> buf;
  float* w = static_cast<float*>(row_data);
  if (!f32) {
    buf.resize(dim);
    vec::ToFloat(row_data, type, buf.data(), dim);
    w = buf.data();
  }
  switch (opt.kind) {
    case PKM_OPT_SGD:
      SgdColumns(step_size, g, w, dim);
      break;
    case PKM_OPT_ROWWISE_ADAGRAD: {
      // The squared sum in column order: a chain of adds no clone shortens;
      // in an AVX-512 clone of its own Adagrad's update took 1.15x the time.
      float sq = 0.f;
      for (int64_t c = 0; c < dim; ++c) sq += g[c] * g[c];
      const float acc = opt.state0[row] + sq / static_cast<float>(dim);
      opt.state0[row] = acc;
      ScaledColumns(step_size, std::sqrt(acc + opt.epsilon), g, w, dim);
      break;
    }
    default:  // Adam
      AdamColumns(step_size, opt.epsilon, 1.f - opt.beta_1, 1.f - opt.beta_2, g, w, opt.state0 + row * dim,
                  opt.state1 + row * dim, dim);
  }
  if (!f32) vec::FromFloat(w, 1.f, type, row_data, dim);
}

Status FusedBackwardUpdate(const Table& table, const Bags& bags, Combiner combiner, const void* grad_out,
                           ElemType grad_type, const PkmRowOptimizer& opt, void* d_weights,
                           const ParallelFor& pf) {
  Status s = CheckRowOptimizer(opt, table.num_rows, table.dim);
  if (!s.ok) return s;
  const float step_size = RowOptimizerStepSize(opt);
  const int64_t row_bytes = table.dim * ElemSize(table.type);
  char* data = static_cast<char*>(const_cast<void*>(table.data));
  return RowGradients(table, bags, combiner, grad_out, grad_type, d_weights, pf, [&](int64_t row, float* g) {
    ApplyRowUpdate(opt, step_size, row, table.dim, g, data + row * row_bytes, table.type);
  });
}

}  // namespace pkm
