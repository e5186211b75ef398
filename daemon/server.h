#pragma once

// gradsyncd's gRPC server: its listeners and services, and the objects behind them, from start
// to drain to shutdown.

#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/worker_pool.h"
#include "daemon/backend/cpu/cpu_backend.h"
#include "daemon/backend/cpu/link_peer_watch.h"
#include "daemon/backend/nccl/dispatch_backend.h"
#include "daemon/backend/nccl/nccl_backend.h"
#include "daemon/config.h"
#include "daemon/core/engine.h"
#include "daemon/gpu/gpu_api.h"
#include "daemon/ipc/cuda_importer.h"
#include "daemon/ipc/shm_importer.h"
#include "daemon/metrics/metrics_server.h"
#include "daemon/rpc/gradsync_service.h"
#include "daemon/rpc/health_service.h"
#include "daemon/rpc/inspect_service.h"
#include "daemon/rpc/store_service.h"
#include "daemon/store/job_store.h"
#include "grpcpp/grpcpp.h"
#include "net/store_client.h"

namespace gradsync::daemon {

/// The gRPC side of gradsyncd: the unix-socket and TCP listeners, the GradSync, Store and Inspect
/// services (with the core engine behind GradSync),
/// health (overall and per service) and reflection. Start, then BeginDrain, then Shutdown;
/// not thread-safe across those calls (the owner calls them in order).
class DaemonServer {
 public:
  explicit DaemonServer(DaemonConfig config);
  ~DaemonServer();

  /// Binds and serves; health reports SERVING for every service once this returns OK.
  /// FailedPrecondition if another daemon already serves the socket.
  absl::Status Start();

  /// Health NOT_SERVING everywhere; pending store waits and ops fail with UNAVAILABLE, trainer
  /// sessions end.
  void BeginDrain();

  /// Stops accepting calls, lets in-flight ones finish for `grace`, cancels the rest, removes
  /// the socket file this daemon created.
  void Shutdown(absl::Duration grace);

  /// TCP port actually bound (-1 when TCP is off).
  int tcp_port() const { return tcp_port_; }

  /// "unix=/run/gradsync/gradsyncd.sock tcp=127.0.0.1:7451" for logs and STATUS=.
  std::string Endpoints() const;

  /// Service names health reports on, besides "" (overall).
  static const std::vector<std::string>& ServiceNames();

 private:
  absl::Status PrepareSocketPath();
  // The parts of Start: the unix socket's and the TCP port's listeners (their connections go to
  // the server `builder` makes), then served; metrics; the health port; the store's warnings.
  absl::Status ListenUnix();
  absl::Status ListenTcp(grpc::ServerBuilder& builder);
  void ServeListeners();
  absl::Status StartMetrics(const std::string& mps_mode);
  absl::Status StartHealthPort();
  void CheckStore();
  // A sticky CUDA error: GPU work is over for this process; health says so.
  void OnGpuBroken(const absl::Status& why);
  // An NCCL abort ran past its bound (`hung`), or returned after it did: health follows.
  void OnAbortHung(const absl::Status& why, bool hung);
  // Health after a change of what it depends on: SERVING once started, unless the GPU broke or
  // the unix socket cannot accept trainers (out of descriptors) right now.
  void RefreshHealth();
  // The job store at a root daemon's address: ours, or a (cached) client of the peer's; on etcd
  // ours whatever the address ("" included: such jobs have no root).
  absl::StatusOr<gradsync::Store*> PeerStore(const std::string& address);
  // A (cached) channel to the peer daemon at `address`, for Inspect/ListOps.
  std::shared_ptr<grpc::Channel> PeerChannel(const std::string& address);
  // The options of every channel to a peer daemon: the cluster token, and mutual TLS with our
  // certificate when --tls_* are set. The one place peer channels get their credentials.
  net::ClientOptions PeerOptions() const;

  const DaemonConfig config_;
  core::OpCounters counters_;  // bumped by the engine and NCCL: before (outlives) them
  // The jobs' store this daemon serves: MemoryStore, or EtcdStore with --store=etcd.
  const std::unique_ptr<store::JobStore> store_;
  // On etcd, the threads the Store service's calls run on (each an etcd round trip), so no gRPC
  // thread waits on etcd; null on the embedded store. After the store its tasks use, before the
  // service whose calls they finish.
  std::unique_ptr<WorkerPool> store_calls_;
  // The uids of the unix socket's connections (its Listener records them, PeerAuth reads them):
  // before the auth that points at it and the server whose calls look them up.
  rpc::LocalPeers local_peers_;
  rpc::TcpPeers tcp_peers_;  // TCP connections that made an authenticated call
  rpc::PeerAuth auth_;
  // Trainers hand their memory over it (beside the unix socket); after the importer that
  // redeems its tokens in destruction order, and stopped in Shutdown.
  std::unique_ptr<ipc::FdChannel> fd_channel_;
  ipc::ShmImporter shm_importer_;
  std::unique_ptr<gpu::GpuApi> gpu_;
  ipc::CudaImporter cuda_importer_;
  ipc::DispatchImporter importer_;  // shared memory or CUDA, by the registration
  // Before the backends and engine: the NCCL backend's launched ops watch the other nodes
  // through these stores until it is destroyed, so they go after it.
  absl::Mutex peers_mu_;
  std::string node_address_ ABSL_GUARDED_BY(peers_mu_);
  absl::flat_hash_map<std::string, std::unique_ptr<net::StoreClient>> peer_stores_
      ABSL_GUARDED_BY(peers_mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<grpc::Channel>> peer_channels_
      ABSL_GUARDED_BY(peers_mu_);
  backend::cpu::CpuBackend backend_;
  backend::nccl::NcclBackend nccl_backend_;
  backend::nccl::DispatchBackend dispatch_backend_;  // host buffers to backend_, device to NCCL
  core::Engine engine_;
  // After the engine it calls back (and which calls it): its thread stops before the engine
  // goes, after the server and pool that may still end jobs.
  backend::cpu::LinkPeerWatch peer_watch_;
  // After the engine and backend that use it: destroyed (its queued ops run) before them.
  WorkerPool pool_;
  rpc::GradSyncService gradsync_service_;
  rpc::StoreService store_service_;
  rpc::InspectService inspect_service_;
  rpc::HealthService health_service_;
  std::unique_ptr<grpc::Server> server_;
  // --health_port: a server of its own holding only a health service of its own (same state).
  rpc::HealthService port_health_service_;
  std::unique_ptr<grpc::Server> health_server_;
  // Accept the unix socket and TCP into server_: stopped before the server shuts down.
  std::unique_ptr<rpc::Listener> unix_listener_;
  std::unique_ptr<rpc::Listener> tcp_listener_;
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> tcp_acceptor_;
  absl::Mutex health_mu_;
  bool serving_ ABSL_GUARDED_BY(health_mu_) = false;  // started, not draining
  bool gpu_broken_ ABSL_GUARDED_BY(health_mu_) = false;
  bool abort_hung_ ABSL_GUARDED_BY(health_mu_) = false;  // an NCCL abort runs past its bound
  absl::Status accept_trouble_ ABSL_GUARDED_BY(health_mu_);
  // Last: its HTTP threads read the engine, store and counters, so it goes first.
  std::unique_ptr<metrics::MetricsServer> metrics_;
  int tcp_port_ = -1;
  bool draining_ = false;
};

}  // namespace gradsync::daemon
