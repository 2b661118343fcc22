// Minimal TFLite C ABI: the types and fields libpkm_tflite.so touches.
//
// No TFLite C headers are installable in our build environment, so this file
// mirrors the parts of tensorflow/lite/core/c/common.h we use. When the real
// header is on the include path it is used instead (same names, same layout).
//
// ABI rules (DESIGN.md "TFLite"): TFLite's C structs only grow at the end.
//  - Structs the runtime hands us (TfLiteContext, TfLiteNode, TfLiteTensor):
//    we only read fields that already exist in tflite_runtime 2.14, the oldest
//    runtime we support. Fields after the last one we read are omitted.
//  - Structs we allocate and hand over (TfLiteRegistration, TfLiteDelegate):
//    declared with the newest layout and zero-initialised, so a newer runtime
//    reads zeros for fields we do not set and an older one reads a prefix.
#ifndef PKM_TFLITE_DELEGATE_TFLITE_ABI_H_
#define PKM_TFLITE_DELEGATE_TFLITE_ABI_H_

#if !defined(PKM_FORCE_OWN_TFLITE_ABI) && defined(__has_include)
#if __has_include("tensorflow/lite/c/common.h")
#include "tensorflow/lite/c/common.h"
#include "tensorflow/lite/c/builtin_op_data.h"
#include "tensorflow/lite/builtin_ops.h"
#define PKM_HAVE_REAL_TFLITE_HEADERS 1
#endif
#endif

#ifndef PKM_HAVE_REAL_TFLITE_HEADERS
#include <stddef.h>
#include <stdint.h>

extern "C" {

typedef enum TfLiteStatus {
  kTfLiteOk = 0,
  kTfLiteError = 1,
  kTfLiteDelegateError = 2,
  kTfLiteApplicationError = 3,
  kTfLiteDelegateDataNotFound = 4,
  kTfLiteDelegateDataWriteError = 5,
  kTfLiteDelegateDataReadError = 6,
  kTfLiteUnresolvedOps = 7,
  kTfLiteCancelled = 8,
} TfLiteStatus;

// Runtime tensor types (c_api_types.h); not the schema's TensorType numbers.
typedef enum TfLiteType {
  kTfLiteNoType = 0,
  kTfLiteFloat32 = 1,
  kTfLiteInt32 = 2,
  kTfLiteUInt8 = 3,
  kTfLiteInt64 = 4,
  kTfLiteString = 5,
  kTfLiteBool = 6,
  kTfLiteInt16 = 7,
  kTfLiteComplex64 = 8,
  kTfLiteInt8 = 9,
  kTfLiteFloat16 = 10,
  kTfLiteFloat64 = 11,
  kTfLiteComplex128 = 12,
  kTfLiteUInt64 = 13,
  kTfLiteResource = 14,
  kTfLiteVariant = 15,
  kTfLiteUInt32 = 16,
  kTfLiteUInt16 = 17,
  kTfLiteInt4 = 18,
  kTfLiteBFloat16 = 19,
} TfLiteType;

typedef struct TfLiteIntArray {
  int size;
  int data[];
} TfLiteIntArray;

// TfLiteFloatArray changed layout across releases ({int size; float data[]}
// up to 2.14/2.2x, {float* data; int size; bool owning} later). We never read
// it through a struct: see ReadAffineScales in embedding_bag_tflite.cc.
typedef struct TfLiteFloatArray TfLiteFloatArray;

typedef struct TfLiteQuantizationParams {
  float scale;
  int32_t zero_point;
} TfLiteQuantizationParams;

typedef enum TfLiteQuantizationType {
  kTfLiteNoQuantization = 0,
  kTfLiteAffineQuantization = 1,
} TfLiteQuantizationType;

typedef struct TfLiteQuantization {
  TfLiteQuantizationType type;
  void* params;
} TfLiteQuantization;

typedef struct TfLiteAffineQuantization {
  TfLiteFloatArray* scale;
  TfLiteIntArray* zero_point;
  int32_t quantized_dimension;
} TfLiteAffineQuantization;

typedef union TfLitePtrUnion {
  int32_t* i32;
  int64_t* i64;
  float* f;
  char* raw;
  const char* raw_const;
  int8_t* int8;
  void* data;
} TfLitePtrUnion;

typedef enum TfLiteAllocationType {
  kTfLiteMemNone = 0,
  kTfLiteMmapRo,
  kTfLiteArenaRw,
  kTfLiteArenaRwPersistent,
  kTfLiteDynamic,
  kTfLitePersistentRo,
  kTfLiteCustom,
  kTfLiteVariantObject,
} TfLiteAllocationType;

typedef int TfLiteBufferHandle;

struct TfLiteContext;
struct TfLiteDelegate;
struct TfLiteRegistration;

// Prefix of the runtime's TfLiteTensor (read-only for us; never allocated by
// us except in the fuzz test, which builds whole arrays of this struct).
typedef struct TfLiteTensor {
  TfLiteType type;
  TfLitePtrUnion data;
  TfLiteIntArray* dims;
  TfLiteQuantizationParams params;
  TfLiteAllocationType allocation_type;
  size_t bytes;
  const void* allocation;
  const char* name;
  struct TfLiteDelegate* delegate;
  TfLiteBufferHandle buffer_handle;
  bool data_is_stale;
  bool is_variable;
  TfLiteQuantization quantization;
  void* sparsity;
  const TfLiteIntArray* dims_signature;
} TfLiteTensor;

typedef struct TfLiteNode {
  TfLiteIntArray* inputs;
  TfLiteIntArray* outputs;
  TfLiteIntArray* intermediates;
  TfLiteIntArray* temporaries;
  void* user_data;
  void* builtin_data;
  const void* custom_initial_data;
  int custom_initial_data_size;
  struct TfLiteDelegate* delegate;
} TfLiteNode;

typedef struct TfLiteDelegateParams {
  struct TfLiteDelegate* delegate;
  TfLiteIntArray* nodes_to_replace;
  TfLiteIntArray* input_tensors;
  TfLiteIntArray* output_tensors;
} TfLiteDelegateParams;

typedef struct TfLiteExternalContext TfLiteExternalContext;

// Fields up to PreviewDelegatePartitioning, all present in 2.14.
typedef struct TfLiteContext {
  size_t tensors_size;
  TfLiteStatus (*GetExecutionPlan)(struct TfLiteContext* context,
                                   TfLiteIntArray** execution_plan);
  TfLiteTensor* tensors;
  void* impl_;
  TfLiteStatus (*ResizeTensor)(struct TfLiteContext*, TfLiteTensor* tensor,
                               TfLiteIntArray* new_size);
  void (*ReportError)(struct TfLiteContext*, const char* msg, ...);
  TfLiteStatus (*AddTensors)(struct TfLiteContext*, int tensors_to_add,
                             int* first_new_tensor_index);
  TfLiteStatus (*GetNodeAndRegistration)(
      struct TfLiteContext*, int node_index, TfLiteNode** node,
      struct TfLiteRegistration** registration);
  TfLiteStatus (*ReplaceNodeSubsetsWithDelegateKernels)(
      struct TfLiteContext*, struct TfLiteRegistration registration,
      const TfLiteIntArray* nodes_to_replace, struct TfLiteDelegate* delegate);
  int recommended_num_threads;
  TfLiteExternalContext* (*GetExternalContext)(struct TfLiteContext*, int);
  void (*SetExternalContext)(struct TfLiteContext*, int,
                             TfLiteExternalContext*);
  bool allow_fp32_relax_to_fp16;
  void* profiler;
  void* (*AllocatePersistentBuffer)(struct TfLiteContext* ctx, size_t bytes);
  TfLiteStatus (*AllocateBufferForEval)(struct TfLiteContext* ctx,
                                        size_t bytes, void** ptr);
  TfLiteStatus (*RequestScratchBufferInArena)(struct TfLiteContext* ctx,
                                              size_t bytes, int* buffer_idx);
  void* (*GetScratchBuffer)(struct TfLiteContext* ctx, int buffer_idx);
  TfLiteStatus (*ResizeTensorExplicit)(struct TfLiteContext* ctx,
                                       TfLiteTensor* tensor, int dims,
                                       const int* shape);
  TfLiteStatus (*PreviewDelegatePartitioning)(
      struct TfLiteContext* context, const TfLiteIntArray* nodes_to_replace,
      TfLiteDelegateParams** partition_params_array, int* num_partitions);
} TfLiteContext;

// Newest layout (we allocate it); passed by value to
// ReplaceNodeSubsetsWithDelegateKernels, so it must not be shorter than the
// runtime's.
typedef struct TfLiteRegistration {
  void* (*init)(TfLiteContext* context, const char* buffer, size_t length);
  void (*free)(TfLiteContext* context, void* buffer);
  TfLiteStatus (*prepare)(TfLiteContext* context, TfLiteNode* node);
  TfLiteStatus (*invoke)(TfLiteContext* context, TfLiteNode* node);
  const char* (*profiling_string)(const TfLiteContext* context,
                                  const TfLiteNode* node);
  int32_t builtin_code;
  const char* custom_name;
  int version;
  void* registration_external;
  void* (*async_kernel)(TfLiteContext* context, TfLiteNode* node);
  uint64_t inplace_operator;
} TfLiteRegistration;

enum { kTfLiteDelegateFlagsNone = 0, kTfLiteDelegateFlagsAllowDynamicTensors = 1 };

// Newest layout (we allocate it).
typedef struct TfLiteDelegate {
  void* data_;
  TfLiteStatus (*Prepare)(TfLiteContext* context, struct TfLiteDelegate* delegate);
  TfLiteStatus (*CopyFromBufferHandle)(TfLiteContext* context,
                                       struct TfLiteDelegate* delegate,
                                       TfLiteBufferHandle buffer_handle,
                                       TfLiteTensor* tensor);
  TfLiteStatus (*CopyToBufferHandle)(TfLiteContext* context,
                                     struct TfLiteDelegate* delegate,
                                     TfLiteBufferHandle buffer_handle,
                                     TfLiteTensor* tensor);
  void (*FreeBufferHandle)(TfLiteContext* context, struct TfLiteDelegate* delegate,
                           TfLiteBufferHandle* handle);
  int64_t flags;
  void* opaque_delegate_builder;
} TfLiteDelegate;

// Builtin op codes (schema BuiltinOperator) the delegate inspects.
enum {
  kTfLiteBuiltinMul = 18,
  kTfLiteBuiltinReshape = 22,
  kTfLiteBuiltinCustom = 32,
  kTfLiteBuiltinGather = 36,
  kTfLiteBuiltinSqueeze = 43,
  kTfLiteBuiltinStridedSlice = 45,
  kTfLiteBuiltinExpandDims = 70,
  kTfLiteBuiltinSum = 74,
};

// builtin_data of the ops we fuse (builtin_op_data.h).
typedef enum { kTfLiteActNone = 0 } TfLiteFusedActivation;
typedef struct TfLiteGatherParams {
  int axis;
  int batch_dims;
} TfLiteGatherParams;
typedef struct TfLiteMulParams {
  int activation;  // TfLiteFusedActivation
} TfLiteMulParams;
typedef struct TfLiteReducerParams {
  bool keep_dims;
} TfLiteReducerParams;
typedef struct TfLiteSqueezeParams {
  int32_t squeeze_dims[8];
  int num_squeeze_dims;
} TfLiteSqueezeParams;
typedef struct TfLiteStridedSliceParams {
  int begin_mask;
  int end_mask;
  int ellipsis_mask;
  int new_axis_mask;
  int shrink_axis_mask;
  bool offset;  // version 8 on (read only where the runtime's op is that new: see IsReshapeLike)
} TfLiteStridedSliceParams;

}  // extern "C"
#endif  // PKM_HAVE_REAL_TFLITE_HEADERS

#endif  // PKM_TFLITE_DELEGATE_TFLITE_ABI_H_
