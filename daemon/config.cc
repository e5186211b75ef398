// Implementation of config.h: gradsyncd's command-line flags, reading them into a
// DaemonConfig, and validating it.

#include "daemon/config.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/doorbell.h"
#include "common/token.h"

ABSL_FLAG(std::string, socket, "/run/gradsync/gradsyncd.sock",
          "Unix socket for trainers and local tools; empty disables it");
ABSL_FLAG(std::string, socket_mode, "0660", "Octal file mode of the unix socket");
ABSL_FLAG(int, max_local_connections, 4096,
          "Most connections to the unix socket at once; more are closed as they come");
ABSL_FLAG(int, max_tcp_connections, 1024,
          "Most connections to the TCP port at once, authenticated or not; more are closed as "
          "they come");
ABSL_FLAG(int, max_tcp_connections_per_source, 64,
          "Most connections to the TCP port one remote address may hold at once");
ABSL_FLAG(absl::Duration, tcp_first_call_deadline, absl::Seconds(10),
          "A TCP connection that has made no call with the token or the client credential this "
          "long after it was accepted is cut (health and reflection calls do not count)");
ABSL_FLAG(int, max_local_connections_per_user, 512,
          "Most connections to the unix socket one user (uid) may hold at once; root and the "
          "daemon's own user count only against --max_local_connections");
ABSL_FLAG(std::string, bind_address, "127.0.0.1",
          "Address of the TCP listener for other daemons; 0.0.0.0 only when you mean it");
ABSL_FLAG(std::string, advertise_address, "",
          "Host other daemons reach this one at: its node address in a job, and where its data "
          "links listen; empty: --bind_address (required when that is a wildcard)");
ABSL_FLAG(int, port, -1,
          "TCP port for other daemons (7451 is customary; needs --token_file); 0 picks a free "
          "port, -1 disables TCP");
ABSL_FLAG(int, max_message_bytes, 16 << 20, "Largest gRPC message accepted or sent");
ABSL_FLAG(int, max_concurrent_streams, 256, "HTTP/2 concurrent streams per connection");
ABSL_FLAG(absl::Duration, max_wait, absl::Hours(1),
          "Longest any call may wait (store Get/Wait/GetPackList); longer deadlines are capped");
ABSL_FLAG(absl::Duration, drain_grace, absl::Seconds(10),
          "On SIGTERM/SIGINT, how long in-flight calls may finish before they are cancelled");
ABSL_FLAG(std::string, store, "embedded",
          "Where jobs' rendezvous stores live: embedded (the daemon of each job's root node holds "
          "the job's keys; nothing else to run) or etcd (every daemon of a job uses the etcd "
          "cluster of --etcd_endpoints directly: no root daemon, and the store outlives any node)");
ABSL_FLAG(std::string, etcd_endpoints, "",
          "With --store=etcd: the cluster's client endpoints, host:port,... (any members; calls "
          "move to the next one when a member cannot be reached)");
ABSL_FLAG(std::string, etcd_prefix, "/gradsync/",
          "With --store=etcd: every key gradsync writes lives under it; the same on every daemon "
          "of a job");
ABSL_FLAG(std::string, etcd_ca, "",
          "PEM CA certificate(s) etcd's members' certificates must chain to: TLS to etcd (empty: "
          "plaintext, unless --etcd_cert is set, then the system's CAs)");
ABSL_FLAG(std::string, etcd_cert, "",
          "PEM certificate this daemon presents to etcd (etcd's --client-cert-auth); with "
          "--etcd_key");
ABSL_FLAG(std::string, etcd_key, "", "PEM private key of --etcd_cert (mode 600/640)");
ABSL_FLAG(std::string, etcd_user, "",
          "etcd user to authenticate as (etcd's own authentication); with --etcd_password_file");
ABSL_FLAG(std::string, etcd_password_file, "",
          "File holding the password of --etcd_user on its first line (mode 600/640)");
ABSL_FLAG(absl::Duration, etcd_lease_ttl, absl::Seconds(10),
          "A job's keys in etcd outlive the last of its daemons (killed, or cut off from etcd) by "
          "at most this; the daemons renew the job's lease every third of it");
ABSL_FLAG(absl::Duration, etcd_timeout, absl::Seconds(5),
          "Longest one store call to etcd may take, retries on other members included; a pending "
          "store wait fails UNAVAILABLE once no member has answered for this long");
ABSL_FLAG(int, etcd_call_threads, 16,
          "With --store=etcd: threads that run the Store service's calls (trainers' and tools' "
          "store calls, each an etcd round trip), so that no gRPC thread waits on etcd; calls "
          "past them queue");
ABSL_FLAG(int64_t, store_max_key_bytes, 512, "Longest store key");
ABSL_FLAG(int64_t, store_max_value_bytes, int64_t{1} << 20, "Largest store value");
ABSL_FLAG(int64_t, store_max_keys_per_job, 65536, "Most keys one job may hold");
ABSL_FLAG(int64_t, store_max_jobs, 1024, "Most jobs the store holds at once");
ABSL_FLAG(int64_t, store_max_waiters, 65536, "Most store waits pending at once");
ABSL_FLAG(int64_t, store_max_job_bytes, int64_t{64} << 20,
          "Most bytes of keys and values one job may hold in the embedded store");
ABSL_FLAG(int64_t, store_max_total_bytes, int64_t{256} << 20,
          "Most bytes of keys and values the embedded store holds for all jobs together");
ABSL_FLAG(absl::Duration, store_idle_job_ttl, absl::Hours(1),
          "A job's namespace in the embedded store that no session on this daemon holds and no "
          "call has named for this long is removed");
ABSL_FLAG(absl::Duration, op_timeout, absl::Minutes(5),
          "Deadline of a collective that names none: how long its ranks may take to all arrive");
ABSL_FLAG(absl::Duration, max_op_timeout, absl::Hours(1), "Longest deadline an op may ask for");
ABSL_FLAG(int, workers, 0, "Threads that run large collectives; 0: one per CPU");
ABSL_FLAG(absl::Duration, peer_timeout, absl::Milliseconds(1500),
          "A daemon of a job spanning nodes that sends nothing for this long (frozen, or the "
          "network between is cut) is lost: every op of the job's groups spanning it fails at "
          "once with UNAVAILABLE naming it. Raise it only on networks that drop all traffic for "
          "seconds at a time");
ABSL_FLAG(absl::Duration, peer_heartbeat, absl::Milliseconds(250),
          "How often each daemon of a job spanning nodes tells its ring neighbours it is alive (at "
          "most --peer_timeout / 2)");
ABSL_FLAG(int, peer_watch_ring, 2,
          "Ring neighbours each way whose heartbeats a daemon of a job spanning nodes checks "
          "(and that check its own); a loss one finds is passed to every daemon of the job over "
          "O(log N) links each. 0: every daemon watches every other (a mesh: 2(N-1) heartbeats "
          "each). Every daemon of a job must use the same value");
ABSL_FLAG(int64_t, cpu_inline_max_bytes, gradsync::backend::cpu::CpuTuning{}.inline_max_bytes,
          "Ops across nodes whose result is at most this many bytes travel inside their verdict "
          "records, up and down a binomial tree of the nodes (2 log2 N hops); larger ones run a "
          "ring all-reduce, chain broadcast or ring all-gather after it. The same on every daemon "
          "of a job");
ABSL_FLAG(int64_t, cpu_segment_bytes, gradsync::backend::cpu::CpuTuning{}.segment_bytes,
          "The pipeline unit of the ring, broadcast and all-gather between nodes: one message "
          "each (a multiple of 64, at least 4096). The same on every daemon of a job");
ABSL_FLAG(int64_t, cpu_window_segments, gradsync::backend::cpu::CpuTuning{}.window_segments,
          "Segments a node sends ahead of the ones it received in a ring or all-gather (at "
          "least 1)");
ABSL_FLAG(int64_t, cpu_all_to_all_max_nodes,
          gradsync::backend::cpu::CpuTuning{}.all_to_all_max_nodes,
          "Groups spanning at most this many nodes exchange each op's verdict record all-to-all "
          "(one hop, N-1 records a node); larger ones fold the records up a binomial tree and "
          "pass the decision down (2 log2 N hops, a constant number of records a node). The same "
          "on every daemon of a job");
ABSL_FLAG(int64_t, cpu_max_stage_ops, gradsync::backend::cpu::CpuTuning{}.max_stage_ops,
          "Most queued ops of a group whose records are in flight between nodes at once");
ABSL_FLAG(int64_t, cpu_stream_message_bytes,
          gradsync::backend::cpu::CpuTuning{}.stream_message_bytes,
          "Largest message of the record streams between nodes; it must hold the record of an "
          "op of --cpu_inline_max_bytes. The same on every daemon of a job");
ABSL_FLAG(int64_t, cpu_stream_flush_bytes, gradsync::backend::cpu::CpuTuning{}.stream_flush_bytes,
          "A record stream message is sent once it holds this many bytes, so that the wire and "
          "the peer start while later records are packed (at most --cpu_stream_message_bytes)");
ABSL_FLAG(absl::Duration, cpu_peer_grace, gradsync::backend::cpu::CpuTuning{}.peer_grace,
          "How long past an op's deadline a node still waits for the other nodes' verdicts and "
          "connections (a node whose op failed at its own deadline answers a moment later)");
ABSL_FLAG(int64_t, cpu_min_bytes_per_part, gradsync::backend::cpu::CpuTuning{}.min_bytes_per_part,
          "A single-node op is split across the worker threads in parts of at least this many "
          "bytes per member");
ABSL_FLAG(absl::Duration, nccl_keep, absl::Minutes(5),
          "How long a finished job's NCCL communicators that lie on this node alone are kept for "
          "a restart of the job (same id and rank layout); another job needing their GPUs "
          "drops them sooner; 0 drops them at once");
ABSL_FLAG(int, history_size, 2000,
          "Finished ops each group remembers for Inspect/GetHistory (0: none)");
ABSL_FLAG(absl::Duration, stall_warn, absl::Seconds(60),
          "One warning per op still waiting this long, naming the ranks and nodes it waits for "
          "(0: off)");
ABSL_FLAG(int, metrics_port, -1,
          "Prometheus metrics over HTTP (/metrics) on this port; -1: off, 0: a free port (logged)");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1", "Address the metrics port binds");
ABSL_FLAG(int, health_port, -1,
          "grpc.health.v1.Health alone, plaintext and unauthenticated, on this TCP port (for "
          "probes that cannot reach the unix socket, such as Kubernetes' gRPC probe); -1: off, 0: "
          "a free port (logged)");
ABSL_FLAG(std::string, health_address, "127.0.0.1",
          "Address the health port binds (a pod's own IP, or 0.0.0.0 for the node's, when the "
          "kubelet probes it)");
ABSL_FLAG(int, max_buffers_per_session, 4096, "Most buffers one trainer session may register");
ABSL_FLAG(int, max_ops_in_flight_per_session, 1024,
          "Most ops one trainer session may have submitted and not yet been answered (at most "
          "1024, the doorbell's completion ring)");
ABSL_FLAG(int, max_sessions, 1024, "Most trainer sessions on the node at once");
ABSL_FLAG(int64_t, max_buffers, 65536, "Most buffers all trainer sessions may register together");
ABSL_FLAG(int64_t, max_mappings, 60000,
          "Most trainer memory regions (buffers, doorbells) mapped at once; keep it below "
          "vm.max_map_count (65530 by default), which the daemon itself needs some of");
ABSL_FLAG(int64_t, max_mapped_bytes, 0,
          "Most bytes of trainer memory mapped at once; 0: the node's physical memory");
ABSL_FLAG(std::string, token_file, "",
          "File holding the cluster token that TCP calls must carry (mode 600/640); required "
          "when TCP listens");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) this daemon presents on TCP, to daemons and tools it serves "
          "and to daemons it calls; it must name --advertise_address (subjectAltName). With "
          "--tls_key and --tls_ca: all three or none");
ABSL_FLAG(std::string, tls_key, "",
          "PEM private key of --tls_cert (mode 600/640, like the token file)");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificate(s) every peer's certificate must chain to: TCP then needs mutual "
          "TLS both ways (the cluster token is still required)");
ABSL_FLAG(std::string, log_level, "info", "trace|debug|info|warn|error|off");
ABSL_FLAG(std::string, log_sink, "auto",
          "stderr|journal|auto (the journal when started by systemd)");
ABSL_FLAG(std::string, print_config, "",
          "flagfile|markdown|man: print the example flagfile, the configuration page or the "
          "manual page, generated from these flag definitions, and exit");

namespace gradsync::daemon {
namespace {

bool IsWildcard(const std::string& address) {
  return address == "0.0.0.0" || address == "::" || address == "[::]";
}

// The whole of a PEM file named by `flag` ("" when no path is set). `secret`: refused when
// "others" may access it, like the token file.
absl::StatusOr<std::string> ReadPemFlag(const std::string& flag, const std::string& path,
                                        bool secret) {
  if (path.empty()) return std::string();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, " is not a regular file"));
  }
  if (secret && (st.st_mode & S_IRWXO) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, "=", path, " is accessible to others; chmod o-rwx it"));
  }
  if (st.st_size > (1 << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, " is larger than 1 MiB"));
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in || text.str().find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, " holds no PEM block"));
  }
  return text.str();
}

}  // namespace

absl::StatusOr<DaemonConfig> ConfigFromFlags() {
  DaemonConfig c;
  c.unix_socket = absl::GetFlag(FLAGS_socket);
  const std::string mode = absl::GetFlag(FLAGS_socket_mode);
  char* end = nullptr;
  const unsigned long parsed = std::strtoul(mode.c_str(), &end, 8);
  if (mode.empty() || *end != '\0' || parsed > 0777) {
    return absl::InvalidArgumentError(
        absl::StrCat("--socket_mode='", mode, "' is not an octal mode"));
  }
  c.socket_mode = static_cast<int>(parsed);
  c.max_local_connections = absl::GetFlag(FLAGS_max_local_connections);
  c.max_local_connections_per_user = absl::GetFlag(FLAGS_max_local_connections_per_user);
  c.max_tcp_connections = absl::GetFlag(FLAGS_max_tcp_connections);
  c.max_tcp_connections_per_source = absl::GetFlag(FLAGS_max_tcp_connections_per_source);
  c.tcp_first_call_deadline = absl::GetFlag(FLAGS_tcp_first_call_deadline);
  if (c.tcp_first_call_deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--tcp_first_call_deadline must be positive");
  }
  if (c.max_local_connections < 1 || c.max_local_connections_per_user < 1 ||
      c.max_tcp_connections < 1 || c.max_tcp_connections_per_source < 1) {
    return absl::InvalidArgumentError(
        "--max_local_connections, --max_local_connections_per_user, --max_tcp_connections and "
        "--max_tcp_connections_per_source must be positive");
  }
  c.bind_address = absl::GetFlag(FLAGS_bind_address);
  c.advertise_address = absl::GetFlag(FLAGS_advertise_address);
  c.port = absl::GetFlag(FLAGS_port);
  c.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  c.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  c.max_wait = absl::GetFlag(FLAGS_max_wait);
  c.drain_grace = absl::GetFlag(FLAGS_drain_grace);
  c.store_backend = absl::GetFlag(FLAGS_store);
  c.etcd.endpoints =
      absl::StrSplit(absl::GetFlag(FLAGS_etcd_endpoints), ',', absl::SkipWhitespace());
  c.etcd.prefix = absl::GetFlag(FLAGS_etcd_prefix);
  c.etcd.lease_ttl = absl::GetFlag(FLAGS_etcd_lease_ttl);
  c.etcd.rpc_timeout = absl::GetFlag(FLAGS_etcd_timeout);
  c.etcd_call_threads = absl::GetFlag(FLAGS_etcd_call_threads);
  for (auto [flag, path, out, secret] :
       {std::make_tuple("--etcd_ca", absl::GetFlag(FLAGS_etcd_ca), &c.etcd.ca_pem, false),
        std::make_tuple("--etcd_cert", absl::GetFlag(FLAGS_etcd_cert), &c.etcd.cert_pem, false),
        std::make_tuple("--etcd_key", absl::GetFlag(FLAGS_etcd_key), &c.etcd.key_pem, true)}) {
    auto pem = ReadPemFlag(flag, path, secret);
    if (!pem.ok()) return pem.status();
    *out = *std::move(pem);
  }
  c.etcd.user = absl::GetFlag(FLAGS_etcd_user);
  if (const std::string path = absl::GetFlag(FLAGS_etcd_password_file); !path.empty()) {
    auto password = ReadTokenFile(path);
    if (!password.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--etcd_password_file: ", password.status().message()));
    }
    c.etcd.password = *std::move(password);
  }
  c.store.max_key_bytes = absl::GetFlag(FLAGS_store_max_key_bytes);
  c.store.max_value_bytes = absl::GetFlag(FLAGS_store_max_value_bytes);
  c.store.max_keys_per_job = absl::GetFlag(FLAGS_store_max_keys_per_job);
  c.store.max_jobs = absl::GetFlag(FLAGS_store_max_jobs);
  c.store.max_waiters = absl::GetFlag(FLAGS_store_max_waiters);
  c.store.max_job_bytes = absl::GetFlag(FLAGS_store_max_job_bytes);
  c.store.max_total_bytes = absl::GetFlag(FLAGS_store_max_total_bytes);
  c.store.idle_job_ttl = absl::GetFlag(FLAGS_store_idle_job_ttl);
  c.engine.default_op_timeout = absl::GetFlag(FLAGS_op_timeout);
  c.engine.max_op_timeout = absl::GetFlag(FLAGS_max_op_timeout);
  c.engine.max_buffers_per_session = absl::GetFlag(FLAGS_max_buffers_per_session);
  c.engine.max_ops_in_flight_per_session = absl::GetFlag(FLAGS_max_ops_in_flight_per_session);
  c.engine.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  c.engine.max_buffers = absl::GetFlag(FLAGS_max_buffers);
  c.mappings.max_mappings = absl::GetFlag(FLAGS_max_mappings);
  c.mappings.max_mapped_bytes = absl::GetFlag(FLAGS_max_mapped_bytes);
  c.workers = absl::GetFlag(FLAGS_workers);
  c.cpu.inline_max_bytes = absl::GetFlag(FLAGS_cpu_inline_max_bytes);
  c.cpu.segment_bytes = absl::GetFlag(FLAGS_cpu_segment_bytes);
  c.cpu.window_segments = absl::GetFlag(FLAGS_cpu_window_segments);
  c.cpu.max_stage_ops = absl::GetFlag(FLAGS_cpu_max_stage_ops);
  c.cpu.all_to_all_max_nodes = absl::GetFlag(FLAGS_cpu_all_to_all_max_nodes);
  c.cpu.stream_message_bytes = absl::GetFlag(FLAGS_cpu_stream_message_bytes);
  c.cpu.stream_flush_bytes = absl::GetFlag(FLAGS_cpu_stream_flush_bytes);
  c.cpu.peer_grace = absl::GetFlag(FLAGS_cpu_peer_grace);
  c.cpu.min_bytes_per_part = absl::GetFlag(FLAGS_cpu_min_bytes_per_part);
  c.peer_timeout = absl::GetFlag(FLAGS_peer_timeout);
  c.peer_heartbeat = absl::GetFlag(FLAGS_peer_heartbeat);
  c.peer_watch_ring = absl::GetFlag(FLAGS_peer_watch_ring);
  c.cpu.await_peer_watch = c.peer_timeout + absl::Milliseconds(500);
  c.nccl_keep = absl::GetFlag(FLAGS_nccl_keep);
  c.engine.history_size = absl::GetFlag(FLAGS_history_size);
  c.engine.stall_warn = absl::GetFlag(FLAGS_stall_warn);
  c.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  c.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  c.health_port = absl::GetFlag(FLAGS_health_port);
  c.health_address = absl::GetFlag(FLAGS_health_address);
  if (const std::string path = absl::GetFlag(FLAGS_token_file); !path.empty()) {
    auto token = ReadTokenFile(path);
    if (!token.ok())
      return absl::InvalidArgumentError(absl::StrCat("--token_file: ", token.status().message()));
    c.cluster_token = *std::move(token);
  }
  auto tls = ReadTlsFiles(
      {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key), absl::GetFlag(FLAGS_tls_ca)});
  if (!tls.ok()) return absl::InvalidArgumentError(tls.status().message());
  c.tls = *std::move(tls);
  c.log_level = absl::GetFlag(FLAGS_log_level);
  c.log_sink = absl::GetFlag(FLAGS_log_sink);
  if (absl::Status s = Validate(c); !s.ok()) return s;
  return c;
}

namespace {
// --store and the etcd flags.
absl::Status ValidateStore(const DaemonConfig& c) {
  if (c.store_backend != "embedded" && c.store_backend != "etcd") {
    return absl::InvalidArgumentError(
        absl::StrCat("--store=", c.store_backend, ": want embedded or etcd"));
  }
  if (c.store_backend == "etcd") {
    if (c.etcd.endpoints.empty()) {
      return absl::InvalidArgumentError("--store=etcd needs --etcd_endpoints (host:port,...)");
    }
    if (c.etcd.prefix.empty()) {
      return absl::InvalidArgumentError("--etcd_prefix must not be empty");
    }
    if (c.etcd.lease_ttl < absl::Seconds(2) || c.etcd.rpc_timeout < absl::Milliseconds(100)) {
      return absl::InvalidArgumentError(
          "--etcd_lease_ttl must be at least 2s and --etcd_timeout at least 100ms");
    }
    if (c.etcd_call_threads < 1 || c.etcd_call_threads > 1024) {
      return absl::InvalidArgumentError("--etcd_call_threads must be in [1, 1024]");
    }
    if (c.etcd.cert_pem.empty() != c.etcd.key_pem.empty()) {
      return absl::InvalidArgumentError("--etcd_cert and --etcd_key go together: both or none");
    }
    if (c.etcd.user.empty() != c.etcd.password.empty()) {
      return absl::InvalidArgumentError(
          "--etcd_user and --etcd_password_file go together: both or none");
    }
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status Validate(const DaemonConfig& c) {
  if (c.unix_socket.empty() && c.port < 0) {
    return absl::InvalidArgumentError("no listener: set --socket or --port");
  }
  if (!c.unix_socket.empty() && c.unix_socket.front() != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("--socket='", c.unix_socket, "' must be an absolute path"));
  }
  if (c.unix_socket.size() >= 100) {
    return absl::InvalidArgumentError(
        "--socket path is longer than a unix socket address allows (107)");
  }
  if (c.port < -1 || c.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--port=", c.port, " is not -1 or a port number"));
  }
  if (c.port >= 0 && c.cluster_token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--port=", c.port,
        " opens TCP, which serves other daemons and needs the cluster token: set --token_file "
        "(or --port=-1 when no job spans nodes)"));
  }
  if (c.port >= 0 && c.bind_address.empty()) {
    return absl::InvalidArgumentError("--bind_address is empty; use --port=-1 to disable TCP");
  }
  if (c.port >= 0 && c.advertise_address.empty() && IsWildcard(c.bind_address)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--bind_address=", c.bind_address,
        " listens on every interface; set --advertise_address to the one other daemons use"));
  }
  if (IsWildcard(c.advertise_address)) {
    // Peers could not dial it, and the data links, which listen on it, would take every interface.
    return absl::InvalidArgumentError(
        absl::StrCat("--advertise_address=", c.advertise_address,
                     " is every interface; set the address other daemons reach this node at"));
  }
  if (c.max_message_bytes < 4096) {
    return absl::InvalidArgumentError("--max_message_bytes must be at least 4096");
  }
  if (c.store.max_value_bytes > c.max_message_bytes - 4096) {
    return absl::InvalidArgumentError(
        "--store_max_value_bytes must leave 4096 bytes of --max_message_bytes for the envelope");
  }
  if (c.max_concurrent_streams < 1) {
    return absl::InvalidArgumentError("--max_concurrent_streams must be positive");
  }
  if (c.max_wait <= absl::ZeroDuration() || c.drain_grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--max_wait must be positive and --drain_grace not negative");
  }
  if (c.peer_heartbeat < absl::Milliseconds(10) || c.peer_timeout < 2 * c.peer_heartbeat) {
    return absl::InvalidArgumentError(
        "--peer_heartbeat must be at least 10ms and --peer_timeout at least twice it");
  }
  if (c.peer_watch_ring < 0 || c.peer_watch_ring > 64) {
    return absl::InvalidArgumentError("--peer_watch_ring must be 0 (a mesh) to 64");
  }
  if (c.nccl_keep < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--nccl_keep must not be negative");
  }
  if (absl::Status s = ValidateStore(c); !s.ok()) return s;
  if (c.store.max_key_bytes < 1 || c.store.max_value_bytes < 0 || c.store.max_keys_per_job < 1 ||
      c.store.max_jobs < 1 || c.store.max_waiters < 1 || c.store.max_job_bytes < 1 ||
      c.store.max_total_bytes < 1 || c.store.idle_job_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("store limits must be positive");
  }
  if (c.engine.default_op_timeout <= absl::ZeroDuration() ||
      c.engine.max_op_timeout < c.engine.default_op_timeout) {
    return absl::InvalidArgumentError(
        "--op_timeout must be positive and no longer than --max_op_timeout");
  }
  if (c.workers < 0 || c.workers > 256 || c.engine.max_buffers_per_session < 1) {
    return absl::InvalidArgumentError(
        "--workers must be in [0, 256] and --max_buffers_per_session positive");
  }
  if (c.engine.max_ops_in_flight_per_session < 1 ||
      c.engine.max_ops_in_flight_per_session > static_cast<int>(doorbell::kCompletionSlots)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_ops_in_flight_per_session must be in [1, ", doorbell::kCompletionSlots,
                     "] (the doorbell's completion ring)"));
  }
  if (c.engine.max_sessions < 1 || c.engine.max_buffers < 1 || c.mappings.max_mappings < 1 ||
      c.mappings.max_mapped_bytes < 0) {
    return absl::InvalidArgumentError(
        "--max_sessions, --max_buffers and --max_mappings must be positive, --max_mapped_bytes "
        "not negative");
  }
  if (c.engine.history_size < 0 || c.engine.history_size > 1000000 ||
      c.engine.stall_warn < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "--history_size must be in [0, 1000000] and --stall_warn not negative");
  }
  if (absl::Status s = backend::cpu::ValidateCpuTuning(c.cpu); !s.ok()) return s;
  if (c.metrics_port < -1 || c.metrics_port > 65535 ||
      (c.metrics_port >= 0 && c.metrics_address.empty())) {
    return absl::InvalidArgumentError(
        "--metrics_port must be -1 (off) or in [0, 65535], with a --metrics_address");
  }
  if (c.health_port < -1 || c.health_port > 65535 ||
      (c.health_port >= 0 && c.health_address.empty())) {
    return absl::InvalidArgumentError(
        "--health_port must be -1 (off) or in [0, 65535], with a --health_address");
  }
  return absl::OkStatus();
}

}  // namespace gradsync::daemon
