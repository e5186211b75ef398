#include "daemon/store/memory_store.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace gradsync::store {
namespace {

absl::Time In(absl::Duration d) { return absl::Now() + d; }

TEST(MemoryStoreTest, SetThenGetAndJobsAreSeparateNamespaces) {
  MemoryStore store;
  ASSERT_TRUE(store.Set("a", "k", "1").ok());
  ASSERT_TRUE(store.Set("b", "k", "2").ok());
  EXPECT_EQ(*store.Get("a", "k", In(absl::Seconds(1))), "1");
  EXPECT_EQ(*store.Get("b", "k", In(absl::Seconds(1))), "2");
  ASSERT_TRUE(store.Set("a", "k", "3").ok());
  EXPECT_EQ(*store.Peek("a", "k"), "3");
}

TEST(MemoryStoreTest, GetWaitsForASetFromAnotherThread) {
  MemoryStore store;
  std::thread writer([&] {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_TRUE(store.Set("j", "late", "here").ok());
  });
  auto v = store.Get("j", "late", In(absl::Seconds(10)));
  writer.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "here");
}

TEST(MemoryStoreTest, WaitTimesOutNamingOnlyTheMissingKeys) {
  MemoryStore store;
  ASSERT_TRUE(store.Set("j", "present", "x").ok());
  const absl::Time start = absl::Now();
  absl::Status s = store.Wait("j", {"present", "absent1", "absent2"}, In(absl::Milliseconds(50)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(s.message(), "missing keys: absent1, absent2")) << s;
  EXPECT_FALSE(absl::StrContains(s.message(), "present,")) << s;
}

TEST(MemoryStoreTest, WaitAsyncReturnsValuesInRequestOrderWhateverTheSetOrder) {
  MemoryStore store;
  absl::Notification done;
  absl::StatusOr<std::vector<std::string>> got;
  store.WaitAsync("j", {"x", "y", "z"}, In(absl::Seconds(10)), [&](auto r) {
    got = std::move(r);
    done.Notify();
  });
  ASSERT_TRUE(store.Set("j", "z", "Z").ok());
  ASSERT_TRUE(store.Set("j", "x", "X").ok());
  EXPECT_FALSE(done.HasBeenNotified());
  ASSERT_TRUE(store.Set("j", "y", "Y").ok());
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, (std::vector<std::string>{"X", "Y", "Z"}));
}

TEST(MemoryStoreTest, CancelWaitFinishesWithCancelledOnce) {
  MemoryStore store;
  std::atomic<int> calls{0};
  absl::Status status;
  const auto id = store.WaitAsync("j", {"k"}, In(absl::Seconds(30)), [&](auto r) {
    status = r.status();
    ++calls;
  });
  store.CancelWait(id);
  store.CancelWait(id);
  ASSERT_TRUE(store.Set("j", "k", "v").ok());
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled);
}

TEST(MemoryStoreTest, ShutdownFailsPendingWaitsAndRefusesNewOnes) {
  MemoryStore store;
  absl::Notification done;
  absl::Status status;
  store.WaitAsync("j", {"k"}, In(absl::Seconds(30)), [&](auto r) {
    status = r.status();
    done.Notify();
  });
  store.Shutdown();
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(store.Get("j", "k", In(absl::Seconds(1))).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(store.Set("j", "k", "v").code(), absl::StatusCode::kUnavailable);
}

TEST(MemoryStoreTest, AddIsAnAtomicCounterAcrossThreads) {
  MemoryStore store;
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) ASSERT_TRUE(store.Add("j", "n", 1).ok());
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(*store.Peek("j", "n"), "8000");
  EXPECT_EQ(*store.Add("j", "n", -8000), 0);
  EXPECT_EQ(*store.Add("j", "fresh", 5), 5);
}

TEST(MemoryStoreTest, AddOnATextValueOrPastInt64IsRefused) {
  MemoryStore store;
  ASSERT_TRUE(store.Set("j", "text", "hello").ok());
  EXPECT_EQ(store.Add("j", "text", 1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(*store.Peek("j", "text"), "hello");
  ASSERT_TRUE(store.Set("j", "big", "9223372036854775807").ok());
  EXPECT_EQ(store.Add("j", "big", 1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(*store.Peek("j", "big"), "9223372036854775807");
}

TEST(MemoryStoreTest, CompareSetSwapsOnlyOnMatch) {
  MemoryStore store;
  auto r = store.CompareSet("j", "k", std::nullopt, "first");
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->swapped);
  EXPECT_EQ(r->value, "first");
  r = store.CompareSet("j", "k", std::nullopt, "second");
  EXPECT_FALSE(r->swapped);
  EXPECT_EQ(r->value, "first");
  r = store.CompareSet("j", "k", std::string("wrong"), "third");
  EXPECT_FALSE(r->swapped);
  EXPECT_EQ(r->value, "first");
  r = store.CompareSet("j", "k", std::string("first"), "fourth");
  EXPECT_TRUE(r->swapped);
  EXPECT_EQ(*store.Peek("j", "k"), "fourth");
}

TEST(MemoryStoreTest, CompareSetWakesWaiters) {
  MemoryStore store;
  absl::Notification done;
  store.WaitAsync("j", {"k"}, In(absl::Seconds(10)), [&](auto) { done.Notify(); });
  ASSERT_TRUE(store.CompareSet("j", "k", std::nullopt, "v").ok());
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
}

TEST(MemoryStoreTest, ListIsSortedByPrefixAndDeleteRemoves) {
  MemoryStore store;
  for (const char* k : {"b/2", "a/1", "b/1", "c"}) ASSERT_TRUE(store.Set("j", k, "v").ok());
  EXPECT_EQ(*store.List("j", "b/"), (std::vector<std::string>{"b/1", "b/2"}));
  EXPECT_EQ(store.List("j", "")->size(), 4u);
  EXPECT_TRUE(*store.Delete("j", "b/1"));
  EXPECT_FALSE(*store.Delete("j", "b/1"));
  EXPECT_EQ(*store.List("j", "b/"), (std::vector<std::string>{"b/2"}));
  EXPECT_EQ(store.List("nobody", "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.Delete("nobody", "k").status().code(), absl::StatusCode::kNotFound);
  auto jobs = store.ListJobs();
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].keys, 3);
  EXPECT_EQ(jobs[0].value_bytes, 3);
}

TEST(MemoryStoreTest, LimitsAreEnforcedWithClearErrorsAndNothingChanges) {
  MemoryStoreOptions o;
  o.max_key_bytes = 8;
  o.max_value_bytes = 16;
  o.max_keys_per_job = 2;
  o.max_jobs = 2;
  o.max_waiters = 1;
  MemoryStore store(o);
  EXPECT_EQ(store.Set("j", "", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Set("", "k", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Set("j/x", "k", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Set("j", "123456789", "v").code(), absl::StatusCode::kInvalidArgument);
  absl::Status big = store.Set("j", "k", std::string(17, 'x'));
  EXPECT_EQ(big.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(big.message(), "store_max_value_bytes")) << big;
  EXPECT_TRUE(store.ListJobs().empty());
  ASSERT_TRUE(store.Set("j", "k1", "v").ok());
  ASSERT_TRUE(store.Set("j", "k2", "v").ok());
  ASSERT_TRUE(store.Set("j", "k2", "replaced").ok());  // replacing is not a new key
  absl::Status keys = store.Set("j", "k3", "v");
  EXPECT_EQ(keys.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(keys.message(), "store_max_keys_per_job")) << keys;
  ASSERT_TRUE(store.Set("j2", "k", "v").ok());
  EXPECT_EQ(store.Set("j3", "k", "v").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store.ListJobs().size(), 2u);
  store.WaitAsync("j", {"w1"}, In(absl::Seconds(10)), [](auto) {});
  EXPECT_EQ(store.Get("j", "w2", In(absl::Seconds(1))).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(MemoryStoreTest, ManyConcurrentWaitersAllWakeOnOneSet) {
  MemoryStore store;
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 16; ++t) {
    threads.emplace_back([&] {
      auto v = store.Get("j", "go", In(absl::Seconds(10)));
      if (v.ok() && *v == "now") ++ok;
    });
  }
  absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(store.Set("j", "go", "now").ok());
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 16);
}

TEST(MemoryStoreTest, DeadlinesFireInOrderWhileOthersKeepWaiting) {
  MemoryStore store;
  absl::Notification short_done, long_done;
  absl::Status short_status;
  store.WaitAsync("j", {"long"}, In(absl::Seconds(10)), [&](auto r) { long_done.Notify(); });
  store.WaitAsync("j", {"short"}, In(absl::Milliseconds(30)), [&](auto r) {
    short_status = r.status();
    short_done.Notify();
  });
  ASSERT_TRUE(short_done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(short_status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(long_done.HasBeenNotified());
  ASSERT_TRUE(store.Set("j", "long", "v").ok());
  EXPECT_TRUE(long_done.WaitForNotificationWithTimeout(absl::Seconds(5)));
}

}  // namespace
}  // namespace gradsync::store
