// Reflection as grpcurl uses it: list the services, then resolve each one's file descriptor
// (with its dependencies) and find its methods, with no local .proto files. The reflection
// client is generated from Debian's grpc-proto reflection.proto (test-only library).

#include <signal.h>

#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/store_client.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"

namespace gradsync::testing {
namespace {

namespace refl = grpc::reflection::v1alpha;

class ReflectionClient {
 public:
  explicit ReflectionClient(const std::string& target)
      : stub_(refl::ServerReflection::NewStub(client::Connect(target))) {
    ctx_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    stream_ = stub_->ServerReflectionInfo(&ctx_);
  }
  ~ReflectionClient() {
    stream_->WritesDone();
    (void)stream_->Finish();
  }

  std::set<std::string> ListServices() {
    refl::ServerReflectionRequest req;
    req.set_list_services("");
    refl::ServerReflectionResponse resp = Ask(req);
    std::set<std::string> names;
    for (const auto& s : resp.list_services_response().service()) names.insert(s.name());
    return names;
  }

  // Adds the file defining `symbol`, and what it imports, to `pool` (as grpcurl does).
  bool Resolve(const std::string& symbol, google::protobuf::DescriptorPool& pool) {
    refl::ServerReflectionRequest req;
    req.set_file_containing_symbol(symbol);
    refl::ServerReflectionResponse resp = Ask(req);
    if (!resp.has_file_descriptor_response()) return false;
    std::vector<google::protobuf::FileDescriptorProto> files;
    for (const std::string& bytes : resp.file_descriptor_response().file_descriptor_proto()) {
      files.emplace_back().ParseFromString(bytes);
    }
    // Dependencies first: keep adding until every file is built.
    for (size_t round = 0; round < files.size() + 1; ++round) {
      for (const auto& f : files) {
        if (pool.FindFileByName(f.name()) == nullptr) (void)pool.BuildFile(f);
      }
    }
    for (const auto& f : files) {
      if (pool.FindFileByName(f.name()) == nullptr) return false;
    }
    return true;
  }

 private:
  refl::ServerReflectionResponse Ask(const refl::ServerReflectionRequest& req) {
    refl::ServerReflectionResponse resp;
    EXPECT_TRUE(stream_->Write(req));
    EXPECT_TRUE(stream_->Read(&resp));
    return resp;
  }

  std::unique_ptr<refl::ServerReflection::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<
      grpc::ClientReaderWriter<refl::ServerReflectionRequest, refl::ServerReflectionResponse>>
      stream_;
};

TEST(ReflectionTest, ListsServicesAndResolvesEveryOneLikeGrpcurl) {
  TempDir dir;
  auto d = DaemonProcess::Start(dir.path());
  ASSERT_TRUE(d.ok()) << d.status();
  for (const std::string& target : {(*d)->unix_target(), (*d)->tcp_target()}) {
    ReflectionClient reflection(target);
    const std::set<std::string> services = reflection.ListServices();
    for (const char* want : {"gradsync.v1.Store", "gradsync.v1.Inspect", "grpc.health.v1.Health",
                             "grpc.reflection.v1alpha.ServerReflection"}) {
      EXPECT_TRUE(services.count(want)) << target << " does not list " << want;
    }
    google::protobuf::DescriptorPool pool;
    ASSERT_TRUE(reflection.Resolve("grpc.health.v1.Health", pool));
    const auto* health = pool.FindServiceByName("grpc.health.v1.Health");
    ASSERT_NE(health, nullptr);
    EXPECT_NE(health->FindMethodByName("Check"), nullptr);
    EXPECT_NE(health->FindMethodByName("Watch"), nullptr);

    ASSERT_TRUE(reflection.Resolve("gradsync.v1.Inspect", pool));
    const auto* inspect = pool.FindServiceByName("gradsync.v1.Inspect");
    ASSERT_NE(inspect, nullptr);
    const auto* get = inspect->FindMethodByName("GetPackList");
    ASSERT_NE(get, nullptr);
    EXPECT_NE(get->output_type()->FindFieldByName("pack_list"), nullptr);
    // "Who is stuck where", with no .proto at hand.
    const auto* list_ops = inspect->FindMethodByName("ListOps");
    ASSERT_NE(list_ops, nullptr);
    EXPECT_NE(list_ops->output_type()->FindFieldByName("ops"), nullptr);
    EXPECT_NE(list_ops->output_type()->FindFieldByName("nodes"), nullptr);
    const auto* history = inspect->FindMethodByName("GetHistory");
    ASSERT_NE(history, nullptr);
    EXPECT_NE(history->output_type()->FindFieldByName("ops"), nullptr);

    ASSERT_TRUE(reflection.Resolve("gradsync.v1.Store", pool));
    const auto* store = pool.FindServiceByName("gradsync.v1.Store");
    ASSERT_NE(store, nullptr);
    for (const char* m : {"Set", "Get", "Wait", "Add", "CompareSet", "Delete", "List",
                          "SetPackList", "GetPackList"}) {
      EXPECT_NE(store->FindMethodByName(m), nullptr) << m;
    }
  }
}

// --health_port: grpc.health.v1.Health alone, plaintext and without a token (a kubelet's probe
// carries neither), its status the daemon's; the store, inspection and reflection are not there.
TEST(ReflectionTest, TheHealthPortServesHealthAloneWithoutAToken) {
  TempDir dir;
  const int port = FreeLoopbackPort();
  ASSERT_GT(port, 0);
  DaemonProcess::Options options;
  options.flags = {absl::StrCat("--health_port=", port)};
  auto d = DaemonProcess::Start(dir.path(), options);
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string target = absl::StrCat("127.0.0.1:", port);
  auto health = grpc::health::v1::Health::NewStub(client::Connect(target));
  for (const std::string service : {"", "gradsync.v1.Store", "gradsync.v1.Inspect"}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    const grpc::Status s = health->Check(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << service << ": " << s.error_message();
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING) << service;
  }
  client::ClientOptions with_token;  // even the cluster's token opens nothing else here
  with_token.token = (*d)->token();
  client::StoreClient store(client::Connect(target, with_token), with_token);
  EXPECT_EQ(store.Set("j", "k", "v").code(), absl::StatusCode::kUnimplemented);
  auto reflection = refl::ServerReflection::NewStub(client::Connect(target));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  auto stream = reflection->ServerReflectionInfo(&ctx);
  refl::ServerReflectionRequest req;
  req.set_list_services("");
  stream->Write(req);
  stream->WritesDone();
  refl::ServerReflectionResponse resp;
  EXPECT_FALSE(stream->Read(&resp));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNIMPLEMENTED);
  // The daemon's own TCP port keeps reflection, and the drain ends both servers.
  EXPECT_TRUE(ReflectionClient((*d)->tcp_target()).ListServices().count("grpc.health.v1.Health"));
  auto code = (*d)->Stop(SIGTERM);
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

}  // namespace
}  // namespace gradsync::testing
