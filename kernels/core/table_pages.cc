#include "kernels/core/table_pages.h"

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <utility>
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

bool Enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("PKM_TABLE_HUGEPAGES");
    return v == nullptr || v[0] != '0';
  }();
  return enabled;
}

}  // namespace

void AdviseTableHugePages(const void* data, size_t bytes) {
  if (bytes < kMinTableBytes || data == nullptr || !Enabled()) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  if (end <= begin) return;
  static std::mutex mu;
  static std::vector<std::pair<uintptr_t, uintptr_t>> tried;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& r : tried)
      if (r.first == begin && r.second == end) return;
    if (tried.size() == kMaxRemembered) tried.erase(tried.begin());
    tried.emplace_back(begin, end);
  }
  // Advisory: an error (EINVAL on kernels before 6.1, EAGAIN, ENOMEM, ...)
  // leaves the table on the pages it had, which is always correct.
  (void)madvise(reinterpret_cast<void*>(begin), end - begin, kMadvCollapse);
}

void AdviseOutputHugePages(void* data, size_t bytes) {
  if (bytes < kMinTableBytes || data == nullptr || !Enabled()) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}
#else
void AdviseTableHugePages(const void*, size_t) {}
void AdviseOutputHugePages(void*, size_t) {}
#endif

}  // namespace internal
}  // namespace pkm
