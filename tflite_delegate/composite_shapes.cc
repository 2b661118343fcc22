// composite_shapes.h: a fused chain's stock ops, re-done on the shapes of a call.
#include "tflite_delegate/composite_shapes.h"

#include "kernels/core/shape_rules.h"

namespace pkm {
namespace tflite {

bool ApplyShapeStep(const ShapeStep& step, std::vector<int64_t>* dims, std::string* error) {
  const int64_t rank = static_cast<int64_t>(dims->size());
  int64_t elems = 1;
  if (!CheckedNumElements(*dims, &elems)) {
    *error = "its element count overflows int64";
    return false;
  }
  switch (step.kind) {
    case ShapeStep::Kind::kIdentity:  // values: the axes the slice names
      if (!step.values.empty() && rank < step.values[0]) {
        *error = "STRIDED_SLICE names " + std::to_string(step.values[0]) + " axes of a rank-" + std::to_string(rank) +
                 " tensor";
        return false;
      }
      return true;
    case ShapeStep::Kind::kExpandDims: {
      int64_t axis = step.values.empty() ? 0 : step.values[0];
      if (axis < 0) axis += rank + 1;
      if (axis < 0 || axis > rank) {
        *error = "EXPAND_DIMS axis " + std::to_string(step.values.empty() ? 0 : step.values[0]) +
                 " is out of range for rank " + std::to_string(rank);
        return false;
      }
      dims->insert(dims->begin() + axis, 1);
      return true;
    }
    case ShapeStep::Kind::kSqueeze: {
      std::vector<bool> drop(rank, false);
      if (step.values.empty()) {
        for (int64_t i = 0; i < rank; ++i) drop[i] = (*dims)[i] == 1;
      } else {
        for (int64_t a : step.values) {
          const int64_t i = a < 0 ? a + rank : a;
          if (i < 0 || i >= rank || (*dims)[i] != 1) {
            *error = "SQUEEZE axis " + std::to_string(a) + " is not an axis of size 1 of " + DimsString(*dims);
            return false;
          }
          drop[i] = true;
        }
      }
      std::vector<int64_t> kept;
      for (int64_t i = 0; i < rank; ++i)
        if (!drop[i]) kept.push_back((*dims)[i]);
      *dims = kept;
      return true;
    }
    case ShapeStep::Kind::kReshape: {
      std::vector<int64_t> shape = step.values;
      int64_t known = 1, unknown = -1;
      for (size_t i = 0; i < shape.size(); ++i) {
        if (shape[i] == -1 && unknown < 0) unknown = static_cast<int64_t>(i);
        else if (shape[i] < 0 || __builtin_mul_overflow(known, shape[i], &known)) known = -1;
        if (known < 0) break;
      }
      bool ok = known >= 0;
      if (ok && unknown >= 0) {
        ok = known > 0 && elems % known == 0;
        if (ok) shape[unknown] = elems / known;
      } else if (ok) {
        ok = known == elems;
      }
      if (!ok) {
        *error = "RESHAPE to " + DimsString(step.values) + " cannot take " + DimsString(*dims);
        return false;
      }
      *dims = shape;
      return true;
    }
  }
  return false;
}

bool CompositeShapesFit(const BagSpec& spec, const Dims& ids, int64_t width, const Dims& weights, Dims* mul,
                        bool* broadcast, std::string* error) {
  const int64_t rank = static_cast<int64_t>(ids.size());  // the gathered rows have rank + 1 axes
  Dims gathered = ids;
  gathered.push_back(width);
  const int64_t axis = spec.sum_axis < 0 ? spec.sum_axis + rank + 1 : spec.sum_axis;
  const std::string rerun = " (the delegate matched the chain for other shapes; run these without fuse_composites)";
  if (axis != rank - 1) {
    *error = "the fused SUM's axis " + std::to_string(spec.sum_axis) + " is not the bag axis of the gathered " +
             DimsString(gathered) + " for these input shapes" + rerun;
    return false;
  }
  *broadcast = false;
  if (spec.weights < 0) return true;
  *mul = weights;
  std::string step_error;
  for (const ShapeStep& step : spec.weight_steps) {
    if (!ApplyShapeStep(step, mul, &step_error)) {
      *error = "weights " + DimsString(weights) + ": " + step_error;
      return false;
    }
  }
  // Broadcasting lines mul up with the gathered rows from the right: its last
  // axis (if any) with the rows' columns, which a weight per row leaves at 1.
  bool fits = static_cast<int64_t>(mul->size()) <= rank + 1 && (mul->empty() || mul->back() == 1);
  for (int64_t i = 0; fits && i < rank; ++i) {
    const int64_t mi = static_cast<int64_t>(mul->size()) - 1 - (rank - i);
    const int64_t d = mi >= 0 ? (*mul)[mi] : 1;
    if (d != ids[i] && d != 1) fits = false;
    if (d != ids[i]) *broadcast = true;
  }
  if (!fits) {
    *error = "weights reach the fused MUL as " + DimsString(*mul) + ", which does not scale each row of the gathered " +
             DimsString(gathered) + rerun;
    return false;
  }
  if (*broadcast && !mul->empty()) mul->pop_back();  // the axis that lines up with the columns
  return true;
}

void BroadcastWeights(const float* w, const Dims& w_dims, const Dims& ids_dims, std::vector<float>* out) {
  const size_t rank = ids_dims.size();
  std::vector<int64_t> stride(rank, 0);  // w's element step per ids axis (0 where broadcast)
  for (int64_t i = static_cast<int64_t>(rank) - 1, s = 1, wi = static_cast<int64_t>(w_dims.size()) - 1; i >= 0;
       --i, --wi) {
    const int64_t d = wi >= 0 ? w_dims[wi] : 1;
    stride[i] = d == 1 ? 0 : s;
    s *= d;
  }
  int64_t total = 1;
  for (int64_t d : ids_dims) total *= d;
  out->resize(total);
  std::vector<int64_t> pos(rank, 0);
  int64_t src = 0;
  for (int64_t j = 0; j < total; ++j) {
    (*out)[j] = w[src];
    for (int64_t i = static_cast<int64_t>(rank) - 1; i >= 0; --i) {  // next position, odometer order
      src += stride[i];
      if (++pos[i] < ids_dims[i]) break;
      src -= stride[i] * ids_dims[i];
      pos[i] = 0;
    }
  }
}

}  // namespace tflite
}  // namespace pkm
