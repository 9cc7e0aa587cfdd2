#include "server/scheduling/memory_budget.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <optional>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "server/scheduling/heap_trim.h"

namespace mha::server {
namespace {

// A reservation at least this large is large work (heap_trim.h): freed
// memory goes back to the system once such work stops; smaller ones are
// left to the allocator's reuse.
constexpr int64_t kTrimAfterBytes = int64_t{64} << 20;

// Counts a reservation of `bytes` as large work once they reach
// kTrimAfterBytes (`large` says whether it is already).
void NoteIfLarge(int64_t bytes, bool& large) {
  if (large || bytes < kTrimAfterBytes) return;
  large = true;
  LargeWorkStarted();
}

std::optional<std::string> ReadFirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return line;
}

// The memory limit of the cgroup this process runs in, if it has one:
// cgroup v2 memory.max, else v1 memory.limit_in_bytes (huge values there
// mean "no limit"). Looks at the process's own cgroup path, then at the
// root of the hierarchy (what a container with a cgroup namespace sees).
std::optional<int64_t> CgroupLimit(std::string* which) {
  std::ifstream cgroups("/proc/self/cgroup");
  std::string line;
  std::vector<std::pair<std::string, std::string>> candidates;  // path, name
  while (std::getline(cgroups, line)) {
    std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3) continue;
    if (parts[0] == "0" && parts[1].empty()) {
      candidates.push_back(
          {absl::StrCat("/sys/fs/cgroup", parts[2], "/memory.max"), "cgroup memory.max"});
    } else if (absl::StrContains(parts[1], "memory")) {
      candidates.push_back(
          {absl::StrCat("/sys/fs/cgroup/memory", parts[2], "/memory.limit_in_bytes"),
           "cgroup memory.limit_in_bytes"});
    }
  }
  candidates.push_back({"/sys/fs/cgroup/memory.max", "cgroup memory.max"});
  candidates.push_back(
      {"/sys/fs/cgroup/memory/memory.limit_in_bytes", "cgroup memory.limit_in_bytes"});
  for (const auto& [path, name] : candidates) {
    std::optional<std::string> text = ReadFirstLine(path);
    if (!text.has_value()) continue;
    int64_t bytes = 0;
    // "max" (v2) or a page-rounded INT64_MAX (v1): no limit here.
    if (!absl::SimpleAtoi(*text, &bytes) || bytes >= (int64_t{1} << 60)) return std::nullopt;
    *which = name;
    return bytes;
  }
  return std::nullopt;
}

// Address space a serving process maps beyond its start-up size that is
// not request memory: thread stacks (gRPC's pool, the OpenMP team) and
// glibc's per-thread malloc arenas (64 MiB reserved each). Measured ~1 GB
// of VmSize at idle on 2 cores, against ~70 MB when the limit is resolved.
constexpr int64_t kAddressSpaceOverhead = int64_t{1} << 30;

// The address space RLIMIT_AS leaves above what the process maps now and
// the overhead to come.
std::optional<int64_t> AddressSpaceLeft() {
  rlimit limit{};
  if (getrlimit(RLIMIT_AS, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return std::nullopt;
  int64_t mapped = 0;
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    absl::string_view rest = line;
    if (absl::ConsumePrefix(&rest, "VmSize:")) {
      rest = absl::StripAsciiWhitespace(absl::StripSuffix(absl::StripAsciiWhitespace(rest), "kB"));
      if (absl::SimpleAtoi(rest, &mapped)) mapped *= 1024;
    }
  }
  return std::max<int64_t>(0,
                           static_cast<int64_t>(limit.rlim_cur) - mapped - kAddressSpaceOverhead);
}

}  // namespace

int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(statm >> size >> resident)) return 0;
  return resident * sysconf(_SC_PAGE_SIZE);
}

std::string WithCommas(int64_t n) {
  std::string digits = absl::StrCat(n < 0 ? -n : n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? absl::StrCat("-", out) : out;
}

MemoryLimit ResolveMemoryLimit(int64_t flag_bytes) {
  if (flag_bytes > 0) return {flag_bytes, "--memory_limit_bytes"};
  int64_t base = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  std::string source = "physical memory";
  std::string cgroup_name;
  if (std::optional<int64_t> cgroup = CgroupLimit(&cgroup_name); cgroup && *cgroup < base) {
    base = *cgroup;
    source = cgroup_name;
  }
  if (std::optional<int64_t> left = AddressSpaceLeft(); left && *left < base) {
    base = *left;
    source = "the address space RLIMIT_AS leaves (less 1 GiB for threads and arenas)";
  }
  return {base / 4 * 3, absl::StrCat("75% of ", source, " (", WithCommas(base), ")")};
}

MemoryReservation& MemoryReservation::operator=(MemoryReservation&& other) noexcept {
  if (this != &other) {
    Release();
    budget_ = other.budget_;
    queued_ = other.queued_;
    active_ = other.active_;
    large_ = other.large_;
    other.budget_ = nullptr;
    other.queued_ = other.active_ = 0;
    other.large_ = false;
  }
  return *this;
}

void MemoryReservation::Release() {
  if (budget_ != nullptr && (queued_ != 0 || active_ != 0)) budget_->Release(queued_, active_);
  queued_ = active_ = 0;
  if (large_) {  // its blocks are free now: given back once large work stops
    large_ = false;
    LargeWorkDone();
  }
}

MemoryBudget::MemoryBudget(int64_t limit, prometheus::Gauge* reserved_gauge)
    : limit_(limit), reserved_gauge_(reserved_gauge) {}

int64_t MemoryBudget::reserved() const {
  MutexLock lock(mu_);
  return queued_ + active_;
}

int64_t MemoryBudget::active() const {
  MutexLock lock(mu_);
  return active_;
}

bool MemoryBudget::TryReserveQueued(int64_t bytes, MemoryReservation& into) {
  MutexLock lock(mu_);
  if (queued_ + active_ + bytes > capacity()) return false;
  queued_ += bytes;
  into.budget_ = this;
  into.queued_ += bytes;
  Publish();
  NoteIfLarge(into.bytes(), into.large_);
  return true;
}

MemoryBudget::Growth MemoryBudget::TryGrowActive(int64_t bytes, MemoryReservation& into) {
  MutexLock lock(mu_);
  if (queued_ + active_ + bytes > capacity()) {
    return active_ > 0 ? Growth::kFullUntilActiveReturns : Growth::kFull;
  }
  active_ += bytes;
  into.budget_ = this;
  into.active_ += bytes;
  Publish();
  NoteIfLarge(into.bytes(), into.large_);
  return Growth::kGrown;
}

void MemoryBudget::MarkLeaving(MemoryReservation& reservation) {
  if (reservation.budget_ != this) return;  // nothing reserved here
  MutexLock lock(mu_);
  queued_ -= reservation.queued_;
  active_ += reservation.queued_;
  reservation.active_ += reservation.queued_;
  reservation.queued_ = 0;
}

void MemoryBudget::WaitForRelease(absl::Duration timeout) {
  MutexLock lock(mu_);
  released_.WaitFor(lock, timeout);
}

void MemoryBudget::Release(int64_t queued, int64_t active) {
  {
    MutexLock lock(mu_);
    queued_ -= queued;
    active_ -= active;
    Publish();
  }
  released_.NotifyAll();
}

void MemoryBudget::Publish() {
  if (reserved_gauge_ != nullptr) reserved_gauge_->Set(static_cast<double>(queued_ + active_));
}

}  // namespace mha::server
