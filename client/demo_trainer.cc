// gradsync-demo-trainer: one rank of the main job's demo (./setup.sh demo).
//
// What a data-parallel trainer does with its node's daemon, the way the reference optimizer
// (MegEngine's DistributedOptimizer) does it:
//   1. join the job through the rendezvous store; rank 0 computes the pack plan of its model (a
//      small MLP's gradients in backward order) and publishes it, the others fetch it, and
//      rank 0 checks that every rank holds the same plan;
//   2. open a session with the daemon, put parameters and gradients in shared memory it maps;
//   3. broadcast the parameters from rank 0 (bcast_period 0), one fused op per pack;
//   4. a few steps of "backward": gradients appear in backward order and each pack's fused
//      all-reduce (mean) is issued as soon as its last member is ready, overlapping the rest;
//      every value is checked;
//   5. report done and wait until the operator releases the job (so ./setup.sh demo can show
//      the sessions and the pack plan while they exist).
//
//   gradsync-demo-trainer --socket=PATH --job=J --rank=R --world_size=W

#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/gradsync_client.h"
#include "client/store_client.h"
#include "common/pack_list.h"

ABSL_FLAG(std::string, socket, "/run/gradsync/gradsyncd.sock", "Daemon socket");
ABSL_FLAG(std::string, job, "demo", "Job id");
ABSL_FLAG(int, rank, 0, "This trainer's rank");
ABSL_FLAG(int, world_size, 1, "Number of ranks");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(30), "Deadline of every wait");
ABSL_FLAG(int, steps, 3, "Training steps to run");
ABSL_FLAG(absl::Duration, release_timeout, absl::Seconds(60),
          "How long to wait for the operator's 'released' key before leaving anyway");

namespace {

// Gradients of an MLP 784-1024-1024-10 with float32 weights, bf16 embeddings and a LayerNorm,
// in the order backward produces them (last layer first).
std::vector<gradsync::GradInfo> ModelGradients() {
  struct Param {
    std::vector<int64_t> shape;
    gradsync::v1::DType dtype;
  };
  const std::vector<Param> params = {
      {{32000, 64}, gradsync::v1::BFLOAT16},  // 0 embedding
      {{1024, 784}, gradsync::v1::FLOAT32},   // 1 fc1.weight
      {{1024}, gradsync::v1::FLOAT32},        // 2 fc1.bias
      {{1024}, gradsync::v1::FLOAT32},        // 3 norm.weight
      {{1024}, gradsync::v1::FLOAT32},        // 4 norm.bias
      {{1024, 1024}, gradsync::v1::FLOAT32},  // 5 fc2.weight
      {{1024}, gradsync::v1::FLOAT32},        // 6 fc2.bias
      {{10, 1024}, gradsync::v1::FLOAT32},    // 7 head.weight
      {{10}, gradsync::v1::FLOAT32},          // 8 head.bias
  };
  std::vector<gradsync::GradInfo> grads;
  for (int i = static_cast<int>(params.size()) - 1; i >= 0; --i) {
    gradsync::GradInfo g;
    g.index = i;
    for (int64_t d : params[i].shape) g.spec.add_shape(d);
    g.spec.set_dtype(params[i].dtype);
    grads.push_back(g);
  }
  return grads;
}

// Small integers, exact in float32 and bfloat16 (the model's dtypes).
void Put(gradsync::v1::DType dtype, std::byte* base, int64_t i, float v) {
  if (dtype == gradsync::v1::BFLOAT16) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    const uint16_t b = static_cast<uint16_t>(u >> 16);  // exact for these values
    std::memcpy(base + 2 * i, &b, 2);
  } else {
    std::memcpy(base + 4 * i, &v, 4);
  }
}
float Get(gradsync::v1::DType dtype, const std::byte* base, int64_t i) {
  if (dtype == gradsync::v1::BFLOAT16) {
    uint16_t b;
    std::memcpy(&b, base + 2 * i, 2);
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    return v;
  }
  float v;
  std::memcpy(&v, base + 4 * i, 4);
  return v;
}
float Pattern(int64_t i) { return static_cast<float>(i % 5 + 1); }

int Fail(const std::string& what, const absl::Status& s) {
  std::cerr << "demo-trainer rank=" << absl::GetFlag(FLAGS_rank) << ": " << what << ": " << s
            << "\n";
  return 1;
}

// Rendezvous through the store, then one pack plan on every rank: rank 0 plans and publishes
// it, the others fetch it (the reference optimizer's get_pack_list / set_pack_list), and rank 0
// checks that every rank reports the same bytes.
absl::StatusOr<gradsync::v1::PackList> AgreeOnPlan(gradsync::client::StoreClient& store,
                                                   const std::string& job, int rank, int world,
                                                   absl::Time deadline) {
  auto failed = [](absl::string_view stage, const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(stage, ": ", s.message()));
  };
  if (absl::Status s = store.Set(job, absl::StrCat("rank/", rank), "up"); !s.ok()) {
    return failed("announce", s);
  }
  std::vector<std::string> everyone;
  for (int r = 0; r < world; ++r) everyone.push_back(absl::StrCat("rank/", r));
  if (absl::Status s = store.Wait(job, everyone, deadline); !s.ok()) {
    return failed("rendezvous", s);
  }
  gradsync::v1::PackList plan;
  if (rank == 0) {
    gradsync::PackOptions options;
    options.threshold_bytes = 4 << 20;
    options.first_alone = 1;
    auto planned = gradsync::PlanPacks(ModelGradients(), options);
    if (!planned.ok()) return failed("plan", planned.status());
    plan = *planned;
    if (absl::Status s = store.SetPackList(job, "world", plan); !s.ok()) {
      return failed("publish", s);
    }
  } else {
    auto fetched = store.GetPackList(job, "world", deadline);
    if (!fetched.ok()) return failed("fetch plan", fetched.status());
    plan = *fetched;
  }
  if (absl::Status s = store.Set(job, absl::StrCat("plan/", rank), plan.SerializeAsString());
      !s.ok()) {
    return failed("report", s);
  }
  if (rank != 0) return plan;
  for (int r = 0; r < world; ++r) {
    const std::string key = absl::StrCat("plan/", r);
    auto other = store.Get(job, key, deadline);
    if (!other.ok()) return failed("collect", other.status());
    if (*other != plan.SerializeAsString()) {
      return absl::DataLossError(absl::StrCat("check: ", key, " differs from rank 0's plan"));
    }
  }
  std::cout << "demo: " << world << " ranks agree on a plan of " << plan.packs_size()
            << " packs; parameters are broadcast from rank 0\n";
  return plan;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string job = absl::GetFlag(FLAGS_job);
  const int rank = absl::GetFlag(FLAGS_rank);
  const int world = absl::GetFlag(FLAGS_world_size);
  const absl::Time deadline = absl::Now() + absl::GetFlag(FLAGS_timeout);
  gradsync::client::StoreClient store(gradsync::client::Connect(absl::GetFlag(FLAGS_socket)));

  absl::StatusOr<gradsync::v1::PackList> agreed = AgreeOnPlan(store, job, rank, world, deadline);
  if (!agreed.ok()) return Fail("plan", agreed.status());
  const gradsync::v1::PackList& plan = *agreed;

  // A session with the daemon; parameters and gradients in shared memory it maps once.
  gradsync::client::Placement placement{job, world, rank, rank, world, ""};
  auto session = gradsync::client::Client::Connect(absl::GetFlag(FLAGS_socket), placement);
  if (!session.ok()) return Fail("register", session.status());
  gradsync::client::Client& client = **session;
  const std::vector<gradsync::GradInfo> grads = ModelGradients();
  std::map<int, int64_t> offset, count;  // by parameter index, bytes / elements
  std::map<int, gradsync::v1::DType> dtype;
  int64_t total = 0;
  for (const gradsync::GradInfo& g : grads) {
    auto n = gradsync::NumElements(g.spec.shape());
    if (!n.ok()) return Fail("shape", n.status());
    offset[g.index] = total;
    count[g.index] = *n;
    dtype[g.index] = g.spec.dtype();
    total += (*n * gradsync::DTypeSize(g.spec.dtype()) + 63) / 64 * 64;
  }
  auto params = client.CreateBuffer(total);
  auto grad_buf = client.CreateBuffer(total);
  if (!params.ok()) return Fail("params buffer", params.status());
  if (!grad_buf.ok()) return Fail("gradient buffer", grad_buf.status());
  auto segments = [&](const gradsync::v1::Pack& pack, const gradsync::client::SharedBuffer& b) {
    std::vector<gradsync::client::Segment> out;
    for (int index : pack.indices()) out.push_back({b.id(), offset[index], count[index]});
    return out;
  };
  auto check = [&](const gradsync::client::SharedBuffer& b, const std::string& what,
                   const std::function<float(int, int64_t)>& want) -> absl::Status {
    for (const auto& [index, n] : count) {
      for (int64_t i = 0; i < n; ++i) {
        const float got = Get(dtype[index], b.data() + offset[index], i);
        if (got != want(index, i)) {
          return absl::DataLossError(absl::StrCat(what, ": parameter ", index, " element ", i,
                                                  " is ", got, ", want ", want(index, i)));
        }
      }
    }
    return absl::OkStatus();
  };

  // Parameters: rank 0's values everywhere, one fused broadcast per pack.
  for (const auto& [index, n] : count) {
    for (int64_t i = 0; i < n; ++i) {
      Put(dtype[index], (*params)->data() + offset[index], i, rank == 0 ? Pattern(i + index) : 0);
    }
  }
  std::vector<gradsync::client::Op> ops;
  for (const gradsync::v1::Pack& pack : plan.packs()) {
    ops.push_back(client.BroadcastAsync(pack.dtype(), 0, segments(pack, **params)));
  }
  for (auto& op : ops) {
    if (absl::Status s = op.Wait(); !s.ok()) return Fail("broadcast", s);
  }
  if (absl::Status s =
          check(**params, "broadcast", [](int index, int64_t i) { return Pattern(i + index); });
      !s.ok()) {
    return Fail("broadcast", s);
  }

  // Steps: gradients appear in backward order; a pack's all-reduce starts with its last member.
  std::map<int, int> pack_of;
  std::vector<int> remaining;
  for (int p = 0; p < plan.packs_size(); ++p) {
    for (int index : plan.packs(p).indices()) pack_of[index] = p;
  }
  const float mean_factor = (world + 1) / 2.0f;  // mean of (r + 1) over the ranks
  for (int step = 1; step <= absl::GetFlag(FLAGS_steps); ++step) {
    const absl::Time start = absl::Now();
    ops.clear();
    remaining.clear();
    for (const gradsync::v1::Pack& pack : plan.packs()) remaining.push_back(pack.indices_size());
    for (const gradsync::GradInfo& g : grads) {  // backward order
      std::byte* base = (*grad_buf)->data() + offset[g.index];
      for (int64_t i = 0; i < count[g.index]; ++i) {
        Put(dtype[g.index], base, i, static_cast<float>((rank + 1) * step) * Pattern(i));
      }
      const int p = pack_of[g.index];
      if (--remaining[p] == 0) {
        gradsync::client::OpOptions options;
        options.name = absl::StrCat("pack", p);
        ops.push_back(client.AllReduceAsync(plan.packs(p).dtype(), gradsync::v1::MEAN,
                                            segments(plan.packs(p), **grad_buf), options));
      }
    }
    for (auto& op : ops) {
      if (absl::Status s = op.Wait(); !s.ok()) return Fail("all-reduce", s);
    }
    const absl::Duration took = absl::Now() - start;
    if (absl::Status s = check(**grad_buf, absl::StrCat("step ", step),
                               [&](int, int64_t i) { return mean_factor * step * Pattern(i); });
        !s.ok()) {
      return Fail("gradients", s);
    }
    if (rank == 0) {
      std::cout << "demo: step " << step << ": " << ops.size() << " fused all-reduces (mean) over "
                << total / (1 << 20) << " MiB of gradients in " << absl::FormatDuration(took)
                << ", every value checked\n";
    }
  }

  if (auto done = store.Add(job, "done", 1); !done.ok()) return Fail("finish", done.status());
  // Stay attached until the operator has looked (bounded); leaving then ends the job.
  (void)store.Wait(job, {"released"}, absl::Now() + absl::GetFlag(FLAGS_release_timeout));
  return 0;
}
