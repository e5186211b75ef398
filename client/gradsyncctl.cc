// gradsyncctl: operator CLI for a gradsyncd (health, store, pack lists), human-readable output.

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "client/store_client.h"
#include "common/dtype.h"
#include "common/elastic_records.h"
#include "common/grpc_status.h"
#include "common/man_page.h"
#include "common/tls.h"
#include "common/token.h"
#include "gradsync/v1/inspect.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

ABSL_FLAG(std::string, socket, "/run/gradsync/gradsyncd.sock", "Unix socket of the local daemon");
ABSL_FLAG(std::string, address, "", "host:port of a daemon's TCP listener (instead of --socket)");
ABSL_FLAG(std::string, job, "default", "Job namespace");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(5), "Deadline of each call");
ABSL_FLAG(std::string, token_file, "",
          "File with the cluster token (needed with --address when the daemon has one)");
ABSL_FLAG(std::string, tls_cert, "",
          "With --address: PEM client certificate for a daemon started with --tls_* (with "
          "--tls_key and --tls_ca: all three or none)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert (mode 600/640)");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA the daemon's certificate must chain to");
ABSL_FLAG(bool, print_man, false, "Print this tool's manual page (roff) and exit");

namespace gradsync::ctl {
namespace {

// The commands, as usage and the manual page show them.
struct CommandDoc {
  const char* usage;
  const char* help;
};
constexpr CommandDoc kCommands[] = {
    {"health [SERVICE]",
     "overall or per-service health (overall: and whether the daemon's GPU kernels can overlap "
     "the trainers', MPS)"},
    {"jobs", "jobs held by the daemon's store"},
    {"sessions [JOB]", "trainer sessions (of every job, or of JOB)"},
    {"ops [JOB]", "pending ops of JOB (default --job) on every node: who is missing"},
    {"history JOB [GROUP]", "this node's last ops of GROUP (default world)"},
    {"epochs [JOB]", "memberships of elastic jobs formed here, and each change"},
    {"store get KEY", "value of KEY (waits up to --timeout)"},
    {"store set KEY VALUE", "sets KEY"},
    {"store add KEY DELTA", "atomic counter"},
    {"store delete KEY", "deletes KEY"},
    {"store list [PREFIX]", "keys with their value sizes"},
    {"packlist groups", "groups with a pack list"},
    {"packlist show GROUP", "the group's pack plan as a table"},
};

std::string UsageText() {
  std::string out = "gradsyncctl [flags] COMMAND";
  for (const CommandDoc& c : kCommands) {
    absl::StrAppend(&out, "\n  ", absl::StrFormat("%-26s", c.usage), "  ", c.help);
  }
  return out;
}

// gradsyncctl(1), from the commands above and this file's flags.
std::string ManualPage() {
  ManPage page;
  page.name = "gradsyncctl";
  page.section = 1;
  page.summary = "look into and operate a gradsyncd";
  page.synopsis = "gradsyncctl [--flag=value ...] COMMAND [ARGS]";
  page.description =
      "Asks the gradsyncd of this node (its unix socket) or of another node (--address, with "
      "the cluster token) about its health, jobs, trainer sessions and pending ops, and reads "
      "or writes a job's store. Output is for people; exit status 0 on success, 1 when the "
      "daemon refuses or cannot be reached, 2 on bad usage.";
  ManPage::Section commands, flags;
  commands.title = "Commands";
  flags.title = "Flags";
  for (const CommandDoc& c : kCommands) commands.commands.push_back({c.usage, c.help});
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::EndsWith(flag->Filename(), "client/gradsyncctl.cc")) {
      flags.options.push_back({std::string(name), flag->DefaultValue(), flag->Help()});
    }
  }
  std::sort(flags.options.begin(), flags.options.end(),
            [](const ManPage::Option& x, const ManPage::Option& y) { return x.name < y.name; });
  page.options = {std::move(commands), std::move(flags)};
  page.extra = {{"See also", "gradsyncd(8)."}};
  return RenderManPage(page);
}

std::string HumanBytes(int64_t bytes) {
  if (bytes >= (int64_t{1} << 20)) return absl::StrFormat("%.1f MiB", bytes / 1048576.0);
  if (bytes >= 1024) return absl::StrFormat("%.1f KiB", bytes / 1024.0);
  return absl::StrCat(bytes, " B");
}

int Fail(const absl::Status& s) {
  std::cerr << "gradsyncctl: " << absl::StatusCodeToString(s.code()) << ": " << s.message() << "\n";
  return 1;
}

int Usage(const std::string& why) {
  std::cerr << "gradsyncctl: " << why << "\n" << UsageText() << "\n";
  return 2;
}

class Ctl {
 public:
  explicit Ctl(client::ClientOptions options)
      : target_(absl::GetFlag(FLAGS_address).empty() ? absl::GetFlag(FLAGS_socket)
                                                     : absl::GetFlag(FLAGS_address)),
        job_(absl::GetFlag(FLAGS_job)),
        timeout_(absl::GetFlag(FLAGS_timeout)),
        options_(std::move(options)),
        channel_(client::Connect(target_, options_)),
        inspect_(v1::Inspect::NewStub(channel_)),
        store_(channel_, options_) {}

  int Run(const std::vector<std::string>& args) {
    if (args.empty()) return Usage("no command");
    const std::string& cmd = args[0];
    const auto arg = [&](size_t i) { return i < args.size() ? args[i] : std::string(); };
    if (cmd == "health") return Health(arg(1));
    if (cmd == "jobs" && args.size() == 1) return Jobs();
    if (cmd == "sessions" && args.size() <= 2) return Sessions(arg(1));
    if (cmd == "ops" && args.size() <= 2) return Ops(args.size() == 2 ? args[1] : job_);
    if (cmd == "history" && (args.size() == 2 || args.size() == 3)) return History(args[1], arg(2));
    if (cmd == "epochs" && args.size() <= 2) return Epochs(arg(1));
    if (cmd == "store" && args.size() >= 2) {
      const std::string& sub = args[1];
      if (sub == "get" && args.size() == 3) return StoreGet(args[2]);
      if (sub == "set" && args.size() == 4) return Check(store_.Set(job_, args[2], args[3]));
      if (sub == "add" && args.size() == 4) return StoreAdd(args[2], args[3]);
      if (sub == "delete" && args.size() == 3) return StoreDelete(args[2]);
      if (sub == "list" && args.size() <= 3) return StoreList(arg(2));
    }
    if (cmd == "packlist" && args.size() == 2 && args[1] == "groups") return PackGroups();
    if (cmd == "packlist" && args.size() == 3 && args[1] == "show") return PackShow(args[2]);
    return Usage(absl::StrCat("bad command: ", absl::StrJoin(args, " ")));
  }

 private:
  void Prepare(grpc::ClientContext& ctx) const {
    client::Authorize(ctx, options_);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
  }
  static int Check(const absl::Status& s) { return s.ok() ? 0 : Fail(s); }

  // One Inspect call with the --timeout deadline.
  template <typename Request, typename Response>
  absl::Status CallInspect(grpc::Status (v1::Inspect::Stub::*method)(grpc::ClientContext*,
                                                                     const Request&, Response*),
                           const Request& req, Response* resp) {
    grpc::ClientContext ctx;
    Prepare(ctx);
    return FromGrpcStatus((inspect_.get()->*method)(&ctx, req, resp));
  }

  int Health(const std::string& service) {
    auto stub = grpc::health::v1::Health::NewStub(channel_);
    grpc::ClientContext ctx;
    Prepare(ctx);
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    if (absl::Status s = FromGrpcStatus(stub->Check(&ctx, req, &resp)); !s.ok()) return Fail(s);
    std::cout << (service.empty() ? "gradsyncd" : service) << " " << target_ << ": "
              << grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status()) << "\n";
    if (service.empty()) PrintMps();
    return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
  }

  // The daemon's MPS line and its warnings (ListSessions carries them); nothing when the daemon
  // does not say (an older daemon) or the call fails: health's answer stands on its own.
  void PrintMps() {
    v1::ListSessionsResponse resp;
    if (!CallInspect(&v1::Inspect::Stub::ListSessions, v1::ListSessionsRequest(), &resp).ok()) {
      return;
    }
    if (!resp.mps().empty()) {
      std::cout << "gpu: mps=" << resp.mps() << " reason=" << resp.mps_reason() << "\n";
    }
    for (const std::string& w : resp.warnings()) std::cout << "warning: " << w << "\n";
  }

  int Jobs() {
    v1::ListJobsResponse resp;
    if (absl::Status s = CallInspect(&v1::Inspect::Stub::ListJobs, v1::ListJobsRequest(), &resp);
        !s.ok())
      return Fail(s);
    std::cout << absl::StrFormat("%-32s %8s %12s\n", "JOB", "KEYS", "BYTES");
    for (const auto& j : resp.jobs()) {
      std::cout << absl::StrFormat("%-32s %8d %12s\n", j.job(), j.keys(),
                                   HumanBytes(j.value_bytes()));
    }
    return 0;
  }

  int Sessions(const std::string& job) {
    v1::ListSessionsRequest req;
    req.set_job(job);
    v1::ListSessionsResponse resp;
    if (absl::Status s = CallInspect(&v1::Inspect::Stub::ListSessions, req, &resp); !s.ok()) {
      return Fail(s);
    }
    std::cout << absl::StrFormat("%-24s %-16s %5s %5s %5s %7s %12s\n", "SESSION", "JOB", "RANK",
                                 "LOCAL", "WORLD", "BUFFERS", "MAPPED");
    for (const auto& s : resp.sessions()) {
      std::cout << absl::StrFormat("%-24s %-16s %5d %5d %5d %7d %12s\n", s.session_id(), s.job(),
                                   s.rank(), s.local_rank(), s.world_size(), s.buffers(),
                                   HumanBytes(s.mapped_bytes()));
    }
    return 0;
  }

  static std::string WaitName(v1::WaitingFor w) {
    switch (w) {
      case v1::TRAINER:
        return "trainer";
      case v1::EARLIER_OP:
        return "earlier op";
      case v1::LOCAL_COPY:
        return "running";
      case v1::NETWORK:
        return "network";
      case v1::NCCL:
        return "nccl";
      case v1::NODE_UNREACHABLE:
        return "node unreachable";
      default:
        return "?";
    }
  }

  int Ops(const std::string& job) {
    v1::ListOpsRequest req;
    req.set_job(job);
    v1::ListOpsResponse resp;
    if (absl::Status s = CallInspect(&v1::Inspect::Stub::ListOps, req, &resp); !s.ok()) {
      return Fail(s);
    }
    std::cout << absl::StrFormat("%-12s %6s %-6s %8s  %-40s %-12s %s\n", "GROUP", "SEQ", "PLANE",
                                 "AGE", "OP", "ARRIVED", "MISSING (node: waiting for)");
    for (const v1::PendingOp& op : resp.ops()) {
      std::vector<std::string> missing;
      for (const v1::MissingRank& m : op.missing_ranks()) {
        missing.push_back(absl::StrCat(m.rank(), m.node().empty() ? "" : " @" + m.node(), ": ",
                                       WaitName(m.waiting_for())));
      }
      std::vector<std::string> nodes;
      for (const v1::NodeOpState& n : op.nodes()) {
        nodes.push_back(
            absl::StrCat(n.node().empty() ? "local" : n.node(), " ", WaitName(n.waiting_for())));
      }
      std::cout << absl::StrFormat("%-12s %6d %-6s %7.1fs  %-40s %-12s %s\n", op.group(), op.seq(),
                                   op.plane(), op.age_seconds(), op.fingerprint(),
                                   absl::StrJoin(op.arrived_ranks(), ","),
                                   missing.empty() ? "-" : absl::StrJoin(missing, "; "));
      std::cout << absl::StrFormat("%-12s %6s   nodes: %s\n", "", "", absl::StrJoin(nodes, "; "));
    }
    for (const v1::NodeAnswer& n : resp.nodes()) {
      if (!n.answered()) {
        std::cout << "node " << n.node() << " (ranks " << absl::StrJoin(n.ranks(), ",")
                  << ") did not answer: " << n.error() << "\n";
      }
    }
    if (resp.ops().empty()) std::cout << "(no pending ops)\n";
    if (!resp.peers().empty()) {  // the liveness of the job's other daemons, as this one sees it
      std::cout << absl::StrFormat("%-24s %-10s %10s  %s\n", "PEER", "STATE", "LAST HEARD",
                                   "CAUSE");
      for (const v1::PeerLiveness& p : resp.peers()) {
        std::cout << absl::StrFormat("%-24s %-10s %10s  %s\n", p.node(), p.state(),
                                     p.last_heard_seconds() < 0
                                         ? "never"
                                         : absl::StrFormat("%.1fs ago", p.last_heard_seconds()),
                                     p.cause().empty() ? "-" : p.cause());
      }
    }
    return 0;
  }

  int History(const std::string& job, const std::string& group) {
    v1::GetHistoryRequest req;
    req.set_job(job);
    req.set_group(group);
    v1::GetHistoryResponse resp;
    if (absl::Status s = CallInspect(&v1::Inspect::Stub::GetHistory, req, &resp); !s.ok()) {
      return Fail(s);
    }
    std::cout << absl::StrFormat("%6s %-26s %-6s %10s %10s %10s  %-18s %s\n", "SEQ", "QUEUED",
                                 "PLANE", "BYTES", "WAIT", "RUN", "OUTCOME", "OP");
    const auto ms = [](int64_t from, int64_t to) {
      return from == 0 || to == 0 ? std::string("-") : absl::StrFormat("%.3fms", (to - from) / 1e3);
    };
    for (const v1::HistoryEntry& e : resp.ops()) {
      const std::string queued = absl::FormatTime(
          "%Y-%m-%d %H:%M:%E3S", absl::FromUnixMicros(e.queued_unix_us()), absl::LocalTimeZone());
      std::cout << absl::StrFormat("%6d %-26s %-6s %10s %10s %10s  %-18s %s%s\n", e.seq(), queued,
                                   e.plane(), HumanBytes(e.bytes()),
                                   ms(e.queued_unix_us(), e.started_unix_us()),
                                   ms(e.started_unix_us(), e.finished_unix_us()), e.outcome(),
                                   e.fingerprint(), e.error().empty() ? "" : "  " + e.error());
    }
    if (resp.dropped() > 0) std::cout << "(" << resp.dropped() << " older ops not kept)\n";
    return 0;
  }

  int Epochs(const std::string& job) {
    v1::ListEpochsRequest req;
    req.set_job(job);
    v1::ListEpochsResponse resp;
    if (absl::Status s = CallInspect(&v1::Inspect::Stub::ListEpochs, req, &resp); !s.ok()) {
      return Fail(s);
    }
    std::cout << absl::StrFormat("%-24s %5s %5s %-23s %8s  %s\n", "JOB", "EPOCH", "WORLD", "FORMED",
                                 "TOOK", "CHANGE");
    for (const v1::Epoch& e : resp.epochs()) {
      const std::string formed = absl::FormatTime(
          "%Y-%m-%d %H:%M:%E3S", absl::FromUnixMicros(e.formed_unix_us()), absl::LocalTimeZone());
      std::cout << absl::StrFormat(
          "%-24s %5d %5d %-23s %8s  %s\n", e.job(), e.epoch(), e.world_size(), formed,
          e.took_seconds() > 0 ? absl::StrFormat("%.2fs", e.took_seconds()) : std::string("-"),
          e.change().empty() ? std::string("(first)") : e.change());
    }
    return 0;
  }

  int StoreGet(const std::string& key) {
    auto value = store_.Get(job_, key, absl::Now() + timeout_);
    if (!value.ok()) return Fail(value.status());
    // A record of the elastic protocol, as JSON (the daemons write it as a protobuf message).
    if (std::optional<std::string> kind = ElasticRecordKind(key)) {
      absl::StatusOr<std::string> json = ElasticRecordJson(*kind, *value);
      if (!json.ok()) return Fail(json.status());
      std::cout << *json << "\n";
      return 0;
    }
    std::cout << *value << "\n";
    return 0;
  }

  int StoreAdd(const std::string& key, const std::string& delta_text) {
    int64_t delta = 0;
    if (!absl::SimpleAtoi(delta_text, &delta)) return Usage("DELTA must be an integer");
    auto value = store_.Add(job_, key, delta);
    if (!value.ok()) return Fail(value.status());
    std::cout << *value << "\n";
    return 0;
  }

  int StoreDelete(const std::string& key) {
    auto deleted = store_.Delete(job_, key);
    if (!deleted.ok()) return Fail(deleted.status());
    std::cout << (*deleted ? "deleted" : "not present") << "\n";
    return 0;
  }

  int StoreList(const std::string& prefix) {
    v1::ListKeysRequest req;
    req.set_job(job_);
    req.set_prefix(prefix);
    v1::ListKeysResponse resp;
    if (absl::Status s = CallInspect(&v1::Inspect::Stub::ListKeys, req, &resp); !s.ok())
      return Fail(s);
    std::cout << absl::StrFormat("%-48s %12s\n", "KEY", "BYTES");
    for (const auto& k : resp.keys()) {
      std::cout << absl::StrFormat("%-48s %12d\n", k.key(), k.value_bytes());
    }
    return 0;
  }

  int PackGroups() {
    v1::ListGroupsRequest req;
    req.set_job(job_);
    v1::ListGroupsResponse resp;
    if (absl::Status s = CallInspect(&v1::Inspect::Stub::ListGroups, req, &resp); !s.ok())
      return Fail(s);
    for (const std::string& g : resp.groups()) std::cout << g << "\n";
    return 0;
  }

  int PackShow(const std::string& group) {
    v1::InspectPackListRequest req;
    req.set_job(job_);
    req.set_group(group);
    v1::InspectPackListResponse resp;
    if (absl::Status s = CallInspect(&v1::Inspect::Stub::GetPackList, req, &resp); !s.ok())
      return Fail(s);
    const v1::PackList& plan = resp.pack_list();
    int params = 0;
    for (const auto& p : plan.packs()) params += p.indices_size();
    std::cout << absl::StrFormat(
        "job=%s group=%s packs=%d params=%d bytes=%s threshold=%s first_alone=%d\n", resp.job(),
        resp.group(), plan.packs_size(), params, HumanBytes(resp.total_bytes()),
        HumanBytes(plan.threshold_bytes()), plan.first_alone());
    std::cout << absl::StrFormat("%-5s %-9s %7s %11s  %s\n", "PACK", "DTYPE", "PARAMS", "BYTES",
                                 "INDICES (backward order)");
    for (int i = 0; i < plan.packs_size(); ++i) {
      const v1::Pack& p = plan.packs(i);
      std::cout << absl::StrFormat("%-5d %-9s %7d %11s  %s\n", i, DTypeName(p.dtype()),
                                   p.indices_size(), HumanBytes(p.bytes()),
                                   absl::StrJoin(p.indices(), ","));
    }
    return 0;
  }

  const std::string target_;
  const std::string job_;
  const absl::Duration timeout_;
  const client::ClientOptions options_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<v1::Inspect::Stub> inspect_;
  client::StoreClient store_;
};

}  // namespace
}  // namespace gradsync::ctl

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(gradsync::ctl::UsageText());
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_print_man)) {
    std::cout << gradsync::ctl::ManualPage();
    return 0;
  }
  std::vector<std::string> args(positional.begin() + 1, positional.end());
  gradsync::client::ClientOptions options;
  options.rpc_timeout = absl::GetFlag(FLAGS_timeout);
  if (const std::string path = absl::GetFlag(FLAGS_token_file); !path.empty()) {
    auto token = gradsync::ReadTokenFile(path);
    if (!token.ok()) {
      std::cerr << "gradsyncctl: " << token.status().message() << "\n";
      return 2;
    }
    options.token = *std::move(token);
  }
  auto tls = gradsync::ReadTlsFiles(
      {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key), absl::GetFlag(FLAGS_tls_ca)});
  if (!tls.ok()) {
    std::cerr << "gradsyncctl: " << tls.status().message() << "\n";
    return 2;
  }
  options.tls = *std::move(tls);
  return gradsync::ctl::Ctl(std::move(options)).Run(args);
}
