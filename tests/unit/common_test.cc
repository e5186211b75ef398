#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/bounded_text.h"
#include "common/dtype.h"
#include "common/group.h"
#include "common/grpc_status.h"
#include "common/job_id.h"
#include "common/logging.h"
#include "daemon/config.h"
#include "gtest/gtest.h"

namespace gradsync {
namespace {

TEST(GroupKeyTest, ParsesWorldAndAscendingRanks) {
  EXPECT_TRUE(ParseGroupKey("world")->empty());
  EXPECT_EQ(*ParseGroupKey("0,1,3"), (std::vector<int>{0, 1, 3}));
  EXPECT_EQ(*ParseGroupKey("7"), (std::vector<int>{7}));
  EXPECT_EQ(GroupKey({0, 2, 5}), "0,2,5");
}

TEST(GroupKeyTest, RejectsMalformedKeys) {
  for (const char* bad : {"", "1,0", "0,0", "0,,1", "a", "-1", "0, 1", "01", "+1", "0,"}) {
    EXPECT_EQ(ParseGroupKey(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(DTypeTest, SizesAndNamesRoundTrip) {
  EXPECT_EQ(DTypeSize(v1::FLOAT32), 4);
  EXPECT_EQ(DTypeSize(v1::BFLOAT16), 2);
  EXPECT_EQ(DTypeSize(v1::INT64), 8);
  EXPECT_EQ(DTypeSize(v1::DTYPE_UNSPECIFIED), 0);
  for (auto d : {v1::FLOAT32, v1::FLOAT64, v1::FLOAT16, v1::BFLOAT16, v1::INT32, v1::INT64,
                 v1::UINT8, v1::INT8}) {
    EXPECT_EQ(*ParseDType(DTypeName(d)), d);
  }
  EXPECT_EQ(*ParseDType("half"), v1::FLOAT16);
  EXPECT_FALSE(ParseDType("complex64").ok());
}

TEST(LoggingTest, LevelsAndSinksAreCheckedAndApplyToEveryLogger) {
  EXPECT_EQ(logging::Init("loud", "stderr").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(logging::Init("info", "syslog").code(), absl::StatusCode::kInvalidArgument);
  auto before = logging::Logger("test-before");
  ASSERT_TRUE(logging::Init("debug", "stderr").ok());
  EXPECT_EQ(before->level(), spdlog::level::debug);  // existing loggers follow
  EXPECT_EQ(logging::Logger("test-after")->level(), spdlog::level::debug);
  EXPECT_EQ(logging::Logger("test-after"), logging::Logger("test-after"));  // one per name
  ASSERT_TRUE(logging::Init("warn", "journal").ok());
  EXPECT_EQ(before->level(), spdlog::level::warn);
  ASSERT_TRUE(logging::Init("info", "stderr").ok());
}

TEST(JobIdTest, OneRuleRefusesPathsControlBytesAndOverlongIds) {
  EXPECT_TRUE(CheckJobId("job-1_a.b").ok());
  EXPECT_TRUE(CheckJobId(std::string(kMaxJobIdBytes, 'a')).ok());
  for (const std::string& bad : {std::string(), std::string("a/b"), std::string("."),
                                 std::string(".."), std::string("a\0b", 3), std::string("a\nb"),
                                 std::string("a b"), std::string(kMaxJobIdBytes + 1, 'a')}) {
    EXPECT_EQ(CheckJobId(bad).code(), absl::StatusCode::kInvalidArgument) << absl::CEscape(bad);
  }
}

TEST(JobIdTest, AnElasticJobsEpochsAreItsIdAndItsIdWithDotEAndTheEpoch) {
  EXPECT_EQ(ElasticJobId("j", 0), "j");
  EXPECT_EQ(ElasticJobId("j", 3), "j.e3");
  EXPECT_EQ(*ElasticBase("j.e3", 3), "j");
  EXPECT_FALSE(ElasticBase("j.e3", 2).ok());
  for (const char* id : {"j", "j.e1", "j.e12"}) EXPECT_TRUE(IsEpochOf(id, "j")) << id;
  for (const char* id : {"j.e0", "j.e01", "j.e", "j.ex", "j.e-1", "jj.e1", "j.e1.e2", "k"}) {
    EXPECT_FALSE(IsEpochOf(id, "j")) << id;
  }
}

TEST(BoundedTextTest, ListsNameTheFirstFewItemsAndCountTheRest) {
  EXPECT_EQ(JoinBounded(std::vector<int>{1, 2, 3}, ","), "1,2,3");
  std::vector<std::string> keys;
  for (int i = 0; i < 10000; ++i) keys.push_back(absl::StrCat("k", i));
  EXPECT_EQ(JoinBounded(keys), "k0, k1, k2, k3, k4, k5, k6, k7 and 9992 more");
  EXPECT_EQ(JoinBounded(std::vector<std::string>{std::string(100, 'x')}),
            std::string(kItemBytesInErrors, 'x') + "...");
}

TEST(LoggingTest, EscapeForLogLeavesNoLineBreakOrControlByte) {
  EXPECT_EQ(logging::EscapeForLog("job=a\nFORGED\r\x1b[31m\\ ok é"),
            "job=a\\nFORGED\\r\\x1b[31m\\\\ ok é");
  EXPECT_EQ(logging::EscapeForLog("plain key=value"), "plain key=value");
}

TEST(GrpcStatusTest, LongMessagesAreCutAndSaySo) {
  const grpc::Status s = ToGrpcStatus(absl::InternalError(std::string(10000, 'm')));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_LT(s.error_message().size(), kMaxStatusMessageBytes + 64);
  EXPECT_TRUE(absl::EndsWith(s.error_message(), "... (5904 more bytes)")) << s.error_message();
}

TEST(DaemonConfigTest, DefaultsAreValidAndLoopbackOnly) {
  daemon::DaemonConfig c;
  EXPECT_TRUE(daemon::Validate(c).ok());
  EXPECT_EQ(c.port, -1);  // no TCP unless asked for (with a token)
  EXPECT_EQ(c.bind_address, "127.0.0.1");
  EXPECT_EQ(c.socket_mode, 0660);
  EXPECT_EQ(c.unix_socket, "/run/gradsync/gradsyncd.sock");
}

TEST(DaemonConfigTest, RejectsBadSettings) {
  auto bad = [](auto mutate) {
    daemon::DaemonConfig c;
    c.port = 7451;  // TCP on, as a node of a job spanning nodes runs
    c.cluster_token = "t";
    mutate(c);
    return daemon::Validate(c).code();
  };
  EXPECT_EQ(bad([](auto& c) { c.port = 65536; }), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](auto& c) { c.unix_socket = "rel.sock"; }), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](auto& c) {
              c.unix_socket = "";
              c.port = -1;
            }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](auto& c) { c.unix_socket = "/" + std::string(120, 'x'); }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](auto& c) { c.store.max_value_bytes = c.max_message_bytes; }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](auto& c) { c.max_wait = absl::ZeroDuration(); }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](auto& c) { c.bind_address = ""; }), absl::StatusCode::kInvalidArgument);
  // A wildcard listener does not say which address peers should use.
  EXPECT_EQ(bad([](auto& c) { c.bind_address = "0.0.0.0"; }), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](auto& c) { c.bind_address = "::"; }), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](auto& c) {
              c.bind_address = "0.0.0.0";
              c.advertise_address = "10.0.0.7";
            }),
            absl::StatusCode::kOk);
  EXPECT_EQ(bad([](auto& c) {
              c.bind_address = "0.0.0.0";
              c.port = -1;
            }),
            absl::StatusCode::kOk);
  // Peers dial the advertised address and the data links listen on it: never every interface.
  EXPECT_EQ(bad([](auto& c) { c.advertise_address = "0.0.0.0"; }),
            absl::StatusCode::kInvalidArgument);
  // TCP serves other daemons and always needs the cluster token.
  EXPECT_EQ(bad([](auto& c) { c.cluster_token.clear(); }), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](auto& c) {
              c.cluster_token.clear();
              c.port = -1;
            }),
            absl::StatusCode::kOk);
  EXPECT_EQ(bad([](auto& c) { c.engine.max_ops_in_flight_per_session = 1025; }),
            absl::StatusCode::kInvalidArgument);  // past the doorbell's completion ring
  EXPECT_EQ(bad([](auto& c) { c.engine.max_sessions = 0; }), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](auto& c) { c.mappings.max_mappings = 0; }), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace gradsync
