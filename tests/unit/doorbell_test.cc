#include "common/doorbell.h"

#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace gradsync::doorbell {
namespace {

class DoorbellTest : public ::testing::Test {
 protected:
  DoorbellTest() : region_(RegionBytes() / 8 + 1, 0), db_(Base()) { db_.Initialize(); }
  std::byte* Base() { return reinterpret_cast<std::byte*>(region_.data()); }
  Header* header() { return reinterpret_cast<Header*>(Base()); }

  std::vector<uint64_t> region_;  // 8-byte aligned, zeroed
  Doorbell db_;
};

TEST_F(DoorbellTest, RecordsComeOutInOrderAcrossTheWrap) {
  ASSERT_TRUE(db_.Validate().ok());
  // Records of ~1 MiB wrap the 4 MiB ring several times; sizes vary so the wrap lands mid-record.
  std::string got;
  bool have = false;
  for (int i = 0; i < 40; ++i) {
    const std::string record(1000003 + i * 17, static_cast<char>('a' + i % 26));
    ASSERT_TRUE(db_.Push(record)) << i;
    ASSERT_TRUE(db_.Pop(&got, &have).ok());
    ASSERT_TRUE(have);
    ASSERT_EQ(got, record) << i;
  }
  ASSERT_TRUE(db_.Pop(&got, &have).ok());
  EXPECT_FALSE(have);
}

TEST_F(DoorbellTest, FullRingRefusesUntilConsumed) {
  const std::string record(1 << 20, 'x');
  int pushed = 0;
  while (pushed < 10 && db_.Push(record)) ++pushed;
  EXPECT_EQ(pushed, 3);  // 4 MiB ring, each record takes 1 MiB + 8 bytes
  std::string got;
  bool have = false;
  ASSERT_TRUE(db_.Pop(&got, &have).ok());
  EXPECT_TRUE(db_.Push(record));
}

TEST_F(DoorbellTest, CorruptLengthIsAnErrorNotACrash) {
  ASSERT_TRUE(db_.Push("hello"));
  const uint64_t huge = uint64_t{1} << 40;
  std::memcpy(Base() + kHeaderBytes, &huge, 8);
  std::string got;
  bool have = false;
  EXPECT_EQ(db_.Pop(&got, &have).code(), absl::StatusCode::kInvalidArgument);
  header()->request_head.store(uint64_t{1} << 50);
  EXPECT_EQ(db_.Pop(&got, &have).code(), absl::StatusCode::kInvalidArgument);
  header()->magic = 7;
  EXPECT_EQ(db_.Validate().code(), absl::StatusCode::kInvalidArgument);
}

// Found by tests/fuzz/doorbell_fuzzer (corpus regression-skip_marker_with_no_record_behind).
TEST_F(DoorbellTest, SkipMarkerWithNoRecordBehindItIsConsumedSoTheDaemonCanSleep) {
  // A trainer publishes only the marker that skips the ring's last 16 bytes. DaemonWait sleeps
  // only while head == tail: unless Pop consumes the marker, the daemon's thread spins for ever.
  const uint64_t tail = 3 * kRequestRingBytes - 16;
  const uint64_t skip = ~uint64_t{0};
  std::memcpy(Base() + kHeaderBytes + kRequestRingBytes - 16, &skip, 8);
  header()->request_tail.store(tail);
  header()->request_head.store(tail + 16);
  std::string got;
  bool have = true;
  ASSERT_TRUE(db_.Pop(&got, &have).ok());
  EXPECT_FALSE(have);
  EXPECT_EQ(header()->request_tail.load(), tail + 16);
  // The next record starts the ring and comes out.
  ASSERT_TRUE(db_.Push("next"));
  ASSERT_TRUE(db_.Pop(&got, &have).ok());
  EXPECT_TRUE(have);
  EXPECT_EQ(got, "next");
}

TEST_F(DoorbellTest, CompletionsCarryStatusAndWakeASleepingTrainer) {
  Completion c;
  EXPECT_FALSE(db_.Next(&c));
  std::thread daemon([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_TRUE(db_.Complete(7, 3, 4, std::string(5000, 'm')));  // message cut at kMessageBytes
  });
  const absl::Time start = absl::Now();
  while (!db_.Next(&c) && absl::Now() - start < absl::Seconds(5)) db_.TrainerWait(absl::Seconds(1));
  daemon.join();
  EXPECT_EQ(c.tag, 7u);
  EXPECT_EQ(c.seq, 3u);
  EXPECT_EQ(c.code, 4);
  EXPECT_EQ(c.message_bytes, kMessageBytes);
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(900));  // woken, not timed out
  for (uint32_t i = 0; i < kCompletionSlots; ++i) ASSERT_TRUE(db_.Complete(i, 0, 0, ""));
  EXPECT_FALSE(db_.Complete(0, 0, 0, ""));  // full: the trainer broke its in-flight limit
}

}  // namespace
}  // namespace gradsync::doorbell
