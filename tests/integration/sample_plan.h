#pragma once

#include "absl/status/statusor.h"
#include "common/pack_list.h"

namespace gradsync::testing {

/// A fixed plan over mixed dtypes (what a small model's rank 0 would compute), shared by the
/// processes of the pack-list tests so each can check what the others saw.
inline absl::StatusOr<v1::PackList> SamplePlan() {
  std::vector<GradInfo> grads;
  const v1::DType dtypes[] = {v1::FLOAT32, v1::FLOAT16, v1::FLOAT32, v1::BFLOAT16, v1::FLOAT32};
  for (int i = 0; i < 10; ++i) {
    GradInfo g;
    g.index = 9 - i;  // backward order: last layer first
    g.spec.add_shape(64 * (i + 1));
    g.spec.add_shape(3);
    g.spec.set_dtype(dtypes[i % 5]);
    grads.push_back(g);
  }
  PackOptions options;
  options.threshold_bytes = 4096;
  options.first_alone = 1;
  return PlanPacks(grads, options);
}

}  // namespace gradsync::testing
