// Implementation of config_doc.h: the sections of the configuration and their rendering.

#include "daemon/config_doc.h"

#include <set>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/man_page.h"

namespace gradsync::daemon {
namespace {

// The file whose flags are gradsyncd's (absl's own, --flagfile and --help, are not listed).
constexpr char kFlagsFile[] = "daemon/config.cc";

struct Section {
  const char* title;
  const char* text;  // when and why to change these
  std::vector<const char*> flags;
};

// Every flag of config.cc is in exactly one section (checked when rendering).
const std::vector<Section>& Sections() {
  static const auto* sections = new std::vector<Section>{
      {"Trainers and local tools",
       "Trainers and gradsyncctl connect to the unix socket. With mode 0660, members of the "
       "gradsync group may connect: add trainer users to it. A caller reaches the jobs its own "
       "user's trainers hold on the node, or that none holds (root and the daemon's user reach "
       "every job); connections past the limits are closed as they come.",
       {"socket", "socket_mode", "max_local_connections", "max_local_connections_per_user"}},
      {"Other daemons (jobs spanning nodes)",
       "Other daemons of a job reach this node's store and inspection over TCP, and so do the "
       "trainers of a job spanning nodes for its root's store (with the client credential "
       "their own daemon hands them); trainer sessions are served on the unix socket only. TCP "
       "is off by default. To turn "
       "it on set --port (7451 is customary) and --token_file, without which the daemon refuses "
       "to start. Set --bind_address to the cluster network's interface (never 0.0.0.0 by "
       "accident); with a wildcard bind, --advertise_address names the address other daemons "
       "dial. The data links between daemons listen on the advertised address, on ephemeral "
       "ports. Connections to the TCP port past the limits (in all, per remote address) are "
       "closed as they come, and one that makes no authenticated call in time is cut.",
       {"bind_address", "advertise_address", "port", "token_file", "max_tcp_connections",
        "max_tcp_connections_per_source", "tcp_first_call_deadline"}},
      {"Mutual TLS",
       "Optional; all three or none. This node's certificate must name the address other "
       "daemons dial (--advertise_address, else --bind_address) in its subjectAltName; the key "
       "file is mode 600/640 and owned by gradsync, like the token file; every daemon's and "
       "tool's certificate must chain to the CA. TCP then takes TLS clients with such a "
       "certificate only, and this daemon's calls to other daemons present its certificate and "
       "verify theirs. The token is still required; the unix socket stays plaintext. The data "
       "links authenticate with per-link keys exchanged through the store and are not "
       "encrypted.",
       {"tls_cert", "tls_key", "tls_ca"}},
      {"gRPC limits",
       "A store reply (Wait, List) that would pass the message limit is refused "
       "RESOURCE_EXHAUSTED naming it.",
       {"max_message_bytes", "max_concurrent_streams"}},
      {"Waits and shutdown",
       "The longest a store wait may last whatever deadline the caller sets, and how long "
       "SIGTERM lets calls in flight finish.",
       {"max_wait", "drain_grace"}},
      {"Rendezvous store backend",
       "Where jobs' rendezvous stores live. embedded (the default) needs nothing else: the "
       "daemon of each job's root node holds the job's keys and the job's other daemons reach "
       "it over TCP, so a job depends on that node. etcd: every daemon of a job reads and "
       "writes the job's keys in an etcd cluster (v3 API; Debian's etcd-server) itself; no "
       "daemon is the job's root (trainers need no root address), and the store outlives any "
       "node, and any one etcd member of three or more. Every daemon of a job must use the "
       "same cluster and --etcd_prefix. A job's keys are tied to an etcd lease its daemons "
       "renew: the last daemon to end the job revokes it, and when all of them die the keys "
       "expire after --etcd_lease_ttl. With etcd unreachable, store calls fail UNAVAILABLE "
       "naming it within --etcd_timeout and the daemon keeps serving its other jobs. TLS to "
       "etcd: --etcd_ca, with --etcd_cert and --etcd_key where etcd checks client "
       "certificates; etcd's users: --etcd_user with --etcd_password_file.",
       {"store", "etcd_endpoints", "etcd_prefix", "etcd_ca", "etcd_cert", "etcd_key", "etcd_user",
        "etcd_password_file", "etcd_lease_ttl", "etcd_timeout", "etcd_call_threads"}},
      {"Rendezvous store limits",
       "The job's store (hosted by the daemon of the job's root node, or in etcd). Raise them "
       "only for jobs that keep many or large keys of their own. On etcd, --store_max_jobs and "
       "--store_max_waiters count this daemon's jobs and waits, --store_max_keys_per_job a "
       "job's keys across all its daemons. The byte quotas and the removal of idle jobs apply "
       "to the embedded store (etcd keeps a job's keys while one of its daemons holds its "
       "lease).",
       {"store_max_key_bytes", "store_max_value_bytes", "store_max_keys_per_job", "store_max_jobs",
        "store_max_waiters", "store_max_job_bytes", "store_max_total_bytes", "store_idle_job_ttl"}},
      {"Collectives",
       "The deadline of an op that names none (how long its ranks may take to all arrive), the "
       "longest one an op may ask for, threads for large ops, the buffers one trainer may "
       "register, and how long a finished job's NCCL communicators are kept for its restart.",
       {"op_timeout", "max_op_timeout", "workers", "max_buffers_per_session", "nccl_keep"}},
      {"Liveness of other daemons",
       "Every daemon of a job spanning nodes sends its --peer_watch_ring neighbours each way "
       "around the job's ring a heartbeat on links of its own, from a thread that does nothing "
       "else: no op, however busy, delays it, and a trainer's pause (a long step, a garbage "
       "collection) does not count, since only daemons send them. A neighbour that sends "
       "nothing for --peer_timeout is suspected, and lost once two of its watchers suspect it "
       "(a link dropping packets delays one watcher's heartbeats, never two); a linked peer "
       "whose connection closes or resets, or one that cannot be reached, is lost at once. The "
       "daemon that decides it tells the others over its O(log N) links and each passes it on "
       "once, so every survivor learns it within a few hops: the job's ops on groups spanning "
       "it fail at once with UNAVAILABLE naming the node, its ranks and the cause. A daemon "
       "declared lost by the others (it was frozen or cut off) counts every peer lost when it "
       "hears so. The default (1.5 s, six heartbeats) leaves a daemon thread five missed "
       "heartbeats of scheduling delay before it counts as frozen.",
       {"peer_timeout", "peer_heartbeat", "peer_watch_ring"}},
      {"CPU data plane tuning",
       "How the host plane moves bytes between nodes and splits large single-node ops across "
       "threads. Change them almost never: they are for benchmarking (the defaults were chosen "
       "by measurement), not for everyday use. Every daemon of a job must use the same "
       "--cpu_inline_max_bytes, --cpu_all_to_all_max_nodes, --cpu_segment_bytes and "
       "--cpu_stream_message_bytes: they shape what travels between nodes, and a mismatch fails "
       "the job's ops that span nodes. The daemon logs all nine values at start.",
       {"cpu_inline_max_bytes", "cpu_all_to_all_max_nodes", "cpu_segment_bytes",
        "cpu_window_segments", "cpu_max_stage_ops", "cpu_stream_message_bytes",
        "cpu_stream_flush_bytes", "cpu_peer_grace", "cpu_min_bytes_per_part"}},
      {"Node-wide limits on trainers",
       "What trainers may hold, so that no trainer can exhaust the node: ops in flight per "
       "session, sessions, buffers, mapped regions (keep below vm.max_map_count, 65530 by "
       "default, which the daemon needs some of) and mapped bytes. Each refuses "
       "RESOURCE_EXHAUSTED naming the flag.",
       {"max_ops_in_flight_per_session", "max_sessions", "max_buffers", "max_mappings",
        "max_mapped_bytes"}},
      {"Logging", "The systemd unit passes --log_sink=journal.", {"log_level", "log_sink"}},
      {"Observability",
       "Each group's last ops for Inspect/GetHistory and gradsyncctl history; one warning per op "
       "waiting longer than --stall_warn, naming who it waits for; Prometheus metrics (off by "
       "default; loopback unless you mean otherwise); the health service alone on a TCP port "
       "for probes that cannot reach the unix socket (off by default; it answers anyone who "
       "reaches it, and says only SERVING or NOT_SERVING).",
       {"history_size", "stall_warn", "metrics_port", "metrics_address", "health_port",
        "health_address"}},
      {"Tools",
       "Not for the flagfile: prints this configuration's documents and exits.",
       {"print_config"}},
  };
  return *sections;
}

struct Flag {
  std::string name;
  std::string help;
  std::string default_value;
};

// The sections' flags, looked up; FailedPrecondition when they and config.cc's flags differ.
absl::StatusOr<std::vector<std::vector<Flag>>> Resolve() {
  std::set<std::string> defined;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::EndsWith(flag->Filename(), kFlagsFile)) defined.insert(std::string(name));
  }
  std::vector<std::vector<Flag>> out;
  std::set<std::string> listed;
  for (const Section& s : Sections()) {
    std::vector<Flag>& flags = out.emplace_back();
    for (const char* name : s.flags) {
      const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
      if (flag == nullptr || defined.count(name) == 0) {
        return absl::FailedPreconditionError(absl::StrCat("configuration section '", s.title,
                                                          "' lists --", name,
                                                          ", which is not a flag of ", kFlagsFile));
      }
      if (!listed.insert(name).second) {
        return absl::FailedPreconditionError(
            absl::StrCat("--", name, " is listed in two configuration sections"));
      }
      flags.push_back({name, flag->Help(), flag->DefaultValue()});
    }
  }
  for (const std::string& name : defined) {
    if (listed.count(name) == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--", name, " (", kFlagsFile, ") is in no configuration section (config_doc.cc)"));
    }
  }
  return out;
}

// `text` wrapped to lines of at most `width` characters, each starting with `prefix`.
std::string Wrap(const std::string& text, const std::string& prefix, size_t width = 100) {
  std::string out;
  std::string line = prefix;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (line.size() > prefix.size() && line.size() + 1 + word.size() > width) {
      absl::StrAppend(&out, line, "\n");
      line = prefix;
    }
    absl::StrAppend(&line, line.size() > prefix.size() ? " " : "", word);
  }
  if (line.size() > prefix.size()) absl::StrAppend(&out, line, "\n");
  return out;
}

// A string flag's default, shown so that an empty one is visible.
std::string Shown(const Flag& f) { return f.default_value.empty() ? "\"\"" : f.default_value; }

}  // namespace

absl::StatusOr<std::string> RenderFlagfile() {
  absl::StatusOr<std::vector<std::vector<Flag>>> flags = Resolve();
  if (!flags.ok()) return flags.status();
  std::string out =
      "# gradsyncd flagfile: one --flag=value per line; '#' starts a comment.\n"
      "# Installed as /etc/gradsync/gradsyncd.flags and read by the systemd unit. Every flag is\n"
      "# shown at its default: uncomment and change what you need. Generated by\n"
      "# `gradsyncd --print_config=flagfile` from the daemon's flag definitions; the same text,\n"
      "# with when to change each flag, is docs/configuration.md.\n";
  const std::vector<Section>& sections = Sections();
  for (size_t i = 0; i < sections.size(); ++i) {
    if (std::string(sections[i].title) == "Tools") continue;
    absl::StrAppend(&out, "\n# --- ", sections[i].title, " ---\n", Wrap(sections[i].text, "# "));
    for (const Flag& f : (*flags)[i]) {
      absl::StrAppend(&out, Wrap(f.help, "#   "), "#--", f.name, "=", f.default_value, "\n");
    }
  }
  return out;
}

absl::StatusOr<std::string> RenderConfigurationPage() {
  absl::StatusOr<std::vector<std::vector<Flag>>> flags = Resolve();
  if (!flags.ok()) return flags.status();
  std::string out =
      "# Configuration\n\n"
      "Every flag of `gradsyncd`, its default and what it is for. The systemd unit reads them\n"
      "from `/etc/gradsync/gradsyncd.flags` (one `--flag=value` per line); on the command line\n"
      "they are `--flag=value`. This page and `deploy/gradsyncd.flags` are generated by\n"
      "`gradsyncd --print_config=markdown|flagfile` from the daemon's own flag definitions, and a\n"
      "test fails when the committed files differ from what the binary prints.\n"
      "Durations are written like `500ms`, `3s`, `5m`, `1h`.\n";
  const std::vector<Section>& sections = Sections();
  for (size_t i = 0; i < sections.size(); ++i) {
    absl::StrAppend(&out, "\n## ", sections[i].title, "\n\n", sections[i].text, "\n\n",
                    "| flag | default | what it is for |\n| --- | --- | --- |\n");
    for (const Flag& f : (*flags)[i]) {
      absl::StrAppend(&out, "| `--", f.name, "` | `", Shown(f), "` | ",
                      absl::StrReplaceAll(f.help, {{"|", "\\|"}}), " |\n");
    }
  }
  return out;
}

absl::StatusOr<std::string> RenderManual() {
  absl::StatusOr<std::vector<std::vector<Flag>>> flags = Resolve();
  if (!flags.ok()) return flags.status();
  ManPage page;
  page.name = "gradsyncd";
  page.section = 8;
  page.summary = "the per-node gradient-synchronisation daemon of gradsync";
  page.synopsis =
      "gradsyncd [--flag=value ...]\ngradsyncd --flagfile=/etc/gradsync/gradsyncd.flags";
  page.description =
      "One gradsyncd runs on every node of a training cluster. Trainers on the node hand it "
      "their gradient buffers (shared memory on CPUs, CUDA IPC on GPUs) over its unix socket "
      "and get them back reduced; it owns the node's communicators, the collectives between "
      "nodes, and each job's rendezvous store.\n\n"
      "Flags are --flag=value; the systemd unit reads them from /etc/gradsync/gradsyncd.flags, "
      "one per line. Durations are written like 500ms, 3s, 5m, 1h. SIGTERM drains: new work is "
      "refused, trainers are told, and the daemon exits 0 within --drain_grace.";
  const std::vector<Section>& sections = Sections();
  for (size_t i = 0; i < sections.size(); ++i) {
    ManPage::Section& out = page.options.emplace_back();
    out.title = sections[i].title;
    out.text = sections[i].text;
    for (const Flag& f : (*flags)[i]) out.options.push_back({f.name, f.default_value, f.help});
  }
  page.extra = {
      {"Files",
       "/etc/gradsync/gradsyncd.flags: the flags the systemd unit passes.\n"
       "/etc/gradsync/cluster.token: the cluster token (mode 600 or 640, owned by gradsync), when "
       "TCP listens.\n"
       "/run/gradsync/gradsyncd.sock: the unix socket trainers and gradsyncctl connect to."},
      {"Exit status",
       "0 after a drain; 1 when the daemon cannot start (the log says why); 2 on "
       "a bad flag."},
      {"See also",
       "gradsyncctl(1); the configuration reference, docs/configuration.md, has the "
       "same text."},
  };
  return RenderManPage(page);
}

}  // namespace gradsync::daemon
