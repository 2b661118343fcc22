// Transparent huge pages for a table the forward reads at random rows.
#ifndef PKM_KERNELS_CORE_TABLE_PAGES_H_
#define PKM_KERNELS_CORE_TABLE_PAGES_H_

#include <chrono>
#include <cstddef>

namespace pkm {
namespace internal {

// Asks Linux once per table range, and again where the range was last asked
// over a second ago and that ask succeeded (MADV_COLLAPSE, Linux >= 6.1), to back the
// 2 MB-aligned interior of [data, data + bytes) with huge pages. Random rows of
// a table on 4 KB pages miss the TLB on nearly every row (a page walk each,
// costly in a VM); on 2 MB pages a 128 MB table fits the TLB. The call keeps
// the contents, changes no mapping flags and is refused by the kernel where the
// owner asked for no huge pages (MADV_NOHUGEPAGE) or the range cannot be
// collapsed: then nothing changes. Tables under 8 MB are left alone. Off with
// PKM_TABLE_HUGEPAGES=0 in the environment. Thread-safe (a mutex guards the
// record of ranges already tried). Asking again lets a table allocated where
// a freed one was (same range, fresh 4 KB pages) be collapsed too.
void AdviseTableHugePages(const void* data, size_t bytes);
// The same at a given time (tests: a retry without waiting a second).
void AdviseTableHugePagesAt(const void* data, size_t bytes, std::chrono::steady_clock::time_point now);

// For an output of 8 MB or more that is about to be written in full (the dense
// d_table): MADV_HUGEPAGE on its 2 MB-aligned interior, so that pages the
// allocator has just mapped fault in 2 MB at a time instead of 4 KB (measured
// on the 2-core VM: a 128 MB d_table took 32768 page faults per backward, a
// fifth of its time). Pages already present are kept as they are. Advisory:
// errors are ignored. Off with PKM_TABLE_HUGEPAGES=0, as above.
void AdviseOutputHugePages(void* data, size_t bytes);

}  // namespace internal
}  // namespace pkm

#endif  // PKM_KERNELS_CORE_TABLE_PAGES_H_
