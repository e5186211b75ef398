// Implementation of metrics_server.h: builds the gradsync_* metric families from the op
// counters, the engine and the store at scrape time, and serves them through prometheus-cpp.

#include "daemon/metrics/metrics_server.h"

#include <exception>
#include <limits>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"

namespace gradsync::metrics {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

class SourcesCollectable final : public prometheus::Collectable {
 public:
  explicit SourcesCollectable(MetricSources sources) : sources_(sources) {}
  std::vector<MetricFamily> Collect() const override { return CollectMetrics(sources_); }

 private:
  const MetricSources sources_;
};

namespace {

const char* const kPlaneNames[core::OpCounters::kPlanes] = {"host", "device"};

std::string KindLabel(int kind) {
  if (kind == 0) return "unknown";
  return absl::AsciiStrToLower(v1::OpKind_Name(static_cast<v1::OpKind>(kind)));
}

MetricFamily Family(std::string name, std::string help, MetricType type) {
  MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  return f;
}

void AddScalar(std::vector<MetricFamily>& out, std::string name, std::string help, MetricType type,
               double value) {
  MetricFamily f = Family(std::move(name), std::move(help), type);
  ClientMetric m;
  (type == MetricType::Counter ? m.counter.value : m.gauge.value) = value;
  f.metric.push_back(std::move(m));
  out.push_back(std::move(f));
}

// Losses by cause, and what watching costs (links, heartbeats, notices passed on).
void AddPeerWatch(std::vector<MetricFamily>& out, const core::PeerWatch& watch) {
  MetricFamily losses = Family("gradsync_peer_losses_total",
                               "Peer daemons of jobs spanning nodes found lost, by cause "
                               "(silent, closed, reset, unreachable, error; expelled: this node "
                               "was declared lost by its peers)",
                               MetricType::Counter);
  const std::map<std::string, int64_t> counts = watch.LossCounts();
  for (const char* cause : {"silent", "closed", "reset", "unreachable", "error", "expelled"}) {
    prometheus::ClientMetric m;
    m.label.push_back({"cause", cause});
    auto it = counts.find(cause);
    m.counter.value = static_cast<double>(it == counts.end() ? 0 : it->second);
    losses.metric.push_back(std::move(m));
  }
  out.push_back(std::move(losses));
  const core::PeerWatch::Totals t = watch.GetTotals();
  AddScalar(out, "gradsync_peer_watch_links",
            "Liveness links open to peer daemons, over every job (O(log N) per job)",
            MetricType::Gauge, static_cast<double>(t.links));
  AddScalar(out, "gradsync_peer_heartbeats_sent_total",
            "Heartbeats sent to peer daemons (to ring neighbours only: a constant rate per job)",
            MetricType::Counter, static_cast<double>(t.heartbeats_sent));
  AddScalar(out, "gradsync_peer_notices_sent_total",
            "Notices of a peer lost or left passed on to other daemons", MetricType::Counter,
            static_cast<double>(t.notices_sent));
}

}  // namespace

std::vector<MetricFamily> CollectMetrics(const MetricSources& s) {
  using Counters = core::OpCounters;
  std::vector<MetricFamily> out;
  if (const Counters* c = s.counters) {
    MetricFamily ops = Family("gradsync_ops_total",
                              "Ops finished on this node (once per op, not per rank), by kind, "
                              "plane and outcome (OK or the status code)",
                              MetricType::Counter);
    MetricFamily bytes = Family("gradsync_op_bytes_total",
                                "Bytes per member moved by ops that succeeded, by kind and plane",
                                MetricType::Counter);
    for (int k = 0; k < Counters::kKinds; ++k) {
      for (int p = 0; p < Counters::kPlanes; ++p) {
        for (int code = 0; code < Counters::kCodes; ++code) {
          const uint64_t n = c->ops(k, p, code);
          if (n == 0 && code != 0) continue;  // every outcome but OK appears once it happens
          if (n == 0 && k == 0) continue;
          ClientMetric m;
          m.label = {{"kind", KindLabel(k)},
                     {"outcome", absl::StatusCodeToString(static_cast<absl::StatusCode>(code))},
                     {"plane", kPlaneNames[p]}};
          m.counter.value = static_cast<double>(n);
          ops.metric.push_back(std::move(m));
        }
        if (k == 0) continue;
        ClientMetric b;
        b.label = {{"kind", KindLabel(k)}, {"plane", kPlaneNames[p]}};
        b.counter.value = static_cast<double>(c->bytes(k, p));
        bytes.metric.push_back(std::move(b));
      }
    }
    out.push_back(std::move(ops));
    out.push_back(std::move(bytes));
    MetricFamily latency =
        Family("gradsync_op_latency_seconds",
               "Op latency on this node, from the first local submission to the end, by plane",
               MetricType::Histogram);
    for (int p = 0; p < Counters::kPlanes; ++p) {
      ClientMetric m;
      m.label = {{"plane", kPlaneNames[p]}};
      uint64_t cumulative = 0;
      for (size_t b = 0; b <= Counters::kLatencyBounds.size(); ++b) {
        cumulative += c->latency_bucket(p, b);
        m.histogram.bucket.push_back({cumulative, b < Counters::kLatencyBounds.size()
                                                      ? Counters::kLatencyBounds[b]
                                                      : std::numeric_limits<double>::infinity()});
      }
      m.histogram.sample_count = cumulative;
      m.histogram.sample_sum = c->latency_sum_seconds(p);
      latency.metric.push_back(std::move(m));
    }
    out.push_back(std::move(latency));
    AddScalar(out, "gradsync_deadline_expiries_total",
              "Pending ops failed by their deadline on this node", MetricType::Counter,
              static_cast<double>(c->deadline_expiries.load()));
    AddScalar(out, "gradsync_desyncs_total", "Fingerprint mismatches (desyncs) seen on this node",
              MetricType::Counter, static_cast<double>(c->desyncs.load()));
    AddScalar(out, "gradsync_stall_warnings_total", "Ops that waited past --stall_warn",
              MetricType::Counter, static_cast<double>(c->stalls.load()));
    AddScalar(out, "gradsync_nccl_aborts_total", "NCCL communicators aborted on this node",
              MetricType::Counter, static_cast<double>(c->nccl_aborts.load()));
    AddScalar(out, "gradsync_nccl_aborts_hung_total",
              "NCCL aborts still running past their bound (the daemon was NOT_SERVING meanwhile)",
              MetricType::Counter, static_cast<double>(c->nccl_aborts_hung.load()));
    AddScalar(out, "gradsync_nccl_bootstrap_roots_left_total",
              "NCCL bootstrap roots (a thread and a socket each) left by builds that failed here; "
              "past 32 this node makes no more NCCL ids until it restarts",
              MetricType::Counter, static_cast<double>(c->nccl_bootstrap_roots_left.load()));
    AddScalar(out, "gradsync_membership_changes_total",
              "Membership changes of elastic jobs formed on this node (a loss or a join)",
              MetricType::Counter, static_cast<double>(c->membership_changes.load()));
    AddScalar(out, "gradsync_nccl_rebuilds_total", "NCCL communicators built again after an abort",
              MetricType::Counter, static_cast<double>(c->nccl_rebuilds.load()));
    AddScalar(out, "gradsync_nccl_launched_failures_total",
              "GPU ops that failed on the device after they were launched and answered",
              MetricType::Counter, static_cast<double>(c->nccl_launched_failures.load()));
  }
  if (s.engine != nullptr) {
    const core::Engine::Totals t = s.engine->GetTotals();
    AddScalar(out, "gradsync_pending_ops", "Ops not finished on this node (waiting or running)",
              MetricType::Gauge, t.pending_ops);
    AddScalar(out, "gradsync_sessions", "Trainer sessions attached", MetricType::Gauge, t.sessions);
    AddScalar(out, "gradsync_jobs", "Jobs with a session on this node", MetricType::Gauge, t.jobs);
    AddScalar(out, "gradsync_mapped_bytes", "Bytes of trainer buffers mapped by the daemon",
              MetricType::Gauge, static_cast<double>(t.mapped_bytes));
  }
  if (s.peer_watch != nullptr) AddPeerWatch(out, *s.peer_watch);
  if (!s.mps.empty()) {
    MetricFamily mps = Family("gradsync_mps_active",
                              "1 when this daemon's CUDA contexts are MPS clients (its kernels can "
                              "overlap the trainers'); mode: on, off or unavailable (no GPU)",
                              MetricType::Gauge);
    prometheus::ClientMetric m;
    m.label.push_back({"mode", s.mps});
    m.gauge.value = s.mps == "on" ? 1 : 0;
    mps.metric.push_back(std::move(m));
    out.push_back(std::move(mps));
  }
  if (s.store != nullptr) {
    AddScalar(out, "gradsync_store_calls_total",
              "Calls of this daemon's job store (local and from peers)", MetricType::Counter,
              static_cast<double>(s.store->calls()));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& address,
                                                                    int port,
                                                                    MetricSources sources) {
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  const std::string bind = address.find(':') != std::string::npos
                               ? absl::StrCat("[", address, "]:", port)
                               : absl::StrCat(address, ":", port);
  try {
    server->exposer_ = std::make_unique<prometheus::Exposer>(bind, /*num_threads=*/1);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", bind, " (--metrics_port): ", e.what()));
  }
  server->collectable_ = std::make_shared<SourcesCollectable>(sources);
  server->exposer_->RegisterCollectable(server->collectable_);
  const std::vector<int> ports = server->exposer_->GetListeningPorts();
  server->port_ = ports.empty() ? port : ports[0];
  return server;
}

MetricsServer::~MetricsServer() {
  exposer_.reset();  // joins the HTTP threads before the collectable goes
}

}  // namespace gradsync::metrics
