// Implementation of link_park.h.

#include "daemon/backend/cpu/link_park.h"

#include <algorithm>
#include <utility>

namespace gradsync::backend::cpu {

void LinkPark::SweepLocked(absl::Time now) {
  for (auto home = links_.begin(); home != links_.end();) {
    for (auto it = home->second.begin(); it != home->second.end();) {
      std::vector<Link>& kept = it->second;
      kept.erase(
          std::remove_if(kept.begin(), kept.end(), [now](const Link& l) { return l.until <= now; }),
          kept.end());
      it = kept.empty() ? home->second.erase(it) : std::next(it);
    }
    home = home->second.empty() ? links_.erase(home) : std::next(home);
  }
}

LinkPark::LinkPark(absl::Duration keep) : keep_(keep) {
  thread_ = std::thread([this] { Sweep(); });
}

LinkPark::~LinkPark() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    changed_.Signal();
  }
  thread_.join();
}

void LinkPark::Sweep() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    absl::Time next = absl::InfiniteFuture();
    for (const auto& [home, links] : links_) {
      for (const auto& [node, kept] : links) {
        for (const Link& link : kept) next = std::min(next, link.until);
      }
    }
    changed_.WaitWithDeadline(&mu_, next);
    SweepLocked(absl::Now());
  }
}

void LinkPark::Put(const std::string& home, const std::string& node, Link link) {
  const absl::Time now = absl::Now();
  link.until = now + keep_;
  absl::MutexLock lock(&mu_);
  std::vector<Link>& kept = links_[home][node];
  if (!kept.empty() && kept.front().epoch > link.epoch) return;  // `link` closes
  if (!kept.empty() && kept.front().epoch < link.epoch) kept.clear();
  if (kept.size() >= kMaxPerPeer) kept.erase(kept.begin());
  kept.push_back(std::move(link));
  changed_.Signal();
}

std::map<std::string, std::vector<LinkPark::Link>> LinkPark::Take(
    const std::string& home, const std::vector<std::string>& nodes) {
  absl::MutexLock lock(&mu_);
  SweepLocked(absl::Now());
  std::map<std::string, std::vector<Link>> out;
  auto it = links_.find(home);
  if (it == links_.end()) return out;
  for (const std::string& node : nodes) {
    if (auto kept = it->second.find(node); kept != it->second.end()) {
      out[node] = std::move(kept->second);
      it->second.erase(kept);
    }
  }
  if (it->second.empty()) links_.erase(it);
  return out;
}

size_t LinkPark::size() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [home, links] : links_) {
    for (const auto& [node, kept] : links) n += kept.size();
  }
  return n;
}

}  // namespace gradsync::backend::cpu
