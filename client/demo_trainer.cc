// gradsync-demo-trainer: one rank of the main job's demo (./setup.sh demo).
//
// What a trainer does with the daemon today: join the job through the rendezvous store, let
// rank 0 compute the pack plan of its model (a small MLP's gradients in backward order) and
// publish it, fetch it on the other ranks, and check that every rank holds the same plan.
//
//   gradsync-demo-trainer --socket=PATH --job=J --rank=R --world_size=W

#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/store_client.h"
#include "common/pack_list.h"

ABSL_FLAG(std::string, socket, "/run/gradsync/gradsyncd.sock", "Daemon socket");
ABSL_FLAG(std::string, job, "demo", "Job id");
ABSL_FLAG(int, rank, 0, "This trainer's rank");
ABSL_FLAG(int, world_size, 1, "Number of ranks");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(30), "Deadline of every wait");

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

int Fail(const std::string& what, const absl::Status& s) {
  std::cerr << "demo-trainer rank=" << absl::GetFlag(FLAGS_rank) << ": " << what << ": " << s
            << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string job = absl::GetFlag(FLAGS_job);
  const int rank = absl::GetFlag(FLAGS_rank);
  const int world = absl::GetFlag(FLAGS_world_size);
  const absl::Time deadline = absl::Now() + absl::GetFlag(FLAGS_timeout);
  gradsync::client::StoreClient store(gradsync::client::Connect(absl::GetFlag(FLAGS_socket)));

  // Rendezvous: everyone announces itself, then waits for all.
  if (absl::Status s = store.Set(job, absl::StrCat("rank/", rank), "up"); !s.ok()) {
    return Fail("announce", s);
  }
  std::vector<std::string> everyone;
  for (int r = 0; r < world; ++r) everyone.push_back(absl::StrCat("rank/", r));
  if (absl::Status s = store.Wait(job, everyone, deadline); !s.ok()) return Fail("rendezvous", s);

  // Rank 0 plans, the others fetch (the reference optimizer's get_pack_list / set_pack_list).
  gradsync::v1::PackList plan;
  if (rank == 0) {
    gradsync::PackOptions options;
    options.threshold_bytes = 4 << 20;
    options.first_alone = 1;
    auto planned = gradsync::PlanPacks(ModelGradients(), options);
    if (!planned.ok()) return Fail("plan", planned.status());
    plan = *planned;
    if (absl::Status s = store.SetPackList(job, "world", plan); !s.ok()) return Fail("publish", s);
  } else {
    auto fetched = store.GetPackList(job, "world", deadline);
    if (!fetched.ok()) return Fail("fetch plan", fetched.status());
    plan = *fetched;
  }

  // Every rank reports its plan; rank 0 checks that all are byte-identical.
  if (absl::Status s = store.Set(job, absl::StrCat("plan/", rank), plan.SerializeAsString());
      !s.ok()) {
    return Fail("report", s);
  }
  if (rank == 0) {
    std::vector<std::string> reports;
    for (int r = 0; r < world; ++r) reports.push_back(absl::StrCat("plan/", r));
    for (const std::string& key : reports) {
      auto other = store.Get(job, key, deadline);
      if (!other.ok()) return Fail("collect", other.status());
      if (*other != plan.SerializeAsString()) {
        return Fail("check", absl::DataLossError(absl::StrCat(key, " differs from rank 0's plan")));
      }
    }
    std::cout << "demo: " << world << " ranks agree on a plan of " << plan.packs_size()
              << " packs\n";
  }
  if (auto done = store.Add(job, "done", 1); !done.ok()) return Fail("finish", done.status());
  return 0;
}
