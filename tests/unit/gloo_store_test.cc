// Gloo over gradsync's store: real Gloo contexts (TCP transport on loopback) rendezvous through
// the adapter over a MemoryStore and run an all-reduce with a reduce function of ours.

#include "daemon/backend/cpu/gloo_store.h"

#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "daemon/store/memory_store.h"
#include "gloo/allreduce.h"
#include "gloo/common/error.h"
#include "gloo/rendezvous/context.h"
#include "gloo/transport/tcp/device.h"
#include "gtest/gtest.h"

namespace gradsync::backend::cpu {
namespace {

TEST(GlooStoreTest, ThreeRanksRendezvousAndAllReduce) {
  store::MemoryStore memory;
  constexpr int kRanks = 3;
  constexpr size_t kCount = 100003;
  std::vector<std::vector<float>> data(kRanks, std::vector<float>(kCount));
  std::vector<std::thread> threads;
  std::vector<std::string> errors(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      try {
        GlooStore store(&memory, "job", "gloo/world/", absl::Seconds(20));
        ::gloo::transport::tcp::attr attr;
        attr.hostname = "127.0.0.1";
        auto device = ::gloo::transport::tcp::CreateDevice(attr);
        auto context = std::make_shared<::gloo::rendezvous::Context>(r, kRanks);
        context->setTimeout(std::chrono::seconds(20));
        context->connectFullMesh(store, device);
        for (size_t i = 0; i < kCount; ++i) data[r][i] = static_cast<float>((r + 1) * (i % 9));
        ::gloo::AllreduceOptions opts(context);
        opts.setOutput(data[r].data(), kCount);
        opts.setReduceFunction([](void* c, const void* a, const void* b, size_t n) {
          auto* out = static_cast<float*>(c);
          auto* x = static_cast<const float*>(a);
          auto* y = static_cast<const float*>(b);
          for (size_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
        });
        ::gloo::allreduce(opts);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    for (size_t i = 0; i < kCount; ++i) ASSERT_EQ(data[r][i], 6.0f * (i % 9)) << r << " " << i;
  }
}

TEST(GlooStoreTest, WaitsAreBoundedAndFailAsGlooExceptions) {
  store::MemoryStore memory;
  GlooStore store(&memory, "job", "p/", absl::Milliseconds(200));
  store.set("a", {'x', 'y'});
  EXPECT_EQ(store.get("a"), (std::vector<char>{'x', 'y'}));
  const absl::Time start = absl::Now();
  try {
    store.wait({"a", "never"}, std::chrono::milliseconds(100));
    FAIL() << "wait for a missing key returned";
  } catch (const ::gloo::IoException& e) {
    EXPECT_TRUE(absl::StrContains(e.what(), "p/never")) << e.what();
  }
  EXPECT_THROW(store.get("never"), ::gloo::IoException);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

}  // namespace
}  // namespace gradsync::backend::cpu
