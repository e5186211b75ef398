#pragma once

// gradsyncd's configuration (DaemonConfig), filled from flags and validated.

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/tls.h"
#include "daemon/backend/cpu/cpu_backend.h"
#include "daemon/core/engine.h"
#include "daemon/ipc/shm_importer.h"
#include "daemon/store/etcd_store.h"
#include "daemon/store/memory_store.h"

namespace gradsync::daemon {

/// Everything gradsyncd is configured with; filled from flags (ConfigFromFlags) or by tests.
struct DaemonConfig {
  std::string unix_socket = "/run/gradsync/gradsyncd.sock";  // empty: no unix listener
  int socket_mode = 0660;
  int max_local_connections = 4096;          // connections to the unix socket, in all
  int max_local_connections_per_user = 512;  // and per uid (root and the daemon's uid: in all)
  int max_tcp_connections = 1024;            // connections to the TCP port, in all
  int max_tcp_connections_per_source = 64;   // and per remote address
  absl::Duration tcp_first_call_deadline = absl::Seconds(10);  // else the connection is cut
  std::string bind_address = "127.0.0.1";
  std::string advertise_address;  // host other daemons use; empty: bind_address
  // -1: no TCP listener; 0: a free port, reported in STATUS= and the log. TCP serves other
  // daemons only and needs cluster_token (7451 is the customary port).
  int port = -1;
  int max_message_bytes = 16 << 20;
  int max_concurrent_streams = 256;
  absl::Duration max_wait = absl::Hours(1);
  absl::Duration drain_grace = absl::Seconds(10);
  store::MemoryStoreOptions store;  // the limits of either backend
  // Where jobs' stores live: "embedded" (the job's root daemon holds its keys) or "etcd" (every
  // daemon of a job reads and writes them in the etcd cluster of `etcd`; no root daemon).
  std::string store_backend = "embedded";
  store::EtcdOptions etcd;     // with store_backend "etcd" (its limits are `store`)
  int etcd_call_threads = 16;  // threads the Store service's calls run on with etcd
  core::EngineOptions engine;
  ipc::MappingLimits mappings;
  int workers = 0;  // threads for large collectives; 0: one per CPU
  // The CPU data plane's tuning (--cpu_*): for benchmarking.
  backend::cpu::CpuTuning cpu;
  // Liveness of the other daemons of jobs spanning nodes: a heartbeat every peer_heartbeat to
  // each ring neighbour, a neighbour silent for peer_timeout is lost (and every node told).
  absl::Duration peer_timeout = absl::Milliseconds(1500);
  absl::Duration peer_heartbeat = absl::Milliseconds(250);
  int peer_watch_ring = 2;  // ring neighbours watched each way (0: every peer)
  // A finished job's NCCL communicators on one node, kept for its restart (0: dropped at once).
  absl::Duration nccl_keep = absl::Minutes(5);
  std::string cluster_token;  // TCP calls must carry it (required with TCP); from --token_file
  // Mutual TLS on the TCP listener and on every channel to another daemon (--tls_*); nullopt:
  // plaintext TCP. The unix socket is plaintext either way.
  std::optional<TlsPem> tls;
  // Prometheus text on http://metrics_address:metrics_port/metrics; -1: off, 0: a free port.
  int metrics_port = -1;
  std::string metrics_address = "127.0.0.1";
  // grpc.health.v1.Health alone on health_address:health_port (plaintext, no token); -1: off.
  int health_port = -1;
  std::string health_address = "127.0.0.1";
  std::string log_level = "info";
  std::string log_sink = "auto";

  // The host part of this daemon's node address ("host:port") in a job.
  const std::string& node_host() const {
    return advertise_address.empty() ? bind_address : advertise_address;
  }
};

/// Reads the flags (after absl::ParseCommandLine) and validates them.
absl::StatusOr<DaemonConfig> ConfigFromFlags();

/// InvalidArgument naming the first bad setting.
absl::Status Validate(const DaemonConfig& config);

}  // namespace gradsync::daemon
