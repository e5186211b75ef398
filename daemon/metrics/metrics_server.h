#pragma once

// The daemon's Prometheus endpoint: the gradsync_* metrics, read from counters, engine and store
// only when scraped, served as text on /metrics.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/core/engine.h"
#include "daemon/core/op_counters.h"
#include "daemon/store/job_store.h"
#include "prometheus/metric_family.h"

namespace prometheus {
class Exposer;
}

namespace gradsync::metrics {

/// What the metrics are read from at scrape time. Everything must outlive the MetricsServer.
struct MetricSources {
  const core::OpCounters* counters = nullptr;
  const core::Engine* engine = nullptr;
  const store::JobStore* store = nullptr;
  const core::PeerWatch* peer_watch = nullptr;
  /// The daemon's MPS state at start ("on", "off", "unavailable"; daemon/gpu/mps.h); empty: no
  /// gradsync_mps_active.
  std::string mps;
};

/// Every gradsync_* family as of now: the counters' values, and gauges read from the engine.
std::vector<prometheus::MetricFamily> CollectMetrics(const MetricSources& sources);

/// Serves CollectMetrics as Prometheus text on http://address:port/metrics (prometheus-cpp's
/// civetweb server, its own threads). Nothing is computed between scrapes: the hot path only
/// bumps OpCounters' atomics.
class MetricsServer {
 public:
  /// UNAVAILABLE when the port cannot be bound. `port` 0 takes a free one (see port()).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& address, int port,
                                                              MetricSources sources);
  ~MetricsServer();  // stops serving; no scrape runs after it returns

  int port() const { return port_; }

 private:
  MetricsServer() = default;
  std::shared_ptr<class SourcesCollectable> collectable_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = -1;
};

}  // namespace gradsync::metrics
