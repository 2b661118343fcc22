// The weighted forward for short rows (at most 64 values, a multiple of 8, of
// a float32 or bfloat16 table; rows of multiples of 16 up to 128 on AVX-512
// CPUs, and there float16 ones too): each bag's sum stays in vector registers
// across its entries, read straight from the index stream, with the row a
// fixed number of entries ahead prefetched from it. The general loop
// (bag_window.h) collects windows of row addresses and keeps its sum in
// memory, which costs more per entry than a short row's few lines of data:
// measured on a 2-core EPYC at D=64, the general loop took 1.25-1.4x the time
// of this one (bench/results/cpu_roofline_notes.md).
#ifndef PKM_KERNELS_CORE_SHORT_ROWS_H_
#define PKM_KERNELS_CORE_SHORT_ROWS_H_

#include <cstdint>

#include "kernels/core/embedding_bag.h"

namespace pkm {
namespace internal {

// Whether SumShortRows takes this table (and a weighted combiner).
bool IsShortRowTable(const Table& table, Combiner combiner);

// Bags [b0, b1) into out (rows of out_type), as the general loop computes them
// (an empty bag or one of padding only gives 0). The block's indices are
// checked here (as FirstInvalidEntry), not before: returns the first entry of
// the block whose index the policy rejects (the block's output then partly
// written), else the block's end (bags.End(b1 - 1); 0 for no bags).
int64_t SumShortRows(const Table& table, const Bags& bags, Combiner combiner, char* out, ElemType out_type,
                     int64_t b0, int64_t b1);

}  // namespace internal
}  // namespace pkm

#endif  // PKM_KERNELS_CORE_SHORT_ROWS_H_
