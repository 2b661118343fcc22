// What the stock ops of a fused GATHER -> MUL -> SUM chain do with the
// shapes of a call: the delegate matches a chain once, with the shapes of
// that moment, and resize_tensor_input may change them afterwards. Used by
// the kernel's Bind (embedding_bag_tflite.cc) and the matcher
// (composite_chain.cc, which records the steps).
#ifndef PKM_TFLITE_DELEGATE_COMPOSITE_SHAPES_H_
#define PKM_TFLITE_DELEGATE_COMPOSITE_SHAPES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tflite_delegate/embedding_bag_tflite.h"

namespace pkm {
namespace tflite {

// dims -> the shape `step` gives them, as the stock op would; false with a
// message where the stock op would fail on them.
bool ApplyShapeStep(const ShapeStep& step, std::vector<int64_t>* dims, std::string* error);

// For a composite spec: whether its SUM still reduces the bag axis of the
// gathered [ids..., width] and its weights (`weights` dims, through
// spec.weight_steps) still scale whole rows: equal to [ids..., 1] or a
// broadcast of it (*broadcast; *mul is then their shape at the MUL less the
// axis that lines up with the columns). False with a message otherwise.
bool CompositeShapesFit(const BagSpec& spec, const std::vector<int64_t>& ids, int64_t width,
                        const std::vector<int64_t>& weights, std::vector<int64_t>* mul, bool* broadcast,
                        std::string* error);

// weights [w_dims] read as the stock MUL broadcasts them over positions
// [ids_dims] (w_dims aligned from the right; each of its dims 1 or the
// position's): one weight per position, in the indices' order.
void BroadcastWeights(const float* w, const std::vector<int64_t>& w_dims, const std::vector<int64_t>& ids_dims,
                      std::vector<float>* out);

}  // namespace tflite
}  // namespace pkm

#endif  // PKM_TFLITE_DELEGATE_COMPOSITE_SHAPES_H_
