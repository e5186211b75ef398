#pragma once

// Record links between in-process "nodes" for tests: real TCP on loopback, rendezvous over a
// MemoryStore, one thread per node.

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "daemon/backend/cpu/record_links.h"
#include "daemon/store/memory_store.h"
#include "gtest/gtest.h"

namespace gradsync::backend::cpu {

inline const std::vector<std::string> kNodes = {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"};

// Node `me` of `nodes` (job "j"), linked to `peers` (empty: every other node).
inline RecordLinks::Spec SpecOf(gradsync::Store* store, std::vector<std::string> nodes, int me,
                                std::vector<int> peers, std::string prefix,
                                size_t max_message_bytes = 1 << 20) {
  RecordLinks::Spec spec;
  spec.store = store;
  spec.job = "j";
  spec.prefix = std::move(prefix);
  spec.nodes = std::move(nodes);
  spec.me = me;
  spec.peers = std::move(peers);
  spec.max_message_bytes = max_message_bytes;
  return spec;
}

// Node `me` of the first `nodes` of kNodes, linked to every other.
inline RecordLinks::Spec SpecOf(gradsync::Store* store, int me, int nodes,
                                std::string prefix = "r/", size_t max_message_bytes = 1 << 20) {
  return SpecOf(store, std::vector<std::string>(kNodes.begin(), kNodes.begin() + nodes), me, {},
                std::move(prefix), max_message_bytes);
}

// Connects `nodes` nodes, each on its own thread; returns their links (all must connect).
inline std::vector<std::unique_ptr<RecordLinks>> ConnectAll(gradsync::Store* store, int nodes,
                                                            size_t max_message_bytes = 1 << 20) {
  std::vector<std::unique_ptr<RecordLinks>> links(nodes);
  std::vector<absl::Status> status(nodes);
  std::vector<std::thread> threads;
  for (int i = 0; i < nodes; ++i) {
    threads.emplace_back([&, i] {
      auto l = RecordLinks::Connect(SpecOf(store, i, nodes, "r/", max_message_bytes),
                                    absl::Now() + absl::Seconds(20));
      status[i] = l.status();
      if (l.ok()) links[i] = *std::move(l);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < nodes; ++i) EXPECT_TRUE(status[i].ok()) << i << ": " << status[i];
  return links;
}

inline void RunOnEach(int nodes, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int i = 0; i < nodes; ++i) threads.emplace_back(fn, i);
  for (std::thread& t : threads) t.join();
}

}  // namespace gradsync::backend::cpu
