#include "common/pack_list.h"

#include <vector>

#include "absl/time/time.h"
#include "daemon/store/memory_store.h"
#include "gtest/gtest.h"

namespace gradsync {
namespace {

GradInfo Grad(int32_t index, std::vector<int64_t> shape, v1::DType dtype) {
  GradInfo g;
  g.index = index;
  for (int64_t d : shape) g.spec.add_shape(d);
  g.spec.set_dtype(dtype);
  return g;
}

PackOptions Threshold(int64_t bytes, int32_t first_alone = 0) {
  PackOptions o;
  o.threshold_bytes = bytes;
  o.first_alone = first_alone;
  return o;
}

// Packs as (dtype, indices, bytes) for compact expectations.
struct P {
  v1::DType dtype;
  std::vector<int32_t> indices;
  int64_t bytes;
};

void ExpectPlan(const v1::PackList& plan, const std::vector<P>& want) {
  ASSERT_EQ(plan.packs_size(), static_cast<int>(want.size())) << plan.DebugString();
  for (size_t i = 0; i < want.size(); ++i) {
    const v1::Pack& got = plan.packs(static_cast<int>(i));
    EXPECT_EQ(got.dtype(), want[i].dtype) << "pack " << i;
    EXPECT_EQ(std::vector<int32_t>(got.indices().begin(), got.indices().end()), want[i].indices)
        << "pack " << i;
    EXPECT_EQ(got.bytes(), want[i].bytes) << "pack " << i;
    EXPECT_EQ(got.shapes_size(), got.indices_size());
  }
  EXPECT_TRUE(ValidatePackList(plan).ok());
}

TEST(PlanPacksTest, EmptyInputGivesNoPacks) {
  auto plan = PlanPacks({}, Threshold(100));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->packs_size(), 0);
  EXPECT_EQ(plan->threshold_bytes(), 100);
}

TEST(PlanPacksTest, MixedDtypesArePackedSeparatelyInBackwardOrder) {
  // threshold 100 B. f32[10] = 40 B, f16[10] = 20 B, f16[30] = 60 B.
  // f32: 40, 80, 120 > 100 -> closes [5,3,2] at 120 B; f16: 20 + 60 = 80, flushed at the end.
  auto plan =
      PlanPacks({Grad(5, {10}, v1::FLOAT32), Grad(4, {10}, v1::FLOAT16), Grad(3, {10}, v1::FLOAT32),
                 Grad(2, {10}, v1::FLOAT32), Grad(1, {30}, v1::FLOAT16)},
                Threshold(100));
  ASSERT_TRUE(plan.ok()) << plan.status();
  ExpectPlan(*plan, {{v1::FLOAT32, {5, 3, 2}, 120}, {v1::FLOAT16, {4, 1}, 80}});
  EXPECT_EQ(plan->packs(0).shapes(0).shape(0), 10);
}

TEST(PlanPacksTest, PackClosesOnlyWhenBytesExceedTheThresholdSoItOvershootsByOneTensor) {
  // 100 B is not over 100: the pack stays open; the next 4 B tensor pushes it to 104 and closes it.
  auto plan =
      PlanPacks({Grad(0, {25}, v1::FLOAT32), Grad(1, {1}, v1::FLOAT32), Grad(2, {1}, v1::FLOAT32)},
                Threshold(100));
  ASSERT_TRUE(plan.ok());
  ExpectPlan(*plan, {{v1::FLOAT32, {0, 1}, 104}, {v1::FLOAT32, {2}, 4}});
}

TEST(PlanPacksTest, TensorLargerThanTheThresholdGoesAloneAndTheNextStartsANewPack) {
  auto plan = PlanPacks(
      {Grad(7, {4}, v1::FLOAT64), Grad(6, {10, 10}, v1::FLOAT64), Grad(5, {2}, v1::FLOAT64)},
      Threshold(100));
  ASSERT_TRUE(plan.ok());
  // 32 B, then 800 B -> 832 > 100 closes [7,6]; [5] alone at the end.
  ExpectPlan(*plan, {{v1::FLOAT64, {7, 6}, 832}, {v1::FLOAT64, {5}, 16}});
  auto alone = PlanPacks({Grad(0, {1000}, v1::FLOAT32), Grad(1, {1}, v1::FLOAT32)}, Threshold(100));
  ASSERT_TRUE(alone.ok());
  ExpectPlan(*alone, {{v1::FLOAT32, {0}, 4000}, {v1::FLOAT32, {1}, 4}});
}

TEST(PlanPacksTest, FirstGradientsCanGoAlone) {
  auto plan = PlanPacks({Grad(3, {1}, v1::FLOAT32), Grad(2, {1}, v1::FLOAT32),
                         Grad(1, {1}, v1::FLOAT32), Grad(0, {1}, v1::FLOAT32)},
                        Threshold(100, /*first_alone=*/2));
  ASSERT_TRUE(plan.ok());
  ExpectPlan(*plan, {{v1::FLOAT32, {3}, 4}, {v1::FLOAT32, {2}, 4}, {v1::FLOAT32, {1, 0}, 8}});
  EXPECT_EQ(plan->first_alone(), 2);
}

TEST(PlanPacksTest, OpenPacksAreFlushedByDtypeNameAndScalarsCountOneElement) {
  auto plan =
      PlanPacks({Grad(0, {2}, v1::INT64), Grad(1, {}, v1::FLOAT32), Grad(2, {3}, v1::BFLOAT16),
                 Grad(3, {1}, v1::FLOAT16), Grad(4, {0, 5}, v1::FLOAT32)},
                Threshold(1 << 20));
  ASSERT_TRUE(plan.ok());
  ExpectPlan(*plan, {{v1::BFLOAT16, {2}, 6},
                     {v1::FLOAT16, {3}, 2},
                     {v1::FLOAT32, {1, 4}, 4},
                     {v1::INT64, {0}, 16}});
}

TEST(PlanPacksTest, DefaultThresholdIsTenMiB) {
  // 10 MiB of float32 exactly does not close; one more element does.
  auto plan = PlanPacks({Grad(0, {10 << 20 >> 2}, v1::FLOAT32), Grad(1, {1}, v1::FLOAT32),
                         Grad(2, {1}, v1::FLOAT32)});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->threshold_bytes(), 10 << 20);
  ExpectPlan(*plan, {{v1::FLOAT32, {0, 1}, (10 << 20) + 4}, {v1::FLOAT32, {2}, 4}});
}

TEST(PlanPacksTest, BadInputIsInvalidArgument) {
  EXPECT_EQ(PlanPacks({Grad(0, {1}, v1::FLOAT32)}, Threshold(0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanPacks({Grad(0, {1}, v1::FLOAT32)}, Threshold(10, -1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanPacks({Grad(0, {1}, v1::FLOAT32), Grad(0, {1}, v1::FLOAT32)}, Threshold(10))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanPacks({Grad(0, {1}, v1::DTYPE_UNSPECIFIED)}, Threshold(10)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanPacks({Grad(0, {-1}, v1::FLOAT32)}, Threshold(10)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanPacks({Grad(-2, {1}, v1::FLOAT32)}, Threshold(10)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanPacks({Grad(0, {int64_t{1} << 62, 8}, v1::FLOAT32)}, Threshold(10)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ValidatePackListTest, CatchesInconsistentPlans) {
  auto plan = PlanPacks({Grad(0, {4}, v1::FLOAT32), Grad(1, {4}, v1::FLOAT16)}, Threshold(8));
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(ValidatePackList(*plan).ok());
  v1::PackList bad = *plan;
  bad.mutable_packs(0)->set_bytes(3);
  EXPECT_EQ(ValidatePackList(bad).code(), absl::StatusCode::kInvalidArgument);
  bad = *plan;
  bad.mutable_packs(0)->set_dtype(v1::FLOAT64);
  EXPECT_EQ(ValidatePackList(bad).code(), absl::StatusCode::kInvalidArgument);
  bad = *plan;
  bad.mutable_packs(1)->set_indices(0, 0);
  EXPECT_EQ(ValidatePackList(bad).code(), absl::StatusCode::kInvalidArgument);
  bad = *plan;
  bad.mutable_packs(1)->clear_shapes();
  EXPECT_EQ(ValidatePackList(bad).code(), absl::StatusCode::kInvalidArgument);
  bad = *plan;
  bad.add_packs();
  EXPECT_EQ(ValidatePackList(bad).code(), absl::StatusCode::kInvalidArgument);
}

TEST(PackListStoreTest, PutThenFetchRoundTripsPerGroupAndJob) {
  store::MemoryStore store;
  auto plan = PlanPacks({Grad(0, {4}, v1::FLOAT32)}, Threshold(8));
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(PutPackList(store, "j", "0,1", *plan).ok());
  auto back = FetchPackList(store, "j", "0,1", absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), plan->SerializeAsString());
  auto other_group = FetchPackList(store, "j", "0,2", absl::Now() + absl::Milliseconds(20));
  EXPECT_EQ(other_group.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(other_group.status().message().find("_gradsync/packlist/0,2"), absl::string_view::npos);
  EXPECT_EQ(FetchPackList(store, "other", "0,1", absl::Now()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(store.Set("j", PackListKey("world"), "not a proto \xff\xff").ok());
  EXPECT_EQ(FetchPackList(store, "j", "world", absl::Now()).status().code(),
            absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace gradsync
