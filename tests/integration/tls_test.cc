// Mutual TLS between daemons (--tls_cert, --tls_key, --tls_ca). Two daemons with certificates of
// one CA form a job and all-reduce across nodes; a plaintext daemon cannot join a TLS root's job.
// A TLS daemon refuses plaintext clients, clients whose certificate another CA signed, clients
// with no certificate, and (TLS or not) calls without the cluster token, and stays SERVING after
// each; a client refuses a daemon it cannot verify. Some of the flags but not all, or a key that
// others may read, stop the daemon at start (exit 2), and gradsyncctl likewise. The certificates
// are made with openssl at test time (skipped where openssl is missing).

#include "common/tls.h"

#include <sys/stat.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/store_client.h"
#include "common/grpc_status.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"

namespace gradsync::testing {
namespace {

using grpc::health::v1::HealthCheckResponse;

// Runs `script` with /bin/sh in `dir`, its output to `dir`/`log`; the exit code (-1 on timeout).
int RunShell(const std::string& dir, const std::string& script, const std::string& log) {
  const std::string out = dir + "/" + log;
  auto pid = Spawn({"/bin/sh", "-c", absl::StrCat("cd '", dir, "' && ", script)}, {}, out, out);
  if (!pid.ok()) return -1;
  return WaitAll({*pid}, absl::Seconds(60))[0];
}

// The certificates: tests/make_test_certs.sh (a CA "ca" signing node0, node1 and tool, another
// CA "other" signing stranger; <name>.pem, <name>.key).
constexpr char kMakeCertificates[] = "bash " GRADSYNC_SOURCE_DIR "/tests/make_test_certs.sh";

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (RunShell(pki_.path(), "command -v openssl", "which.log") != 0) {
      GTEST_SKIP() << "openssl is not installed; it makes the test certificates";
    }
    ASSERT_EQ(RunShell(pki_.path(), kMakeCertificates, "openssl.log"), 0)
        << ReadFile(pki_.path() + "/openssl.log");
  }

  std::string Pem(const std::string& name) const { return pki_.path() + "/" + name + ".pem"; }
  std::string Key(const std::string& name) const { return pki_.path() + "/" + name + ".key"; }

  // The daemon (or gradsyncctl) flags of the leaf `name`, trusting `ca`.
  std::vector<std::string> TlsFlags(const std::string& name, const std::string& ca = "ca") const {
    return {"--tls_cert=" + Pem(name), "--tls_key=" + Key(name), "--tls_ca=" + Pem(ca)};
  }

  // Client options with the leaf `name`'s identity, trusting `ca`, and the test token.
  client::ClientOptions TlsClient(const std::string& name, const std::string& ca = "ca") const {
    auto tls = ReadTlsFiles({Pem(name), Key(name), Pem(ca)});
    EXPECT_TRUE(tls.ok() && tls->has_value()) << tls.status();
    client::ClientOptions options;
    options.token = DaemonProcess::kTestToken;
    options.rpc_timeout = absl::Seconds(5);
    if (tls.ok()) options.tls = *std::move(tls);
    return options;
  }

  absl::StatusOr<std::unique_ptr<DaemonProcess>> StartDaemon(std::vector<std::string> flags) {
    dirs_.push_back(std::make_unique<TempDir>());
    DaemonProcess::Options options;
    options.flags = std::move(flags);
    return DaemonProcess::Start(dirs_.back()->path(), options);
  }

  static absl::StatusOr<HealthCheckResponse::ServingStatus> Health(
      const std::shared_ptr<grpc::Channel>& channel) {
    auto stub = grpc::health::v1::Health::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    HealthCheckResponse resp;
    if (absl::Status s =
            FromGrpcStatus(stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp));
        !s.ok()) {
      return s;
    }
    return resp.status();
  }

  // One rank per entry of `node_of` (rank r on daemons[node_of[r]]), root on daemon 0; each
  // rank's stdout and stderr go to <dir>/out.<r>. Returns the exit codes.
  std::vector<int> RunRanks(const std::vector<DaemonProcess*>& daemons, const std::string& job,
                            const std::vector<int>& node_of, const std::string& scenario,
                            const std::vector<std::string>& args) {
    const int world = static_cast<int>(node_of.size());
    std::vector<pid_t> pids;
    for (int r = 0; r < world; ++r) {
      int local_world = 0;
      for (int n : node_of) local_world += n == node_of[r];
      std::vector<std::string> argv = {HelperBinary("collective_worker"),
                                       daemons[node_of[r]]->unix_target(),
                                       job,
                                       std::to_string(world),
                                       std::to_string(r),
                                       scenario,
                                       "local_world_size=" + std::to_string(local_world),
                                       "root=" + daemons[0]->tcp_target()};
      argv.insert(argv.end(), args.begin(), args.end());
      const std::string out = absl::StrCat(pki_.path(), "/out.", r);
      auto pid = Spawn(argv, {}, out, out);
      EXPECT_TRUE(pid.ok()) << pid.status();
      pids.push_back(pid.ok() ? *pid : -1);
    }
    return WaitAll(pids, absl::Seconds(120));
  }
  std::string RankOutput(int r) const { return ReadFile(absl::StrCat(pki_.path(), "/out.", r)); }

  TempDir pki_;
  std::vector<std::unique_ptr<TempDir>> dirs_;
};

TEST_F(TlsTest, TwoDaemonsWithCertificatesOfOneCaFormAJobAndAllReduceAcrossNodes) {
  auto d0 = StartDaemon(TlsFlags("node0"));
  ASSERT_TRUE(d0.ok()) << d0.status();
  auto d1 = StartDaemon(TlsFlags("node1"));
  ASSERT_TRUE(d1.ok()) << d1.status();
  // Daemon 1 publishes its ranks in daemon 0's store and the Gloo rendezvous runs through it:
  // over mutual TLS, or the job would never form.
  const std::vector<int> codes = RunRanks({d0->get(), d1->get()}, "tls2", {0, 0, 1, 1}, "matrix",
                                          {"counts=7,65537", "dtypes=float32,bfloat16"});
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(codes[r], 0) << "rank " << r << ": " << RankOutput(r);
    EXPECT_TRUE(absl::StrContains(RankOutput(r), "matrix cases=")) << RankOutput(r);
  }
}

TEST_F(TlsTest, PlaintextDaemonCannotJoinATlsRootsJob) {
  std::vector<std::string> root_flags = TlsFlags("node0");
  root_flags.push_back("--op_timeout=3s");
  auto d0 = StartDaemon(root_flags);
  ASSERT_TRUE(d0.ok()) << d0.status();
  auto d1 = StartDaemon({"--op_timeout=3s"});  // same token, no TLS
  ASSERT_TRUE(d1.ok()) << d1.status();
  // The root's ranks wait for ranks 2 and 3, which never get in: the job does not form.
  const std::vector<int> codes =
      RunRanks({d0->get(), d1->get()}, "mixed", {0, 0, 1, 1}, "noform", {});
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(codes[r], 0) << "rank " << r << ": " << RankOutput(r);
    EXPECT_TRUE(absl::StrContains(RankOutput(r), "noform ok")) << RankOutput(r);
  }
  // Ranks 2 and 3 are told their daemon could not reach the root (no TLS handshake).
  for (int r = 2; r < 4; ++r) {
    EXPECT_NE(codes[r], 0) << "rank " << r << ": " << RankOutput(r);
    EXPECT_TRUE(absl::StrContains(RankOutput(r), "UNAVAILABLE")) << RankOutput(r);
  }
  for (auto* d : {d0->get(), d1->get()}) {
    auto serving = Health(client::Connect(d->unix_target()));
    ASSERT_TRUE(serving.ok()) << serving.status();
    EXPECT_EQ(*serving, HealthCheckResponse::SERVING);
  }
}

TEST_F(TlsTest, DaemonRefusesClientsWithoutACertificateOfItsCaAndStaysServing) {
  auto daemon = StartDaemon(TlsFlags("node0"));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  DaemonProcess& d = **daemon;
  client::StoreClient local(client::Connect(d.unix_target()));
  const client::ClientOptions good = TlsClient("tool");
  client::StoreClient trusted(client::Connect(d.tcp_target(), good), good);
  ASSERT_TRUE(trusted.Set("j", "k", "v").ok());

  client::ClientOptions plaintext;
  plaintext.token = DaemonProcess::kTestToken;
  plaintext.rpc_timeout = absl::Seconds(5);
  client::ClientOptions no_token = TlsClient("tool");
  no_token.token.clear();
  struct Refused {
    std::string what;
    std::shared_ptr<grpc::Channel> channel;
    client::ClientOptions options;
    absl::StatusCode code;
  };
  // gRPC's SSL credentials with a root CA and no key pair: a client that presents no certificate.
  grpc::SslCredentialsOptions certless;
  certless.pem_root_certs = ReadFile(Pem("ca"));
  const std::vector<Refused> cases = {
      {"plaintext", client::Connect(d.tcp_target(), plaintext), plaintext,
       absl::StatusCode::kUnavailable},
      {"certificate of another CA", client::Connect(d.tcp_target(), TlsClient("stranger")),
       TlsClient("stranger"), absl::StatusCode::kUnavailable},
      {"no client certificate", grpc::CreateChannel(d.tcp_target(), grpc::SslCredentials(certless)),
       plaintext, absl::StatusCode::kUnavailable},
      // The client's side of "peers verified": it trusts only the other CA, so it refuses the
      // daemon's certificate.
      {"daemon not verifiable", client::Connect(d.tcp_target(), TlsClient("tool", "other")),
       TlsClient("tool", "other"), absl::StatusCode::kUnavailable},
      // TLS does not replace the token.
      {"TLS without the token", client::Connect(d.tcp_target(), no_token), no_token,
       absl::StatusCode::kUnauthenticated},
  };
  for (const Refused& c : cases) {
    client::StoreClient store(c.channel, c.options);
    absl::Status set = store.Set("j", "from " + c.what, "x");
    EXPECT_EQ(set.code(), c.code) << c.what << ": " << set;
    EXPECT_EQ(store.Get("j", "k", absl::Now() + absl::Seconds(2)).status().code(), c.code)
        << c.what;
    if (c.code == absl::StatusCode::kUnavailable) {
      // Refused in the handshake: not even health answers.
      EXPECT_FALSE(Health(c.channel).ok()) << c.what;
    }
    // The daemon is alive and SERVING, and still serves a trusted client over TLS.
    auto serving = Health(client::Connect(d.unix_target()));
    ASSERT_TRUE(serving.ok()) << c.what << ": " << serving.status();
    EXPECT_EQ(*serving, HealthCheckResponse::SERVING) << c.what;
    auto tcp_serving = Health(trusted.channel());
    ASSERT_TRUE(tcp_serving.ok()) << c.what << ": " << tcp_serving.status();
    EXPECT_EQ(*tcp_serving, HealthCheckResponse::SERVING) << c.what;
    auto v = trusted.Get("j", "k", absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(v.ok()) << c.what << ": " << v.status();
    EXPECT_EQ(*v, "v");
  }
  // Nothing any refused client sent was stored.
  auto keys = local.List("j", "");
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ(*keys, std::vector<std::string>{"k"});
}

TEST_F(TlsTest, GradsyncctlSpeaksTlsWithItsFlagsAndRefusesSomeOfThem) {
  auto daemon = StartDaemon(TlsFlags("node0"));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  DaemonProcess& d = **daemon;
  const auto ctl = [&](std::vector<std::string> flags, const std::string& log) {
    std::vector<std::string> argv = {HelperBinary("../client/gradsyncctl"),
                                     "--address=" + d.tcp_target(),
                                     "--token_file=" + d.token_file(), "--timeout=5s", "--job=j"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    const std::string out = pki_.path() + "/" + log;
    auto pid = Spawn(argv, {}, out, out);
    EXPECT_TRUE(pid.ok()) << pid.status();
    return pid.ok() ? WaitAll({*pid}, absl::Seconds(30))[0] : -1;
  };
  std::vector<std::string> set = TlsFlags("tool");
  set.insert(set.end(), {"store", "set", "k", "over-tls"});
  EXPECT_EQ(ctl(set, "set"), 0) << ReadFile(pki_.path() + "/set");
  std::vector<std::string> get = TlsFlags("tool");
  get.insert(get.end(), {"store", "get", "k"});
  EXPECT_EQ(ctl(get, "get"), 0) << ReadFile(pki_.path() + "/get");
  EXPECT_EQ(ReadFile(pki_.path() + "/get"), "over-tls\n");
  // Without TLS the daemon does not answer; with some of the flags gradsyncctl does not start.
  EXPECT_EQ(ctl({"store", "get", "k"}, "plain"), 1) << ReadFile(pki_.path() + "/plain");
  EXPECT_EQ(ctl({"--tls_cert=" + Pem("tool"), "store", "get", "k"}, "partial"), 2);
  EXPECT_TRUE(absl::StrContains(ReadFile(pki_.path() + "/partial"), "missing --tls_key, --tls_ca"))
      << ReadFile(pki_.path() + "/partial");
}

TEST_F(TlsTest, DaemonRefusesSomeOfTheFlagsAnOpenKeyOrAFileWithoutPem) {
  const std::string token = pki_.path() + "/token";
  std::ofstream(token) << "t\n";
  ::chmod(token.c_str(), 0600);
  const std::string open_key = pki_.path() + "/open.key";
  const std::string cert_as_key = pki_.path() + "/cert-as.key";
  ASSERT_EQ(RunShell(pki_.path(),
                     "cp node0.key open.key && chmod 644 open.key && cp node0.pem cert-as.key && "
                     "chmod 600 cert-as.key",
                     "cp.log"),
            0);
  struct Case {
    std::vector<std::string> flags;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--tls_cert=" + Pem("node0")}, "missing --tls_key, --tls_ca"},
      {{"--tls_cert=" + Pem("node0"), "--tls_key=" + Key("node0")}, "missing --tls_ca"},
      {{"--tls_key=" + Key("node0"), "--tls_ca=" + Pem("ca")}, "missing --tls_cert"},
      {{"--tls_cert=" + Pem("node0"), "--tls_key=" + open_key, "--tls_ca=" + Pem("ca")},
       "accessible to others"},
      {{"--tls_cert=" + Pem("node0"), "--tls_key=" + Key("node0"),
        "--tls_ca=" + pki_.path() + "/absent.pem"},
       "--tls_ca="},
      {{"--tls_cert=" + Key("node0"), "--tls_key=" + Key("node0"), "--tls_ca=" + Pem("ca")},
       "holds no PEM CERTIFICATE block"},
      {{"--tls_cert=" + Pem("node0"), "--tls_key=" + cert_as_key, "--tls_ca=" + Pem("ca")},
       "holds no PEM PRIVATE KEY block"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string err = absl::StrCat(pki_.path(), "/err.", i);
    std::vector<std::string> argv = {DaemonBinary(), "--socket=" + pki_.path() + "/s.sock",
                                     "--port=0", "--token_file=" + token};
    argv.insert(argv.end(), cases[i].flags.begin(), cases[i].flags.end());
    auto pid = Spawn(argv, {}, "", err);
    ASSERT_TRUE(pid.ok()) << pid.status();
    auto code = WaitExit(*pid, absl::Seconds(10));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 2) << absl::StrJoin(cases[i].flags, " ");
    EXPECT_TRUE(absl::StrContains(ReadFile(err), cases[i].message))
        << cases[i].message << " not in: " << ReadFile(err);
  }
}

}  // namespace
}  // namespace gradsync::testing
