// Implementation of server.h: builds the store, importers, backends, engine and services from
// the config, binds the listeners, and runs drain and shutdown.

#include "daemon/server.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_id.h"
#include "common/logging.h"
#include "common/store_keys.h"
#include "daemon/core/membership.h"
#include "daemon/gpu/mps.h"
#include "daemon/store/etcd_store.h"
#include "daemon/store/memory_store.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/impl/server_builder_plugin.h"

namespace gradsync::daemon {
namespace {

auto Log() { return logging::Logger("daemon"); }

backend::cpu::LinkPeerWatch::Options WatchOptions(const DaemonConfig& c) {
  backend::cpu::LinkPeerWatch::Options o;
  o.timeout = c.peer_timeout;
  o.interval = c.peer_heartbeat;
  o.ring = c.peer_watch_ring;
  return o;
}

// What a reply's payload may take of --max_message_bytes, the rest left for its envelope.
int64_t ReplyBytes(const DaemonConfig& config) { return config.max_message_bytes - 4096; }

backend::nccl::NcclOptions NcclOptionsFor(const DaemonConfig& config, core::OpCounters* counters,
                                          std::function<void(const absl::Status&)> on_hung,
                                          std::function<void()> on_returned) {
  backend::nccl::NcclOptions options;
  options.counters = counters;
  options.on_abort_hung = std::move(on_hung);
  options.on_abort_returned = std::move(on_returned);
  options.watch_every = absl::Milliseconds(100);  // idle communicators (an op watches its own)
  options.keep_after_job = config.nccl_keep;
  return options;
}

core::EngineOptions EngineOptionsFor(const DaemonConfig& config, core::OpCounters* counters) {
  core::EngineOptions options = config.engine;
  options.counters = counters;
  return options;
}

// The store's options, with wait replies bounded by what one gRPC message may carry.
store::MemoryStoreOptions StoreOptionsFor(const DaemonConfig& config) {
  store::MemoryStoreOptions options = config.store;
  options.max_reply_bytes = ReplyBytes(config);
  return options;
}

// The jobs' store of --store: embedded, or on etcd.
std::unique_ptr<store::JobStore> MakeStore(const DaemonConfig& config) {
  if (config.store_backend == "etcd") {
    store::EtcdOptions options = config.etcd;
    options.limits = StoreOptionsFor(config);
    return std::make_unique<store::EtcdStore>(std::move(options));
  }
  return std::make_unique<store::MemoryStore>(StoreOptionsFor(config));
}

// The TCP listener's credentials: mutual TLS when configured (a client must present a
// certificate that chains to the CA, or the handshake fails before any call), else plaintext.
// Either way every call but health and reflection still needs the cluster token (PeerAuth).
std::shared_ptr<grpc::ServerCredentials> TcpCredentials(const DaemonConfig& config) {
  if (!config.tls.has_value()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_root_certs = config.tls->ca;
  ssl.pem_key_cert_pairs.push_back({config.tls->private_key, config.tls->cert_chain});
  return grpc::SslServerCredentials(ssl);
}

// True if something accepts connections on the unix socket at `path`.
bool SocketIsLive(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  const bool live = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return live;
}

}  // namespace

DaemonServer::DaemonServer(DaemonConfig config)
    : config_(std::move(config)),
      store_(MakeStore(config_)),
      store_calls_(config_.store_backend == "etcd"
                       ? std::make_unique<WorkerPool>(config_.etcd_call_threads)
                       : nullptr),
      auth_(config_.cluster_token),
      shm_importer_(config_.mappings),
      gpu_(gpu::NewGpuApi([this](const absl::Status& why) { OnGpuBroken(why); })),
      cuda_importer_(gpu_.get()),
      importer_(&shm_importer_, &cuda_importer_),
      backend_(&pool_, config_.cpu),
      nccl_backend_(gpu_.get(), NcclOptionsFor(
                                    config_, &counters_,
                                    [this](const absl::Status& why) { OnAbortHung(why, true); },
                                    [this] { OnAbortHung(absl::OkStatus(), false); })),
      dispatch_backend_(&backend_, &nccl_backend_),
      engine_(
          &dispatch_backend_, &importer_, &pool_, EngineOptionsFor(config_, &counters_),
          [this](const std::string& job) {
            // First: a data plane may tell the job's other nodes through its store.
            static_cast<core::Backend&>(dispatch_backend_).JobEnded(job);
            // The membership room's retention: an elastic epoch's namespace holding a decision
            // stays for the survivors that have not read it (membership.h).
            if (!core::RetainsNamespace(*store_, job)) store_->DeleteJob(job);
          },
          [this](const std::string& address) { return PeerStore(address); }),
      peer_watch_(WatchOptions(config_)),
      pool_(config_.workers > 0
                ? config_.workers
                : std::max(1, static_cast<int>(std::thread::hardware_concurrency()))),
      gradsync_service_(&engine_, &importer_, &auth_),
      store_service_(store_.get(), config_.max_wait, ReplyBytes(config_), &auth_,
                     store_calls_.get()),
      inspect_service_(
          store_.get(), &engine_, ReplyBytes(config_), &auth_,
          rpc::PeerLink{[this](const std::string& a) { return PeerChannel(a); }, PeerOptions()}),
      health_service_(ServiceNames()),
      port_health_service_(ServiceNames()) {
  engine_.SetPeerWatch(&peer_watch_);  // before any session can form a job
  auth_.SetLocalPeers(&local_peers_);
  auth_.SetTcpPeers(&tcp_peers_);
  auth_.SetJobHolders([this](absl::string_view job) { return engine_.HolderUids(job); });
  if (auto* memory = dynamic_cast<store::MemoryStore*>(store_.get())) {
    memory->SetHolder([this](absl::string_view job) { return engine_.HoldsNamespace(job); });
  }
}

void DaemonServer::OnGpuBroken(const absl::Status& why) {
  Log()->critical(
      "the daemon's CUDA context is broken: every GPU op fails until gradsyncd restarts; health "
      "is NOT_SERVING error={}",
      why.ToString());
  {
    absl::MutexLock lock(&health_mu_);
    gpu_broken_ = true;
  }
  RefreshHealth();
}

void DaemonServer::OnAbortHung(const absl::Status& why, bool hung) {
  if (hung) {
    Log()->error("health is NOT_SERVING until the NCCL abort returns: {}",
                 std::string(why.message()));
  } else {
    Log()->info("the NCCL abort that hung has returned; health follows the daemon's state again");
  }
  {
    absl::MutexLock lock(&health_mu_);
    abort_hung_ = hung;
  }
  RefreshHealth();
}

void DaemonServer::RefreshHealth() {
  absl::MutexLock lock(&health_mu_);
  const bool serving = serving_ && !gpu_broken_ && !abort_hung_ && accept_trouble_.ok();
  health_service_.SetServing(serving);
  port_health_service_.SetServing(serving);
}

DaemonServer::~DaemonServer() {
  if (server_) Shutdown(absl::ZeroDuration());
  // The store outlives the engine (member order): it must stop asking it first.
  if (auto* memory = dynamic_cast<store::MemoryStore*>(store_.get())) memory->SetHolder(nullptr);
}

const std::vector<std::string>& DaemonServer::ServiceNames() {
  static const auto* names = new std::vector<std::string>{v1::GradSync::service_full_name(),
                                                          v1::Store::service_full_name(),
                                                          v1::Inspect::service_full_name()};
  return *names;
}

absl::Status DaemonServer::PrepareSocketPath() {
  const std::filesystem::path path(config_.unix_socket);
  std::error_code ec;
  std::filesystem::create_directories(path.parent_path(), ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create ", path.parent_path().string(), ": ", ec.message()));
  }
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return absl::OkStatus();  // nothing there
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path.string(), " exists and is not a socket; refusing to replace it"));
  }
  if (SocketIsLive(path)) {
    return absl::FailedPreconditionError(
        absl::StrCat("another daemon is serving ", path.string(), "; stop it first"));
  }
  Log()->info("removing stale socket path={}", path.string());
  ::unlink(path.c_str());
  return absl::OkStatus();
}

absl::Status DaemonServer::Start() {
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  const gpu::MpsFacts facts =
      gpu::GatherMpsFacts(gpu_.get(), std::getenv("CUDA_MPS_PIPE_DIRECTORY"), absl::Seconds(5));
  // CUDA buffers wait for CUDA's answer, which may come later than the 5 s given here.
  cuda_importer_.SetCudaAnswered(facts.cuda_answered);
  const gpu::MpsState mps = gpu::DecideMps(facts);
  Log()->info("gpu: mps={} reason={}", gpu::MpsModeName(mps.mode), mps.reason);
  inspect_service_.SetMps(gpu::MpsModeName(mps.mode), mps.reason);

  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(config_.max_message_bytes);
  builder.SetMaxSendMessageSize(config_.max_message_bytes);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, config_.max_concurrent_streams);
  builder.RegisterService(&gradsync_service_);
  builder.RegisterService(&store_service_);
  builder.RegisterService(&inspect_service_);
  builder.RegisterService(&health_service_);
  if (absl::Status s = ListenUnix(); !s.ok()) return s;
  if (absl::Status s = ListenTcp(builder); !s.ok()) return s;
  server_ = builder.BuildAndStart();
  if (!server_ || (config_.port >= 0 && tcp_port_ <= 0)) {
    server_.reset();
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", Endpoints(), " (address in use or not permitted?",
        config_.tls.has_value() ? " or --tls_cert, --tls_key and --tls_ca not a usable set?" : "",
        ")"));
  }
  ServeListeners();
  if (config_.port >= 0) {
    const std::string node = absl::StrCat(config_.node_host(), ":", tcp_port_);
    {
      absl::MutexLock lock(&peers_mu_);
      node_address_ = node;
    }
    engine_.SetNodeAddress(node);
  }
  if (absl::Status s = StartMetrics(gpu::MpsModeName(mps.mode)); !s.ok()) return s;
  if (absl::Status s = StartHealthPort(); !s.ok()) return s;
  CheckStore();
  {
    absl::MutexLock lock(&health_mu_);
    serving_ = true;
  }
  RefreshHealth();
  Log()->info("serving {} tcp_tls={} max_message_bytes={} max_concurrent_streams={}", Endpoints(),
              config_.tls.has_value() ? "mutual" : "off", config_.max_message_bytes,
              config_.max_concurrent_streams);
  return absl::OkStatus();
}

absl::Status DaemonServer::ListenUnix() {
  if (config_.unix_socket.empty()) return absl::OkStatus();
  if (absl::Status s = PrepareSocketPath(); !s.ok()) return s;
  // Accepted here, not by gRPC: each connection's uid is recorded for the calls on it.
  auto listener = rpc::Listener::Unix(config_.unix_socket, config_.socket_mode, &local_peers_,
                                      {static_cast<size_t>(config_.max_local_connections),
                                       static_cast<size_t>(config_.max_local_connections_per_user)},
                                      [this](const absl::Status& s) {
                                        {
                                          absl::MutexLock lock(&health_mu_);
                                          accept_trouble_ = s;
                                        }
                                        RefreshHealth();
                                      });
  if (!listener.ok()) return listener.status();
  unix_listener_ = *std::move(listener);
  // No daemon serves the socket (checked above), so a channel file beside it is stale.
  auto channel = ipc::FdChannel::Listen(config_.unix_socket + ".fd", config_.socket_mode);
  if (!channel.ok()) return channel.status();
  fd_channel_ = *std::move(channel);
  shm_importer_.set_fd_channel(fd_channel_.get());
  return absl::OkStatus();
}

absl::Status DaemonServer::ListenTcp(grpc::ServerBuilder& builder) {
  if (config_.port < 0) return absl::OkStatus();
  // Accepted here too, each remote host held to its share of connections; gRPC speaks TLS
  // (or not) on what it is handed.
  auto listener = rpc::Listener::Tcp(config_.bind_address, config_.port,
                                     {static_cast<size_t>(config_.max_tcp_connections),
                                      static_cast<size_t>(config_.max_tcp_connections_per_source),
                                      &tcp_peers_, config_.tcp_first_call_deadline},
                                     nullptr);
  if (!listener.ok()) return listener.status();
  tcp_listener_ = *std::move(listener);
  tcp_port_ = tcp_listener_->port();
  tcp_acceptor_ = builder.experimental().AddExternalConnectionAcceptor(
      grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD,
      TcpCredentials(config_));
  return absl::OkStatus();
}

void DaemonServer::ServeListeners() {
  if (unix_listener_) {
    unix_listener_->Serve([server = server_.get()](int fd, const rpc::Listener::Source&) {
      grpc::AddInsecureChannelFromFd(server, fd);  // its calls' peer: "fd:<fd>" (LocalPeers)
    });
  }
  if (tcp_listener_) {
    tcp_listener_->Serve([acceptor = tcp_acceptor_.get(), listener = tcp_listener_->fd()](
                             int fd, const rpc::Listener::Source&) {
      grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters p;
      p.listener_fd = listener;
      p.fd = fd;
      acceptor->HandleNewConnection(&p);
    });
  }
}

absl::Status DaemonServer::StartMetrics(const std::string& mps_mode) {
  if (config_.metrics_port < 0) return absl::OkStatus();
  auto metrics =
      metrics::MetricsServer::Start(config_.metrics_address, config_.metrics_port,
                                    {&counters_, &engine_, store_.get(), &peer_watch_, mps_mode});
  if (!metrics.ok()) return metrics.status();
  metrics_ = *std::move(metrics);
  Log()->info("metrics serving http://{}:{}/metrics", config_.metrics_address, metrics_->port());
  return absl::OkStatus();
}

namespace {
// Takes every plugin off a server builder: the health port serves its one service, without the
// reflection every builder of this binary otherwise gets (grpc++_reflection registers itself
// for all builders when it loads).
class NoPlugins final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->clear();
  }
};
}  // namespace

absl::Status DaemonServer::StartHealthPort() {
  if (config_.health_port < 0) return absl::OkStatus();
  const std::string host = absl::StrContains(config_.health_address, ':')
                               ? absl::StrCat("[", config_.health_address, "]")
                               : config_.health_address;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.SetOption(std::make_unique<NoPlugins>());
  builder.SetMaxReceiveMessageSize(4096);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 16);
  builder.AddListeningPort(absl::StrCat(host, ":", config_.health_port),
                           grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&port_health_service_);
  health_server_ = builder.BuildAndStart();
  if (!health_server_ || port <= 0) {
    health_server_.reset();
    return absl::UnavailableError(absl::StrCat("cannot listen for health on ", host, ":",
                                               config_.health_port,
                                               " (address in use or not permitted?)"));
  }
  Log()->info("health serving tcp={}:{} (grpc.health.v1.Health only)", host, port);
  return absl::OkStatus();
}

void DaemonServer::CheckStore() {
  if (config_.store_backend == "etcd") {
    std::vector<std::string> warnings, missing;
    if (config_.etcd.ca_pem.empty() && config_.etcd.cert_pem.empty()) {
      missing.push_back("without TLS (--etcd_ca)");
    }
    if (config_.etcd.user.empty()) missing.push_back("without authentication (--etcd_user)");
    if (!missing.empty()) {
      warnings.push_back(absl::StrCat(
          "the store is on an etcd reached ", absl::StrJoin(missing, " and "),
          ": whoever reaches that etcd can read and rewrite every job's store, the daemons' "
          "keys included (docs/security.md)"));
      Log()->warn("{}", warnings.back());
    }
    inspect_service_.SetWarnings(std::move(warnings));
  }
  if (auto* etcd = dynamic_cast<store::EtcdStore*>(store_.get())) {
    // Not fatal: the daemon serves jobs that need no store while etcd is away, and store calls
    // say what is wrong.
    if (absl::Status s = etcd->Probe(absl::Seconds(2)); s.ok()) {
      Log()->info("store on {} prefix={}", etcd->name(), config_.etcd.prefix);
    } else {
      Log()->warn("store on {} prefix={}: not reachable yet: {}", etcd->name(), config_.etcd.prefix,
                  s.ToString());
    }
  }
}

void DaemonServer::BeginDrain() {
  if (!server_ || draining_) return;
  draining_ = true;
  Log()->info("draining grace={}", absl::FormatDuration(config_.drain_grace));
  {
    absl::MutexLock lock(&health_mu_);
    serving_ = false;
  }
  health_service_.Shutdown();  // NOT_SERVING everywhere; Watch streams are told and end
  port_health_service_.Shutdown();
  engine_.Shutdown();
  gradsync_service_.EndSessions();
  store_->Shutdown();
  store_service_.EndSessions();
}

void DaemonServer::Shutdown(absl::Duration grace) {
  if (!server_) return;
  BeginDrain();
  const absl::Time start = absl::Now();
  // No connection reaches a server going away.
  if (unix_listener_) unix_listener_->Stop();
  if (tcp_listener_) tcp_listener_->Stop();
  server_->Shutdown(absl::ToChronoTime(start + grace));
  server_->Wait();
  if (health_server_) {
    health_server_->Shutdown(absl::ToChronoTime(absl::Now()));
    health_server_->Wait();
    health_server_.reset();
  }
  Log()->debug("grpc shutdown took={}", absl::FormatDuration(absl::Now() - start));
  server_.reset();
  metrics_.reset();
  shm_importer_.set_fd_channel(nullptr);
  fd_channel_.reset();           // closes descriptors never registered and removes <socket>.fd
  nccl_backend_.StopWatchdog();  // before the peer stores it may report to go
  struct stat st {};
  if (unix_listener_ && ::stat(config_.unix_socket.c_str(), &st) == 0 &&
      st.st_ino == unix_listener_->inode()) {
    ::unlink(config_.unix_socket.c_str());
  }
  Log()->info("stopped");
}

absl::StatusOr<gradsync::Store*> DaemonServer::PeerStore(const std::string& address) {
  // On etcd every daemon of a job reaches the job's keys itself: there is no root to ask.
  if (config_.store_backend == "etcd") return store_.get();
  if (address.empty()) {
    return absl::FailedPreconditionError(
        "the embedded store of a job spanning nodes is its root daemon's: name it");
  }
  absl::MutexLock lock(&peers_mu_);
  if (address == node_address_) return store_.get();
  auto& peer = peer_stores_[address];
  if (!peer) {
    const net::ClientOptions options = PeerOptions();
    peer = std::make_unique<net::StoreClient>(net::Connect(address, options), options);
  }
  return peer.get();
}

net::ClientOptions DaemonServer::PeerOptions() const {
  net::ClientOptions options;
  options.token = config_.cluster_token;
  options.tls = config_.tls;  // the peer is verified against our CA and sees our certificate
  return options;
}

std::shared_ptr<grpc::Channel> DaemonServer::PeerChannel(const std::string& address) {
  absl::MutexLock lock(&peers_mu_);
  std::shared_ptr<grpc::Channel>& channel = peer_channels_[address];
  if (!channel) channel = net::Connect(address, PeerOptions());
  return channel;
}

std::string DaemonServer::Endpoints() const {
  std::string out;
  if (!config_.unix_socket.empty()) absl::StrAppend(&out, "unix=", config_.unix_socket);
  if (config_.port >= 0) {
    absl::StrAppend(&out, out.empty() ? "" : " ", "tcp=", config_.bind_address, ":",
                    tcp_port_ > 0 ? tcp_port_ : config_.port);
    if (!config_.advertise_address.empty()) {
      absl::StrAppend(&out, " advertised=", config_.advertise_address);
    }
  }
  return out;
}

}  // namespace gradsync::daemon
