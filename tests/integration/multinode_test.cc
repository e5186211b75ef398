// Jobs spanning daemons: 2 to 9 real gradsyncd processes on loopback (own ports and sockets),
// each with real trainer processes; the daemons form the job through the root daemon's store
// and carry the bytes between them with Gloo.

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"

namespace gradsync::testing {
namespace {

class MultiNodeTest : public ::testing::Test {
 protected:
  void StartDaemons(int n, std::vector<std::string> flags = {}) {
    for (int i = 0; i < n; ++i) {
      dirs_.push_back(std::make_unique<TempDir>());
      DaemonProcess::Options options;
      options.flags = flags;
      auto daemon = DaemonProcess::Start(dirs_.back()->path(), options);
      ASSERT_TRUE(daemon.ok()) << daemon.status();
      daemons_.push_back(*std::move(daemon));
    }
  }

  // One worker per rank; rank r attaches to daemon node_of[r]. Returns exit codes.
  // scenario "-" for a rank: that rank is not started.
  std::vector<pid_t> Start(const std::string& job, const std::vector<int>& node_of,
                           const std::vector<std::string>& scenarios,
                           const std::vector<std::string>& args) {
    const int world = static_cast<int>(node_of.size());
    std::vector<pid_t> pids;
    for (int r = 0; r < world; ++r) {
      if (scenarios[r] == "-") {
        pids.push_back(-1);
        continue;
      }
      int local_world = 0;
      for (int n : node_of) local_world += n == node_of[r];
      std::vector<std::string> argv = {HelperBinary("collective_worker"),
                                       daemons_[node_of[r]]->unix_target(),
                                       job,
                                       std::to_string(world),
                                       std::to_string(r),
                                       scenarios[r],
                                       "local_world_size=" + std::to_string(local_world),
                                       "root=" + daemons_[node_of[0]]->tcp_target()};
      argv.insert(argv.end(), args.begin(), args.end());
      auto pid = Spawn(argv, {}, absl::StrCat(dirs_[0]->path(), "/out.", r));
      EXPECT_TRUE(pid.ok()) << pid.status();
      pids.push_back(pid.ok() ? *pid : -1);
    }
    return pids;
  }

  std::vector<int> Wait(const std::vector<pid_t>& pids) {
    const int world = static_cast<int>(pids.size());
    out_.assign(world, "");
    const std::vector<int> codes = WaitAll(pids, absl::Seconds(150));
    for (int r = 0; r < world; ++r) {
      if (pids[r] >= 0) out_[r] = ReadFile(absl::StrCat(dirs_[0]->path(), "/out.", r));
    }
    return codes;
  }

  std::vector<int> Run(const std::string& job, const std::vector<int>& node_of,
                       const std::string& scenario, const std::vector<std::string>& args) {
    return Wait(Start(job, node_of, std::vector<std::string>(node_of.size(), scenario), args));
  }

  void ExpectAllPassed(const std::vector<int>& codes, const std::string& needle) {
    for (size_t r = 0; r < codes.size(); ++r) {
      if (out_[r].empty() && codes[r] == 0) continue;  // not started
      EXPECT_EQ(codes[r], 0) << "rank " << r << ": " << out_[r];
      EXPECT_TRUE(absl::StrContains(out_[r], needle)) << "rank " << r << ": " << out_[r];
    }
  }

  std::vector<std::unique_ptr<TempDir>> dirs_;
  std::vector<std::unique_ptr<DaemonProcess>> daemons_;
  std::vector<std::string> out_;
};

// Ranks laid out in blocks (0,1 | 2,3): all-reduce (every op and dtype), broadcast, barrier.
TEST_F(MultiNodeTest, TwoDaemonsTwoRanksEach) {
  StartDaemons(2);
  ExpectAllPassed(Run("mn2", {0, 0, 1, 1}, "matrix", {"counts=0,1,7,1023,65537"}), "matrix cases=");
}

TEST_F(MultiNodeTest, ThreeDaemonsUnevenRanksAndFusedPacks) {
  StartDaemons(3);
  // 3 and 4099 elements travel inside their records (one exchange); 70001 (over 256 KiB
  // for 4-byte types) takes Gloo's ring after them.
  ExpectAllPassed(Run("mn3", {0, 0, 1, 2}, "matrix", {"counts=3,4099,70001"}), "matrix cases=");
  ExpectAllPassed(Run("mn3f", {0, 0, 1, 2}, "fused", {}), "wrong=0");
}

// Six daemons with every group on the tree (--cpu_all_to_all_max_nodes=1; a group of more than
// four nodes would be anyway): ranks spread unevenly (two on daemon 2, two on daemon 5), every op,
// dtype and size the matrix runs, inline up and down the tree and by the ring and the chain
// broadcast, then fused packs.
TEST_F(MultiNodeTest, SixDaemonsOnTheTreeRunEveryOpInlineAndByTheRing) {
  StartDaemons(6, {"--cpu_all_to_all_max_nodes=1"});
  ExpectAllPassed(Run("tree6", {0, 1, 2, 2, 3, 4, 5, 5}, "matrix", {"counts=3,4099,70001"}),
                  "matrix cases=");
  ExpectAllPassed(Run("tree6f", {0, 1, 2, 2, 3, 4, 5, 5}, "fused", {}), "wrong=0");
}

// Ops queued together reach the communicator in runs and cross nodes as one batch of exchanges
// (small ones inside their records, a large one by Gloo's ring amid them, a chain that
// reads its own results in order): each keeps its own outcome and values, and the one op the
// last node names differently fails alone, on 2 and on 3 nodes; with 40 KB small ops the run's
// records span several messages of each node's stream.
TEST_F(MultiNodeTest, QueuedOpsCrossNodesTogetherEachWithItsOwnOutcome) {
  StartDaemons(3);
  ExpectAllPassed(Run("q2", {0, 0, 1, 1}, "queued", {}), "queued ok=68 of 69");
  ExpectAllPassed(Run("q3", {0, 0, 1, 2}, "queued", {}), "queued ok=68 of 69");
  ExpectAllPassed(Run("q2m", {0, 0, 1, 1}, "queued", {"count=10000"}), "queued ok=68 of 69");
  ExpectAllPassed(Run("q3m", {0, 0, 1, 2}, "queued", {"count=10000"}), "queued ok=68 of 69");
  ExpectAllPassed(Run("q3a", {0, 0, 1, 2}, "async", {}), "async done=128");
}

// Bad input is refused by each rank's own daemon before anything crosses nodes, and the job
// goes on across both daemons afterwards (the worker checks an all-reduce after the cases).
TEST_F(MultiNodeTest, BadInputIsRefusedAndTheJobGoesOnAcrossNodes) {
  StartDaemons(2);
  ExpectAllPassed(Run("mnb", {0, 0, 1, 1}, "badinput", {}), "badinput cases=");
}

TEST_F(MultiNodeTest, SixtyFourMiBEveryOpAcrossTwoDaemons) {
  StartDaemons(2);
  ExpectAllPassed(Run("mnl", {0, 0, 1, 1}, "matrix", {"bytes=67108864", "dtypes=float32,bfloat16"}),
                  "matrix cases=16");
}

TEST_F(MultiNodeTest, AsyncOpsInFlightAndGroupsAcrossAndWithinNodes) {
  StartDaemons(2);
  ExpectAllPassed(Run("mna", {0, 0, 1, 1}, "async", {}), "async done=128");
  // Groups 0,1 and 2,3 stay inside one node each; 0,2,3 spans both.
  ExpectAllPassed(Run("mng", {0, 0, 1, 1}, "groups", {}), "groups ok");
}

// A mismatch inside one node, and one between nodes, fail the op on every node naming both
// fingerprints, and the group goes on with its next op. A rank missing on one node fails the op
// everywhere at the deadline, naming it.
TEST_F(MultiNodeTest, DesyncAndDeadlineReachEveryNode) {
  StartDaemons(2);
  ExpectAllPassed(Run("d1", {0, 0, 1, 1}, "desync", {}), "desync ok");
  ExpectAllPassed(Run("d2", {0, 0, 1, 1}, "desync", {"across=1"}), "desync ok");
  // A rank missing on a node with others present: that node's deadline verdict reaches all.
  ExpectAllPassed(Run("d3", {0, 0, 1, 1}, "deadline", {}), "deadline ok");
  // A node that does not reach the op at all: the others' deadline names its ranks.
  ExpectAllPassed(Run("d4", {0, 0, 1}, "deadlineacross", {}), "deadline across ok");
}

TEST_F(MultiNodeTest, JobThatNeverFormsFailsAtTheDeadlineNamingTheMissingRanks) {
  StartDaemons(2, {"--op_timeout=2s"});
  // Ranks 2 and 3 (daemon 1) never come.
  const absl::Time start = absl::Now();
  ExpectAllPassed(Wait(Start("nf", {0, 0, 1, 1}, {"noform", "noform", "-", "-"}, {})), "noform ok");
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
}

TEST_F(MultiNodeTest, WrongClusterTokenKeepsADaemonOutOfTheJob) {
  TempDir secrets;
  const std::string good = secrets.path() + "/good", bad = secrets.path() + "/bad";
  std::ofstream(good) << "right";
  std::ofstream(bad) << "wrong";
  ::chmod(good.c_str(), 0600);
  ::chmod(bad.c_str(), 0600);
  dirs_.push_back(std::make_unique<TempDir>());
  dirs_.push_back(std::make_unique<TempDir>());
  for (int i = 0; i < 2; ++i) {
    DaemonProcess::Options options;
    options.flags = {"--token_file=" + (i == 0 ? good : bad), "--op_timeout=3s"};
    auto daemon = DaemonProcess::Start(dirs_[i]->path(), options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemons_.push_back(*std::move(daemon));
  }
  // Daemon 1 cannot publish its ranks in the root's store (UNAUTHENTICATED), so the job
  // never forms: its ranks are told why, the root's ranks time out naming them.
  const std::vector<int> codes =
      Wait(Start("tok", {0, 0, 1, 1}, {"noform", "noform", "-", "-"}, {}));
  ExpectAllPassed(codes, "noform ok");
}

// A trainer killed on one node: its pending op fails on every node naming it, and so do the
// group's later ops (the other nodes hear it through each op's exchange); a group without it
// still works across nodes.
TEST_F(MultiNodeTest, KilledTrainerFailsItsGroupsOnEveryNode) {
  StartDaemons(2);
  const std::vector<int> codes =
      Wait(Start("kt", {0, 0, 1, 1}, {"survivor", "survivor", "survivor", "victim"}, {}));
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(codes[r], 0) << "rank " << r << ": " << out_[r];
    EXPECT_TRUE(absl::StrContains(out_[r], "survivor ok")) << out_[r];
  }
  EXPECT_EQ(codes[3], 128 + SIGKILL);
}

TEST_F(MultiNodeTest, KilledDaemonFailsTheOtherNodesOpsAndTheRestStaysHealthy) {
  StartDaemons(2);
  const std::vector<pid_t> pids =
      Start("kd", {0, 0, 1, 1}, {"idle", "idle", "nodesurvivor", "nodesurvivor"}, {});
  absl::SleepFor(absl::Milliseconds(1500));  // everyone passed the barrier; 2,3 wait in the op
  auto code = daemons_[0]->Stop(SIGKILL);
  ASSERT_TRUE(code.ok());
  const std::vector<int> codes = Wait(pids);
  for (int r = 2; r < 4; ++r) {
    std::cout << "rank " << r << ": " << out_[r];
    EXPECT_EQ(codes[r], 0) << out_[r];
    EXPECT_TRUE(absl::StrContains(out_[r], "node survivor ok")) << out_[r];
  }
  // Daemon 1 serves a new job (single node) at once.
  ExpectAllPassed(Wait(Start("after", {1, 1}, {"desync", "desync"}, {})), "desync ok");
}

// The root's daemon is frozen (SIGSTOP: its kernel still ACKs TCP) while the other nodes' ranks
// wait in an op for its rank: the other daemons' watches find it silent and fail the op at once,
// UNAVAILABLE naming the node and the cause, long before the op's 60 s deadline. Resumed, the
// frozen daemon's trainer gets an error too, never a crash, and the survivors serve a new job.
TEST_F(MultiNodeTest, AFrozenDaemonIsFoundLostByEverySurvivorAndItsTrainerGetsAnError) {
  StartDaemons(3);
  const std::vector<pid_t> pids =
      Start("fz", {0, 1, 1, 2}, {"idle", "nodesurvivor", "nodesurvivor", "nodesurvivor"}, {});
  absl::SleepFor(absl::Milliseconds(1500));  // everyone passed the barrier; 1-3 wait in the op
  ASSERT_EQ(::kill(daemons_[0]->pid(), SIGSTOP), 0);
  // Ranks 1-3 fail (the op cannot complete without rank 0); then the root goes on.
  std::vector<int> codes = WaitAll({pids[1], pids[2], pids[3]}, absl::Seconds(60));
  ASSERT_EQ(::kill(daemons_[0]->pid(), SIGCONT), 0);
  const std::vector<int> root = WaitAll({pids[0]}, absl::Seconds(60));
  for (int r = 1; r < 4; ++r) {
    const std::string out = ReadFile(absl::StrCat(dirs_[0]->path(), "/out.", r));
    std::cout << "rank " << r << ": " << out;
    EXPECT_EQ(codes[r - 1], 0) << out;
    EXPECT_TRUE(absl::StrContains(out, "node survivor ok")) << out;
    EXPECT_TRUE(absl::StrContains(out, daemons_[0]->tcp_target())) << out;
    EXPECT_TRUE(absl::StrContains(out, "(ranks 0) lost: no word for")) << out;
  }
  // The frozen node's trainer was not killed (a signal would show as a negative code).
  EXPECT_GE(root[0], 0) << ReadFile(absl::StrCat(dirs_[0]->path(), "/out.0"));
  // The survivors serve a new job across their two nodes.
  ExpectAllPassed(Run("after", {1, 1, 2}, "matrix", {"counts=7,70001"}), "matrix cases=");
}

// Nine daemons watching each other over a ring of one neighbour each way and fingers
// (--peer_watch_ring=1: each links to 6 of its 8 peers and watches 2): a daemon frozen mid-op
// is found silent by its two ring neighbours, and every survivor, those not linked to it
// included, fails the op naming it ("seen by node ..." where another daemon found it); a
// daemon killed is found at once by the daemons linked to it and passed on to the rest. Each
// one gone is an inner node of the group's tree (the nodes in address order: node 4 is the
// parent of 5 and 6, node 2 of 3, node 6 of 7), so the survivors below it wait for a decision
// that cannot come, and the survivors above it for its record.
TEST_F(MultiNodeTest, NineDaemonsOnARingWatchAFrozenOneAndAKilledOneReachEverySurvivor) {
  constexpr int kN = 9;
  StartDaemons(kN, {"--peer_watch_ring=1"});
  std::vector<int> node_of(kN);
  for (int r = 0; r < kN; ++r) node_of[r] = r;
  // The daemons in the group's node order (their addresses sorted).
  std::vector<std::pair<std::string, int>> order;
  for (int i = 0; i < kN; ++i) order.emplace_back(daemons_[i]->tcp_target(), i);
  std::sort(order.begin(), order.end());
  for (const bool freeze : {true, false}) {
    // Not the root (daemon 0 holds the job's store).
    int gone = order[freeze ? 4 : 2].second;
    if (gone == 0) gone = order[6].second;
    std::vector<std::string> scenarios(kN, "nodesurvivor");
    scenarios[gone] = "idle";
    const std::string job = freeze ? "ring-freeze" : "ring-kill";
    const std::vector<pid_t> pids = Start(job, node_of, scenarios, {});
    absl::SleepFor(absl::Milliseconds(2500));  // everyone passed the barrier; the rest wait
    std::vector<pid_t> survivors;
    for (int r = 0; r < kN; ++r) {
      if (r != gone && pids[r] >= 0) survivors.push_back(pids[r]);
    }
    if (freeze) {
      ASSERT_EQ(::kill(daemons_[gone]->pid(), SIGSTOP), 0);
    } else {
      ASSERT_TRUE(daemons_[gone]->Stop(SIGKILL).ok());
    }
    const std::vector<int> codes = WaitAll(survivors, absl::Seconds(60));
    if (freeze) {
      ASSERT_EQ(::kill(daemons_[gone]->pid(), SIGCONT), 0);
    }
    ::kill(pids[gone], SIGKILL);  // its trainer idles for up to 20 s otherwise
    (void)WaitAll({pids[gone]}, absl::Seconds(60));
    int told = 0;
    for (size_t k = 0, r = 0; r < kN; ++r) {
      if (static_cast<int>(r) == gone) continue;
      const std::string out = ReadFile(absl::StrCat(dirs_[0]->path(), "/out.", r));
      EXPECT_EQ(codes[k++], 0) << job << " rank " << r << ": " << out;
      EXPECT_TRUE(absl::StrContains(out, "node survivor ok"))
          << job << " rank " << r << ": " << out;
      EXPECT_TRUE(absl::StrContains(out, daemons_[gone]->tcp_target()))
          << job << " rank " << r << ": " << out;
      EXPECT_TRUE(absl::StrContains(
          out, freeze ? absl::StrCat("(ranks ", gone, ") lost: no word for")
                      : absl::StrCat("(ranks ", gone, ") lost: the connection was")))
          << job << " rank " << r << ": " << out;
      told += absl::StrContains(out, ", seen by node ") ? 1 : 0;
    }
    // Two of the eight survivors have no link to it, and those linked to it but not watching
    // it hear of a freeze from its watchers.
    EXPECT_GE(told, 2) << job;
  }
}

// Two daemons in separate network namespaces joined by a veth pair (created and removed here):
// the job forms and all-reduces over a real link, not loopback. One daemon binds the wildcard
// address and advertises its veth address. Skips where namespaces are not permitted.
TEST_F(MultiNodeTest, TwoDaemonsInSeparateNetworkNamespacesOverVeth) {
  const std::string tag = std::to_string(::getpid() % 100000);
  const std::string ns_a = "gsa" + tag, ns_b = "gsb" + tag;
  auto sh = [](const std::string& cmd) { return std::system((cmd + " 2>/dev/null").c_str()); };
  if (sh("ip netns add " + ns_a) != 0) {
    GTEST_SKIP() << "cannot create network namespaces here (needs root / CAP_SYS_ADMIN)";
  }
  struct Cleanup {
    std::function<void()> fn;
    ~Cleanup() { fn(); }
  } cleanup{[&] {
    daemons_.clear();  // stop the daemons before their namespaces go
    sh("ip netns del " + ns_a);
    sh("ip netns del " + ns_b);
  }};
  ASSERT_EQ(sh("ip netns add " + ns_b), 0);
  const std::string va = "gva" + tag, vb = "gvb" + tag;
  for (const std::string& cmd :
       {"ip link add " + va + " type veth peer name " + vb, "ip link set " + va + " netns " + ns_a,
        "ip link set " + vb + " netns " + ns_b,
        "ip -n " + ns_a + " addr add 10.77.0.1/24 dev " + va,
        "ip -n " + ns_b + " addr add 10.77.0.2/24 dev " + vb,
        "ip -n " + ns_a + " link set " + va + " up", "ip -n " + ns_b + " link set " + vb + " up",
        "ip -n " + ns_a + " link set lo up", "ip -n " + ns_b + " link set lo up"}) {
    ASSERT_EQ(sh(cmd), 0) << cmd;
  }
  const std::vector<std::pair<std::string, std::string>> nodes = {{ns_a, "10.77.0.1"},
                                                                  {ns_b, "10.77.0.2"}};
  for (const auto& [ns, address] : nodes) {
    dirs_.push_back(std::make_unique<TempDir>());
    DaemonProcess::Options options;
    options.wrapper = {"/usr/sbin/ip", "netns", "exec", ns};
    // Node A listens on every interface of its namespace and advertises its veth address.
    options.flags = ns == ns_a ? std::vector<std::string>{"--bind_address=0.0.0.0",
                                                          "--advertise_address=" + address}
                               : std::vector<std::string>{"--bind_address=" + address};
    auto daemon = DaemonProcess::Start(dirs_.back()->path(), options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemons_.push_back(*std::move(daemon));
  }
  const std::string root = "10.77.0.1:" + std::to_string(daemons_[0]->tcp_port());
  const std::vector<int> node_of = {0, 0, 1, 1};
  std::vector<pid_t> pids;
  for (int r = 0; r < 4; ++r) {
    auto pid = Spawn({HelperBinary("collective_worker"), daemons_[node_of[r]]->unix_target(), "ns",
                      "4", std::to_string(r), "matrix", "local_world_size=2", "root=" + root,
                      "ops=reduce", "counts=7,65537", "dtypes=float32,bfloat16"},
                     {}, absl::StrCat(dirs_[0]->path(), "/out.", r));
    ASSERT_TRUE(pid.ok());
    pids.push_back(*pid);
  }
  ExpectAllPassed(Wait(pids), "matrix cases=");
}

}  // namespace
}  // namespace gradsync::testing
