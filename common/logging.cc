// Implementation of logging.h: the sinks (stderr or journal), the escaping sink around them,
// and the per-component loggers.

#include "common/logging.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/sinks/systemd_sink.h"

namespace gradsync::logging {
namespace {

struct State {
  absl::Mutex mu;
  std::vector<spdlog::sink_ptr> sinks ABSL_GUARDED_BY(mu);
  spdlog::level::level_enum level ABSL_GUARDED_BY(mu) = spdlog::level::info;
};

State& GetState() {
  static State* state = new State;  // never destroyed: loggers may log during exit
  return *state;
}

bool StartedBySystemd() {
  // systemd sets JOURNAL_STREAM when stdout/stderr go to the journal, INVOCATION_ID for units.
  return std::getenv("JOURNAL_STREAM") != nullptr || std::getenv("INVOCATION_ID") != nullptr;
}

// Writes through `inner` with the message escaped (EscapeForLog): what every logger's sinks are.
class EscapingSink final : public spdlog::sinks::sink {
 public:
  explicit EscapingSink(spdlog::sink_ptr inner) : inner_(std::move(inner)) {}
  void log(const spdlog::details::log_msg& msg) override {
    const absl::string_view payload(msg.payload.data(), msg.payload.size());
    if (!NeedsEscape(payload)) {
      inner_->log(msg);
      return;
    }
    const std::string escaped = EscapeForLog(payload);
    spdlog::details::log_msg copy = msg;
    copy.payload = spdlog::string_view_t(escaped.data(), escaped.size());
    inner_->log(copy);
  }
  void flush() override { inner_->flush(); }
  void set_pattern(const std::string& pattern) override { inner_->set_pattern(pattern); }
  void set_formatter(std::unique_ptr<spdlog::formatter> f) override {
    inner_->set_formatter(std::move(f));
  }

 private:
  static bool NeedsEscape(absl::string_view s) {
    for (unsigned char c : s) {
      if (c < 0x20 || c == 0x7f || c == '\\') return true;
    }
    return false;
  }

  const spdlog::sink_ptr inner_;
};

spdlog::sink_ptr StderrSink() {
  auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  sink->set_formatter(std::make_unique<spdlog::pattern_formatter>("%Y-%m-%dT%H:%M:%S.%fZ %L %n: %v",
                                                                  spdlog::pattern_time_type::utc));
  return std::make_shared<EscapingSink>(std::move(sink));
}

spdlog::sink_ptr JournalSink() {
  // journald stamps time and priority itself.
  auto sink = std::make_shared<spdlog::sinks::systemd_sink_mt>("gradsyncd");
  sink->set_pattern("%n: %v");
  return std::make_shared<EscapingSink>(std::move(sink));
}

}  // namespace

std::string EscapeForLog(absl::string_view message) {
  std::string out;
  out.reserve(message.size());
  for (unsigned char c : message) {
    switch (c) {
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\\':
        out += "\\\\";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
          absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
}

absl::Status Init(absl::string_view level, absl::string_view sink) {
  spdlog::level::level_enum lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown log level '", level, "': want trace|debug|info|warn|error|off"));
  }
  spdlog::sink_ptr s;
  if (sink == "stderr" || (sink == "auto" && !StartedBySystemd())) {
    s = StderrSink();
  } else if (sink == "journal" || sink == "auto") {
    s = JournalSink();
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown log sink '", sink, "': want auto|stderr|journal"));
  }
  State& st = GetState();
  absl::MutexLock lock(&st.mu);
  st.sinks = {s};
  st.level = lvl;
  spdlog::apply_all([&](std::shared_ptr<spdlog::logger> l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(st.mu) {
    l->sinks() = st.sinks;
    l->set_level(lvl);
  });
  return absl::OkStatus();
}

std::shared_ptr<spdlog::logger> Logger(absl::string_view component) {
  const std::string name(component);
  if (auto existing = spdlog::get(name)) return existing;
  State& st = GetState();
  absl::MutexLock lock(&st.mu);
  if (auto existing = spdlog::get(name)) return existing;
  if (st.sinks.empty()) st.sinks = {StderrSink()};
  auto logger = std::make_shared<spdlog::logger>(name, st.sinks.begin(), st.sinks.end());
  logger->set_level(st.level);
  logger->flush_on(spdlog::level::warn);
  spdlog::register_logger(logger);
  return logger;
}

}  // namespace gradsync::logging
