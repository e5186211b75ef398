// The store suite: the Store contract (waits and their deadlines, Add, CompareSet, Delete, List,
// limits, shutdown) passed by every JobStore backend, the embedded MemoryStore and EtcdStore
// against a real etcd of one member and of three (started here; skipped where etcd-server is
// not installed). Then what only etcd does: a job's keys tied to the daemons holding it, a
// member killed under a pending wait, an unreachable cluster.

#include "daemon/store/memory_store.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "daemon/store/etcd_store.h"
#include "gtest/gtest.h"
#include "tests/etcd_cluster.h"

namespace gradsync::store {
namespace {

using gradsync::testing::EtcdCluster;

absl::Time In(absl::Duration d) { return absl::Now() + d; }

enum class Backend { kEmbedded, kEtcd, kEtcd3Members };

// One cluster of each size for the whole run, started on first use and killed (its data
// removed) at exit; nullptr and `why` when it cannot be started.
EtcdCluster* SharedCluster(int members, std::string* why) {
  static std::map<int, std::unique_ptr<EtcdCluster>> clusters;
  static std::map<int, std::string> errors;
  auto& cluster = clusters[members];
  if (!cluster && errors.count(members) == 0) {
    auto started = EtcdCluster::Start(members);
    if (started.ok()) {
      cluster = *std::move(started);
    } else {
      errors[members] = started.status().ToString();
    }
  }
  if (!cluster) *why = errors[members];
  return cluster.get();
}

// A prefix of its own for every store test: tests share a cluster, never keys.
std::string FreshPrefix() {
  static std::atomic<int> serial{0};
  return absl::StrCat("/gradsync-test/", ::getpid(), "-", serial++, "/");
}

EtcdOptions EtcdOptionsFor(const std::vector<std::string>& endpoints, const std::string& prefix,
                           MemoryStoreOptions limits = {}) {
  EtcdOptions o;
  o.endpoints = endpoints;
  o.prefix = prefix;
  o.limits = limits;
  return o;
}

class StoreTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    if (GetParam() == Backend::kEmbedded) return;
    if (const std::string why = EtcdCluster::Unavailable(); !why.empty()) GTEST_SKIP() << why;
    std::string why;
    cluster_ = SharedCluster(GetParam() == Backend::kEtcd3Members ? 3 : 1, &why);
    ASSERT_NE(cluster_, nullptr) << why;
    prefix_ = FreshPrefix();
  }

  bool etcd() const { return GetParam() != Backend::kEmbedded; }
  // The embedded figure, or the etcd one: a contended round trip to etcd costs milliseconds.
  int Scale(int embedded, int on_etcd) const { return etcd() ? on_etcd : embedded; }

  // The store one daemon holds.
  std::unique_ptr<JobStore> Make(MemoryStoreOptions o = {}) {
    if (!etcd()) return std::make_unique<MemoryStore>(o);
    return std::make_unique<EtcdStore>(EtcdOptionsFor(cluster_->endpoints(), prefix_, o));
  }

  // The same job namespaces seen by another daemon: a store of its own on etcd (through the
  // last member first), the same one embedded (a job's keys live in its root's store).
  JobStore* Peer(JobStore& store) {
    if (!etcd()) return &store;
    std::vector<std::string> endpoints = cluster_->endpoints();
    std::rotate(endpoints.begin(), endpoints.end() - 1, endpoints.end());
    peer_ = std::make_unique<EtcdStore>(EtcdOptionsFor(endpoints, prefix_));
    return peer_.get();
  }

  EtcdCluster* cluster_ = nullptr;
  std::string prefix_;
  std::unique_ptr<JobStore> peer_;
};

TEST_P(StoreTest, SetThenGetAndJobsAreSeparateNamespaces) {
  auto store = Make();
  ASSERT_TRUE(store->Set("a", "k", "1").ok());
  ASSERT_TRUE(store->Set("b", "k", "2").ok());
  EXPECT_EQ(*store->Get("a", "k", In(absl::Seconds(1))), "1");
  EXPECT_EQ(*store->Get("b", "k", In(absl::Seconds(1))), "2");
  ASSERT_TRUE(store->Set("a", "k", "3").ok());
  EXPECT_EQ(*store->Peek("a", "k"), "3");
  EXPECT_EQ(*Peer(*store)->Get("a", "k", In(absl::Seconds(1))), "3");
}

TEST_P(StoreTest, GetWaitsForASetFromAnotherThread) {
  auto store = Make();
  JobStore* peer = Peer(*store);
  std::thread writer([&] {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_TRUE(peer->Set("j", "late", "here").ok());
  });
  auto v = store->Get("j", "late", In(absl::Seconds(10)));
  writer.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "here");
}

TEST_P(StoreTest, WaitTimesOutNamingOnlyTheMissingKeys) {
  auto store = Make();
  ASSERT_TRUE(store->Set("j", "present", "x").ok());
  const absl::Time start = absl::Now();
  absl::Status s = store->Wait("j", {"present", "absent1", "absent2"}, In(absl::Milliseconds(50)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(s.message(), "missing keys: absent1, absent2")) << s;
  EXPECT_FALSE(absl::StrContains(s.message(), "present,")) << s;
}

TEST_P(StoreTest, WaitAsyncReturnsValuesInRequestOrderWhateverTheSetOrder) {
  auto store = Make();
  JobStore* peer = Peer(*store);
  absl::Notification done;
  absl::StatusOr<std::vector<std::string>> got;
  store->WaitAsync("j", {"x", "y", "z", "x"}, In(absl::Seconds(10)), [&](auto r) {
    got = std::move(r);
    done.Notify();
  });
  ASSERT_TRUE(peer->Set("j", "z", "Z").ok());
  ASSERT_TRUE(peer->Set("j", "x", "X").ok());
  ASSERT_TRUE(peer->Set("j", "xx", "between x and z, not waited for").ok());
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(etcd() ? 200 : 0)));
  ASSERT_TRUE(peer->Set("j", "y", "Y").ok());
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, (std::vector<std::string>{"X", "Y", "Z", "X"}));
}

TEST_P(StoreTest, AKeyDeletedBeforeTheLastOneArrivesIsWaitedForAgain) {
  auto store = Make();
  absl::Notification done;
  absl::StatusOr<std::vector<std::string>> got;
  ASSERT_TRUE(store->Set("j", "a", "1").ok());
  store->WaitAsync("j", {"a", "b"}, In(absl::Seconds(10)), [&](auto r) {
    got = std::move(r);
    done.Notify();
  });
  ASSERT_TRUE(*store->Delete("j", "a"));
  ASSERT_TRUE(store->Set("j", "b", "2").ok());
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(etcd() ? 200 : 0)));
  ASSERT_TRUE(store->Set("j", "a", "3").ok());
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, (std::vector<std::string>{"3", "2"}));
}

TEST_P(StoreTest, AWaitOnManyKeysCompletesWhenTheLastArrives) {
  auto store = Make();
  JobStore* peer = Peer(*store);
  // More keys than a wait reads one by one (it reads their covering range instead).
  std::vector<std::string> keys;
  for (int r = 0; r < 100; ++r) keys.push_back(absl::StrCat("daemon/rank/", r));
  for (int r = 1; r < 100; ++r) ASSERT_TRUE(peer->Set("j", keys[r], absl::StrCat("n", r)).ok());
  absl::Notification done;
  absl::StatusOr<std::vector<std::string>> got;
  store->WaitAsync("j", keys, In(absl::Seconds(10)), [&](auto r) {
    got = std::move(r);
    done.Notify();
  });
  EXPECT_FALSE(done.HasBeenNotified());
  ASSERT_TRUE(peer->Set("j", keys[0], "n0").ok());
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 100u);
  for (int r = 0; r < 100; ++r) EXPECT_EQ((*got)[r], absl::StrCat("n", r));
}

TEST_P(StoreTest, CancelWaitFinishesWithCancelledOnce) {
  auto store = Make();
  std::atomic<int> calls{0};
  absl::Status status;
  const auto id = store->WaitAsync("j", {"k"}, In(absl::Seconds(30)), [&](auto r) {
    status = r.status();
    ++calls;
  });
  store->CancelWait(id);
  store->CancelWait(id);
  ASSERT_TRUE(store->Set("j", "k", "v").ok());
  absl::SleepFor(absl::Milliseconds(etcd() ? 100 : 0));
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled);
}

TEST_P(StoreTest, ShutdownFailsPendingWaitsAndRefusesNewOnes) {
  auto store = Make();
  absl::Notification done;
  absl::Status status;
  store->WaitAsync("j", {"k"}, In(absl::Seconds(30)), [&](auto r) {
    status = r.status();
    done.Notify();
  });
  store->Shutdown();
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(store->Get("j", "k", In(absl::Seconds(1))).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(store->Set("j", "k", "v").code(), absl::StatusCode::kUnavailable);
}

TEST_P(StoreTest, AddIsAnAtomicCounterAcrossThreadsAndDaemons) {
  auto store = Make();
  JobStore* peer = Peer(*store);
  const int threads_n = Scale(8, 4), adds = Scale(1000, 50);
  std::vector<std::thread> threads;
  for (int t = 0; t < threads_n; ++t) {
    threads.emplace_back([&, t] {
      JobStore* s = t % 2 == 0 ? store.get() : peer;
      for (int i = 0; i < adds; ++i) ASSERT_TRUE(s->Add("j", "n", 1).ok());
    });
  }
  for (auto& t : threads) t.join();
  const int total = threads_n * adds;
  EXPECT_EQ(*store->Peek("j", "n"), absl::StrCat(total));
  EXPECT_EQ(*store->Add("j", "n", -total), 0);
  EXPECT_EQ(*store->Add("j", "fresh", 5), 5);
}

TEST_P(StoreTest, AddOnATextValueOrPastInt64IsRefused) {
  auto store = Make();
  ASSERT_TRUE(store->Set("j", "text", "hello").ok());
  EXPECT_EQ(store->Add("j", "text", 1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(*store->Peek("j", "text"), "hello");
  ASSERT_TRUE(store->Set("j", "big", "9223372036854775807").ok());
  EXPECT_EQ(store->Add("j", "big", 1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(*store->Peek("j", "big"), "9223372036854775807");
}

TEST_P(StoreTest, CompareSetSwapsOnlyOnMatch) {
  auto store = Make();
  auto r = store->CompareSet("j", "k", std::nullopt, "first");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->swapped);
  EXPECT_EQ(r->value, "first");
  r = Peer(*store)->CompareSet("j", "k", std::nullopt, "second");
  EXPECT_FALSE(r->swapped);
  EXPECT_EQ(r->value, "first");
  r = store->CompareSet("j", "k", std::string("wrong"), "third");
  EXPECT_FALSE(r->swapped);
  EXPECT_EQ(r->value, "first");
  r = store->CompareSet("j", "k", std::string("first"), "fourth");
  EXPECT_TRUE(r->swapped);
  EXPECT_EQ(*store->Peek("j", "k"), "fourth");
  r = store->CompareSet("j", "absent", std::string(""), "x");  // an absent key equals nothing
  EXPECT_FALSE(r->swapped);
  EXPECT_EQ(r->value, "");
}

TEST_P(StoreTest, OneOfManyRacingCompareSetsWins) {
  auto store = Make();
  JobStore* peer = Peer(*store);
  std::atomic<int> won{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      auto r = (t % 2 ? peer : store.get())->CompareSet("j", "run", std::nullopt, absl::StrCat(t));
      ASSERT_TRUE(r.ok()) << r.status();
      if (r->swapped) ++won;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(won.load(), 1);
}

TEST_P(StoreTest, CompareSetWakesWaiters) {
  auto store = Make();
  absl::Notification done;
  store->WaitAsync("j", {"k"}, In(absl::Seconds(10)), [&](auto) { done.Notify(); });
  ASSERT_TRUE(Peer(*store)->CompareSet("j", "k", std::nullopt, "v").ok());
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
}

TEST_P(StoreTest, ListIsSortedByPrefixAndDeleteRemoves) {
  auto store = Make();
  for (const char* k : {"b/2", "a/1", "b/1", "c"}) ASSERT_TRUE(store->Set("j", k, "v").ok());
  EXPECT_EQ(*store->List("j", "b/"), (std::vector<std::string>{"b/1", "b/2"}));
  EXPECT_EQ(store->List("j", "")->size(), 4u);
  EXPECT_TRUE(*store->Delete("j", "b/1"));
  EXPECT_FALSE(*store->Delete("j", "b/1"));
  EXPECT_EQ(*store->List("j", "b/"), (std::vector<std::string>{"b/2"}));
  EXPECT_EQ(store->List("nobody", "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->Delete("nobody", "k").status().code(), absl::StatusCode::kNotFound);
  auto jobs = store->ListJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_EQ((*jobs)[0].job, "j");
  EXPECT_EQ((*jobs)[0].keys, 3);
  EXPECT_EQ((*jobs)[0].value_bytes, 3);
  auto sizes = store->ListSizes("j", "b/");
  ASSERT_TRUE(sizes.ok()) << sizes.status();
  EXPECT_EQ(*sizes, (std::vector<std::pair<std::string, int64_t>>{{"b/2", 1}}));
}

TEST_P(StoreTest, LimitsAreEnforcedWithClearErrorsAndNothingChanges) {
  MemoryStoreOptions o;
  o.max_key_bytes = 8;
  o.max_value_bytes = 16;
  o.max_keys_per_job = 2;
  o.max_jobs = 2;
  o.max_waiters = 1;
  auto store = Make(o);
  EXPECT_EQ(store->Set("j", "", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Set("", "k", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Set("j/x", "k", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Set("j", "123456789", "v").code(), absl::StatusCode::kInvalidArgument);
  absl::Status big = store->Set("j", "k", std::string(17, 'x'));
  EXPECT_EQ(big.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(big.message(), "store_max_value_bytes")) << big;
  EXPECT_TRUE(store->ListJobs()->empty());
  ASSERT_TRUE(store->Set("j", "k1", "v").ok());
  ASSERT_TRUE(store->Set("j", "k2", "v").ok());
  ASSERT_TRUE(store->Set("j", "k2", "replaced").ok());  // replacing is not a new key
  absl::Status keys = store->Set("j", "k3", "v");
  EXPECT_EQ(keys.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(keys.message(), "store_max_keys_per_job")) << keys;
  EXPECT_EQ(store->CompareSet("j", "k3", std::nullopt, "v").status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store->Add("j", "k3", 1).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(*store->List("j", ""), (std::vector<std::string>{"k1", "k2"}));
  ASSERT_TRUE(store->Set("j2", "k", "v").ok());
  EXPECT_EQ(store->Set("j3", "k", "v").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store->ListJobs()->size(), 2u);
  store->WaitAsync("j", {"w1"}, In(absl::Seconds(10)), [](auto) {});
  EXPECT_EQ(store->Get("j", "w2", In(absl::Seconds(1))).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST_P(StoreTest, AWaitWhoseValuesPassTheReplyLimitIsRefused) {
  MemoryStoreOptions o;
  o.max_reply_bytes = 100;
  auto store = Make(o);
  ASSERT_TRUE(store->Set("j", "a", std::string(60, 'a')).ok());
  ASSERT_TRUE(store->Set("j", "b", std::string(60, 'b')).ok());
  EXPECT_TRUE(store->Get("j", "a", In(absl::Seconds(1))).ok());
  auto both = store->WaitBlocking("j", {"a", "b"}, In(absl::Seconds(1)));
  EXPECT_EQ(both.status().code(), absl::StatusCode::kResourceExhausted) << both.status();
}

TEST_P(StoreTest, ManyConcurrentWaitersAllWakeOnOneSet) {
  auto store = Make();
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 16; ++t) {
    threads.emplace_back([&] {
      auto v = store->Get("j", "go", In(absl::Seconds(10)));
      if (v.ok() && *v == "now") ++ok;
    });
  }
  absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(Peer(*store)->Set("j", "go", "now").ok());
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 16);
}

// Waits start while another daemon writes their keys and others around them: whether a key
// comes before the wait's read, between the read and its watch, or after, every wait gets its
// value, once.
TEST_P(StoreTest, WaitsRacingTheirKeysWritersMissNothing) {
  auto store = Make();
  JobStore* peer = Peer(*store);
  std::atomic<bool> stop{false};
  std::thread noise([&] {
    for (int i = 0; !stop; ++i)
      ASSERT_TRUE(peer->Set("j", absl::StrCat("k/noise", i % 50), "x").ok());
  });
  constexpr int kWaits = 40;
  std::vector<absl::Notification> done(kWaits);
  std::vector<absl::StatusOr<std::vector<std::string>>> got(kWaits);
  std::atomic<int> calls{0};
  std::thread writer([&] {
    for (int i = 0; i < kWaits; ++i)
      ASSERT_TRUE(peer->Set("j", absl::StrCat("k/", i), absl::StrCat("v", i)).ok());
  });
  for (int i = 0; i < kWaits; ++i) {
    store->WaitAsync("j", {absl::StrCat("k/", i), "k/last"}, In(absl::Seconds(20)), [&, i](auto r) {
      got[i] = std::move(r);
      ++calls;
      done[i].Notify();
    });
  }
  writer.join();
  ASSERT_TRUE(peer->Set("j", "k/last", "end").ok());
  for (int i = 0; i < kWaits; ++i) {
    ASSERT_TRUE(done[i].WaitForNotificationWithTimeout(absl::Seconds(20))) << i;
    ASSERT_TRUE(got[i].ok()) << got[i].status();
    EXPECT_EQ(*got[i], (std::vector<std::string>{absl::StrCat("v", i), "end"}));
  }
  stop = true;
  noise.join();
  EXPECT_EQ(calls.load(), kWaits);
}

TEST_P(StoreTest, DeadlinesFireInOrderWhileOthersKeepWaiting) {
  auto store = Make();
  absl::Notification short_done, long_done;
  absl::Status short_status;
  store->WaitAsync("j", {"long"}, In(absl::Seconds(10)), [&](auto r) { long_done.Notify(); });
  store->WaitAsync("j", {"short"}, In(absl::Milliseconds(30)), [&](auto r) {
    short_status = r.status();
    short_done.Notify();
  });
  ASSERT_TRUE(short_done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(short_status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(long_done.HasBeenNotified());
  ASSERT_TRUE(store->Set("j", "long", "v").ok());
  EXPECT_TRUE(long_done.WaitForNotificationWithTimeout(absl::Seconds(5)));
}

TEST_P(StoreTest, AJobThatEndedIsGoneOnceNoDaemonHoldsIt) {
  auto store = Make();
  JobStore* peer = Peer(*store);
  ASSERT_TRUE(store->Set("j", "a", "1").ok());
  ASSERT_TRUE(peer->Set("j", "b", "2").ok());
  ASSERT_TRUE(store->Set("other", "k", "v").ok());
  store->DeleteJob("j");
  if (etcd()) {  // the peer still holds the job: its keys stay
    absl::SleepFor(absl::Milliseconds(300));
    EXPECT_EQ(*store->List("j", ""), (std::vector<std::string>{"a", "b"}));
    peer->DeleteJob("j");
  }
  absl::StatusOr<std::vector<std::string>> left;
  for (const absl::Time until = In(absl::Seconds(10)); absl::Now() < until;) {
    left = store->List("j", "");
    if (!left.ok()) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(left.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*store->Peek("other", "k"), "v");
  // The same job id again starts from nothing.
  ASSERT_TRUE(peer->Set("j", "c", "3").ok());
  EXPECT_EQ(*store->List("j", ""), (std::vector<std::string>{"c"}));
}

INSTANTIATE_TEST_SUITE_P(Backends, StoreTest,
                         ::testing::Values(Backend::kEmbedded, Backend::kEtcd,
                                           Backend::kEtcd3Members),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           switch (info.param) {
                             case Backend::kEmbedded:
                               return "Embedded";
                             case Backend::kEtcd:
                               return "Etcd";
                             case Backend::kEtcd3Members:
                               return "Etcd3Members";
                           }
                           return "Unknown";
                         });

// ---- What only the etcd store does ----------------------------------------------------------

class EtcdStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = EtcdCluster::Unavailable(); !why.empty()) GTEST_SKIP() << why;
  }
};

// A pending wait watches through one member; that member is killed (SIGKILL), and the value
// set through another member still reaches the wait. Calls go on through the survivors, and the
// job's lease keeps being renewed: its keys are still there after more than a TTL.
TEST_F(EtcdStoreTest, AMemberKilledUnderAPendingWaitIsNotNoticed) {
  auto cluster = EtcdCluster::Start(3);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string prefix = FreshPrefix();
  EtcdOptions o = EtcdOptionsFor((*cluster)->endpoints(), prefix);
  o.lease_ttl = absl::Seconds(2);
  EtcdStore store(o);  // member 0 first
  EtcdStore writer(EtcdOptionsFor({(*cluster)->endpoint(2), (*cluster)->endpoint(1)}, prefix));
  ASSERT_TRUE(store.Set("j", "before", "1").ok());
  absl::Notification done;
  absl::StatusOr<std::vector<std::string>> got;
  store.WaitAsync("j", {"after"}, In(absl::Seconds(30)), [&](auto r) {
    got = std::move(r);
    done.Notify();
  });
  absl::SleepFor(absl::Milliseconds(200));  // the watch is created on member 0
  (*cluster)->Kill(0);
  ASSERT_TRUE(writer.Set("j", "after", "2").ok());
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->front(), "2");
  ASSERT_TRUE(store.Set("j", "later", "3").ok());
  EXPECT_EQ(*store.Add("j", "n", 2), 2);
  absl::SleepFor(absl::Seconds(3));  // past the lease's TTL: renewed through the survivors
  EXPECT_EQ(*writer.Peek("j", "before"), "1");
}

// No member answers (nothing listens on the port): every call fails Unavailable naming etcd
// and the endpoint within the call timeout, and a pending wait does not sit out its deadline.
TEST_F(EtcdStoreTest, AnUnreachableClusterFailsCallsQuicklyNamingIt) {
  const int port = 1;  // nothing listens on loopback port 1
  EtcdOptions o = EtcdOptionsFor({absl::StrCat("127.0.0.1:", port)}, FreshPrefix());
  o.rpc_timeout = absl::Seconds(1);
  EtcdStore store(o);
  const std::string name = absl::StrCat("etcd 127.0.0.1:", port);
  absl::Time start = absl::Now();
  absl::Status set = store.Set("j", "k", "v");
  EXPECT_EQ(set.code(), absl::StatusCode::kUnavailable) << set;
  EXPECT_TRUE(absl::StrContains(set.message(), name)) << set;
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  start = absl::Now();
  auto got = store.Get("j", "k", In(absl::Seconds(60)));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_TRUE(absl::StrContains(got.status().message(), name)) << got.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_EQ(store.Probe(absl::Milliseconds(300)).code(), absl::StatusCode::kUnavailable);
}

// etcd goes away under a pending wait: the wait fails Unavailable naming etcd once no member
// has answered for the call timeout, long before its own deadline.
TEST_F(EtcdStoreTest, AWaitFailsWhenEtcdIsGoneForTheCallTimeout) {
  auto cluster = EtcdCluster::Start(1);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  EtcdOptions o = EtcdOptionsFor((*cluster)->endpoints(), FreshPrefix());
  o.rpc_timeout = absl::Seconds(1);
  EtcdStore store(o);
  absl::Notification done;
  absl::Status status;
  store.WaitAsync("j", {"never"}, In(absl::Seconds(60)), [&](auto r) {
    status = r.status();
    done.Notify();
  });
  absl::SleepFor(absl::Milliseconds(200));
  const absl::Time start = absl::Now();
  (*cluster)->Kill(0);
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(15)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "etcd " + (*cluster)->endpoint(0))) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "missing keys: never")) << status;
}

// The embedded store's own bounds: bytes per job and in all, jobs that go with their last key,
// and idle jobs no session holds.

TEST(MemoryStoreBoundsTest, AJobPastItsByteQuotaIsRefusedNamingTheFlagAndNothingChanges) {
  MemoryStoreOptions o;
  o.max_job_bytes = 100;
  MemoryStore store(o);
  ASSERT_TRUE(store.Set("j", "a", std::string(60, 'x')).ok());  // 61 bytes with its key
  absl::Status over = store.Set("j", "b", std::string(40, 'x'));
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(over.message(), "--store_max_job_bytes")) << over;
  EXPECT_EQ(store.CompareSet("j", "a", std::string(60, 'x'), std::string(100, 'y')).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(*store.Peek("j", "a"), std::string(60, 'x'));
  EXPECT_EQ(*store.List("j", ""), std::vector<std::string>{"a"});
  EXPECT_EQ(store.total_bytes(), 61);
  ASSERT_TRUE(store.Set("j", "a", "small").ok());  // shrinking makes room
  EXPECT_TRUE(store.Set("j", "b", std::string(40, 'x')).ok());
  EXPECT_EQ(store.total_bytes(), 6 + 41);
  EXPECT_TRUE(store.Set("other", "b", std::string(90, 'x')).ok());  // a quota per job
}

TEST(MemoryStoreBoundsTest, TheStoresTotalBytesAreCappedAcrossJobs) {
  MemoryStoreOptions o;
  o.max_total_bytes = 1000;  // clients' keys: at most 875 bytes of it
  MemoryStore store(o);
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(store.Set(absl::StrCat("job", i), "k", std::string(99, 'x')).ok());
  }
  EXPECT_EQ(store.total_bytes(), 800);
  absl::Status full = store.Set("job8", "k", std::string(99, 'x'));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(full.message(), "--store_max_total_bytes")) << full;
  EXPECT_EQ(store.ListJobs()->size(), 8u);  // the refused job was not made
  // The daemons' keys still fit: clients cannot fill what formation needs.
  EXPECT_TRUE(store.Set("job8", "daemon/run", std::string(150, 'x')).ok());
  EXPECT_EQ(store.Set("job8", "daemon/rank/0", std::string(100, 'x')).code(),
            absl::StatusCode::kResourceExhausted);  // past the whole store
  ASSERT_TRUE(*store.Delete("job0", "k"));
  store.DeleteJob("job8");
  EXPECT_TRUE(store.Set("job9", "k", std::string(99, 'x')).ok());
  store.DeleteJob("job1");
  EXPECT_EQ(store.total_bytes(), 700);
}

TEST(MemoryStoreBoundsTest, AJobWhoseLastKeyIsDeletedIsGoneAndTakesNoJobsPlace) {
  MemoryStoreOptions o;
  o.max_jobs = 4;
  MemoryStore store(o);
  for (int i = 0; i < 100; ++i) {  // far more empty namespaces than the store may hold jobs
    const std::string job = absl::StrCat("empty", i);
    ASSERT_TRUE(store.Set(job, "k", "v").ok()) << i;
    ASSERT_TRUE(*store.Delete(job, "k"));
  }
  EXPECT_TRUE(store.ListJobs()->empty());
  EXPECT_EQ(store.total_bytes(), 0);
  EXPECT_TRUE(store.Set("real", "k", "v").ok());
}

TEST(MemoryStoreBoundsTest, AnIdleJobNoSessionHoldsIsRemovedAndAHeldOneStays) {
  MemoryStoreOptions o;
  o.idle_job_ttl = absl::Milliseconds(100);
  MemoryStore store(o);
  store.SetHolder([](absl::string_view job) { return job == "held"; });
  ASSERT_TRUE(store.Set("held", "k", "v").ok());
  ASSERT_TRUE(store.Set("idle", "k", "v").ok());
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (store.Peek("idle", "k").ok() && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(store.Peek("idle", "k").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*store.Peek("held", "k"), "v");  // idle as long, but held
  EXPECT_EQ(store.total_bytes(), 2);
  store.SetHolder(nullptr);  // nothing held: it goes too
  const absl::Time until2 = absl::Now() + absl::Seconds(10);
  while (store.Peek("held", "k").ok() && absl::Now() < until2) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(store.Peek("held", "k").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.total_bytes(), 0);
}

TEST(MemoryStoreBoundsTest, AJobInUseIsNotRemovedForIdleness) {
  MemoryStoreOptions o;
  o.idle_job_ttl = absl::Seconds(1);
  MemoryStore store(o);
  ASSERT_TRUE(store.Set("busy", "k", "v").ok());
  // Named by a call every 30 ms for 3 s, three ttls: never idle for one.
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(store.Get("busy", "k", absl::InfinitePast()).ok()) << i;
    absl::SleepFor(absl::Milliseconds(30));
  }
}

}  // namespace
}  // namespace gradsync::store
