#include "kernels/core/table_pages.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace pkm {
namespace internal {

#if defined(__linux__)
namespace {

constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
constexpr size_t kMinTableBytes = size_t{8} << 20;
constexpr size_t kMaxRemembered = 64;  // ranges tried; the oldest is forgotten beyond this
constexpr int kMadvCollapse = 25;      // MADV_COLLAPSE (asm-generic), absent from older headers
// A range is asked again this long after its last try: a table freed and
// another allocated over the same addresses (a new variable, a model version
// swap) comes back on 4 KB pages, which the record of ranges cannot see.
// Asking again for a range already on huge pages costs ~3 us per 64 MB
// (~32 us per GB, measured on the Zen 4 EPYC VM), once a second. A range
// whose ask failed is not asked again while it is remembered (the last
// kMaxRemembered ranges): a collapse that cannot get 2 MB pages would try
// (and compact memory) anew every time.
constexpr std::chrono::steady_clock::duration kRetryAfter = std::chrono::seconds(1);

bool Enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("PKM_TABLE_HUGEPAGES");
    return v == nullptr || v[0] != '0';
  }();
  return enabled;
}

struct TriedRange {
  uintptr_t begin, end;
  std::chrono::steady_clock::time_point at;
  bool failed;
};

}  // namespace

void AdviseTableHugePagesAt(const void* data, size_t bytes, std::chrono::steady_clock::time_point now) {
  if (bytes < kMinTableBytes || data == nullptr || !Enabled()) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  if (end <= begin) return;
  static std::mutex mu;
  static std::vector<TriedRange> tried;
  auto find = [&] {
    return std::find_if(tried.begin(), tried.end(),
                        [&](const TriedRange& r) { return r.begin == begin && r.end == end; });
  };
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = find();
    if (it != tried.end()) {
      if (it->failed || now - it->at < kRetryAfter) return;
      it->at = now;
    } else {
      if (tried.size() == kMaxRemembered) tried.erase(tried.begin());
      tried.push_back({begin, end, now, false});
    }
  }
  // Advisory: an error (EINVAL on kernels before 6.1, EAGAIN, ENOMEM, ...)
  // leaves the table on the pages it had, which is always correct.
  if (madvise(reinterpret_cast<void*>(begin), end - begin, kMadvCollapse) != 0) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = find();
    if (it != tried.end()) it->failed = true;
  }
}

void AdviseTableHugePages(const void* data, size_t bytes) {
  AdviseTableHugePagesAt(data, bytes, std::chrono::steady_clock::now());
}

void AdviseOutputHugePages(void* data, size_t bytes) {
  if (bytes < kMinTableBytes || data == nullptr || !Enabled()) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}
#else
void AdviseTableHugePagesAt(const void*, size_t, std::chrono::steady_clock::time_point) {}
void AdviseTableHugePages(const void*, size_t) {}
void AdviseOutputHugePages(void*, size_t) {}
#endif

}  // namespace internal
}  // namespace pkm
