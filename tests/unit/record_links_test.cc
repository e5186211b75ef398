// RecordLinks between in-process "nodes" (one thread each, real TCP on loopback, rendezvous
// over a MemoryStore): messages in order both ways, bulk both ways at once without deadlock,
// the key check against a stranger, a peer gone, deadlines and malformed lengths.

#include "daemon/backend/cpu/record_links.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/backend/cpu/socket.h"
#include "daemon/store/memory_store.h"
#include "gtest/gtest.h"
#include "tests/unit/record_links_testing.h"

namespace gradsync::backend::cpu {
namespace {

std::vector<std::byte> Message(int from, int k, size_t bytes) {
  std::vector<std::byte> m(bytes);
  for (size_t i = 0; i < bytes; ++i) m[i] = static_cast<std::byte>((from * 131 + k * 7 + i) % 251);
  return m;
}

TEST(RecordLinksTest, MessagesOfEverySizeArriveWholeAndInOrderBothWays) {
  store::MemoryStore store;
  auto links = ConnectAll(&store, 3);
  ASSERT_EQ(links.size(), 3u);
  const std::vector<size_t> sizes = {0, 1, 64, 4096, 300000, 1 << 20};
  RunOnEach(3, [&](int me) {
    for (size_t k = 0; k < sizes.size(); ++k) {
      ASSERT_TRUE(links[me]->Send(Message(me, k, sizes[k]), absl::Now() + absl::Seconds(20)).ok());
    }
    for (int from = 0; from < 3; ++from) {
      if (from == me) continue;
      for (size_t k = 0; k < sizes.size(); ++k) {
        auto got = links[me]->Receive(from, absl::Now() + absl::Seconds(20));
        ASSERT_TRUE(got.ok()) << got.status();
        const std::vector<std::byte> want = Message(from, k, sizes[k]);
        ASSERT_EQ(got->size(), want.size()) << "node " << me << " from " << from << " k " << k;
        if (!want.empty()) {
          ASSERT_EQ(std::memcmp(got->data(), want.data(), want.size()), 0);
        }
      }
    }
  });
}

TEST(RecordLinksTest, NodesSendingBulkToEachOtherAtOnceBothFinishAndKeepEveryByte) {
  // Each node sends 48 MiB to each peer before it reads anything: far beyond the sockets'
  // buffers, so a Send that did not read while blocked would deadlock the two.
  store::MemoryStore store;
  auto links = ConnectAll(&store, 2);
  ASSERT_EQ(links.size(), 2u);
  constexpr int kMessages = 48;
  RunOnEach(2, [&](int me) {
    for (int k = 0; k < kMessages; ++k) {
      ASSERT_TRUE(links[me]->Send(Message(me, k, 1 << 20), absl::Now() + absl::Seconds(60)).ok());
    }
    const int from = 1 - me;
    for (int k = 0; k < kMessages; ++k) {
      auto got = links[me]->Receive(from, absl::Now() + absl::Seconds(60));
      ASSERT_TRUE(got.ok()) << got.status();
      const std::vector<std::byte> want = Message(from, k, 1 << 20);
      ASSERT_EQ(got->size(), want.size());
      ASSERT_EQ(std::memcmp(got->data(), want.data(), want.size()), 0) << "message " << k;
    }
    EXPECT_EQ(links[me]->BufferedFrom(from), 0u);
  });
}

TEST(RecordLinksTest, AMessageStaysValidWhileLaterSendsReadMoreFromThatPeer) {
  store::MemoryStore store;
  auto links = ConnectAll(&store, 2);
  ASSERT_EQ(links.size(), 2u);
  RunOnEach(2, [&](int me) {
    const int from = 1 - me;
    ASSERT_TRUE(links[me]->Send(Message(me, 0, 1000), absl::Now() + absl::Seconds(20)).ok());
    auto first = links[me]->Receive(from, absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(first.ok()) << first.status();
    // The peer now sends 16 MiB while this node sends its own: reads during these Sends must
    // not move the message returned above.
    for (int k = 1; k <= 16; ++k) {
      ASSERT_TRUE(links[me]->Send(Message(me, k, 1 << 20), absl::Now() + absl::Seconds(60)).ok());
    }
    const std::vector<std::byte> want = Message(from, 0, 1000);
    ASSERT_EQ(std::memcmp(first->data(), want.data(), want.size()), 0);
    for (int k = 1; k <= 16; ++k) {
      auto got = links[me]->Receive(from, absl::Now() + absl::Seconds(60));
      ASSERT_TRUE(got.ok()) << got.status();
      const std::vector<std::byte> w = Message(from, k, 1 << 20);
      ASSERT_EQ(std::memcmp(got->data(), w.data(), w.size()), 0) << "message " << k;
    }
  });
}

// Connects to the address node `of` published, sends `bytes` and returns the socket.
int Stranger(store::MemoryStore& store, int of, const void* bytes, size_t n) {
  auto value = store.WaitBlocking("j", {absl::StrCat("r/", of)}, absl::Now() + absl::Seconds(20));
  EXPECT_TRUE(value.ok());
  if (!value.ok()) return -1;
  const std::vector<std::string> parts = absl::StrSplit(value->front(), ' ');
  EXPECT_EQ(parts.size(), 3u);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(parts[1])));
  inet_pton(AF_INET, parts[0].c_str(), &addr.sin_addr);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  if (n > 0) {
    EXPECT_EQ(::send(fd, bytes, n, MSG_NOSIGNAL), static_cast<ssize_t>(n));
  }
  return fd;
}

// Node 0 of two connects on its own thread, by `zero_within`, while `strangers` connect to it
// (returning the sockets to close once the nodes are connected); then node 1 connects, and a
// message must reach node 0 over the link.
void ExpectPeersConnectDespite(
    absl::Duration zero_within,
    const std::function<std::vector<int>(store::MemoryStore&)>& strangers) {
  store::MemoryStore store;
  std::unique_ptr<RecordLinks> zero;
  absl::Status zero_status;
  std::thread t([&] {
    auto l = RecordLinks::Connect(SpecOf(&store, 0, 2), absl::Now() + zero_within);
    zero_status = l.status();
    if (l.ok()) zero = *std::move(l);
  });
  const std::vector<int> open = strangers(store);
  auto one = RecordLinks::Connect(SpecOf(&store, 1, 2), absl::Now() + absl::Seconds(30));
  t.join();
  for (int fd : open) ::close(fd);
  ASSERT_TRUE(zero_status.ok()) << zero_status;
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_TRUE((*one)->Send(Message(1, 0, 100), absl::Now() + absl::Seconds(20)).ok());
  auto got = zero->Receive(1, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(got.ok()) << got.status();
  const std::vector<std::byte> want = Message(1, 0, 100);
  ASSERT_EQ(got->size(), want.size());
  EXPECT_EQ(std::memcmp(got->data(), want.data(), want.size()), 0);
}

TEST(RecordLinksTest, AConnectionWithoutTheKeyIsClosedAndTheRealPeerStillConnects) {
  ExpectPeersConnectDespite(absl::Seconds(20), [](store::MemoryStore& store) {
    // Strangers that read nothing from the store: a hello of an older protocol carrying a key
    // (a wrong one), then one that sends garbage.
    struct {
      uint64_t magic = 0x67736c696e6b3031;
      uint32_t from = 1;
      uint32_t to = 0;
      char key[32];
    } hello;
    std::memset(hello.key, 'a', sizeof(hello.key));
    const int wrong_key = Stranger(store, 0, &hello, sizeof(hello));
    const char garbage[48] = "GET / HTTP/1.0\r\n\r\n";
    const int junk = Stranger(store, 0, garbage, sizeof(garbage));
    // Node 0 closes both: a read sees the end.
    for (int fd : {wrong_key, junk}) {
      char b;
      timeval tv{10, 0};
      setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      // The end, or a reset where node 0 closed with bytes of ours unread; not a timeout.
      const ssize_t got = ::recv(fd, &b, 1, 0);
      EXPECT_TRUE(got == 0 || (got < 0 && errno == ECONNRESET))
          << "node 0 kept a connection without the key: " << got << " " << std::strerror(errno);
      ::close(fd);
    }
    return std::vector<int>{};
  });
}

TEST(RecordLinksTest, SilentConnectionsDelayNoOneAndTheRealPeerConnectsAtOnce) {
  // Node 0's deadline is shorter than the wait it gives one hello (5 s): had it waited for the
  // strangers' hellos one after another, it could not connect its peer in time.
  ExpectPeersConnectDespite(absl::Seconds(4), [](store::MemoryStore& store) {
    // Three strangers connect and send nothing (or part of a hello), and stay connected.
    const char part[10] = {};
    return std::vector<int>{Stranger(store, 0, part, 0), Stranger(store, 0, part, sizeof(part)),
                            Stranger(store, 0, part, 0)};
  });
}

TEST(RecordLinksTest, APeerThatNeverComesFailsConnectByTheDeadlineNamingIt) {
  store::MemoryStore store;
  auto l = RecordLinks::Connect(SpecOf(&store, 0, 2), absl::Now() + absl::Milliseconds(300));
  ASSERT_FALSE(l.ok());
  EXPECT_EQ(l.status().code(), absl::StatusCode::kDeadlineExceeded) << l.status();
  EXPECT_TRUE(absl::StrContains(l.status().message(), kNodes[1])) << l.status();
}

TEST(RecordLinksTest, APeerGoneFailsTheNextReceiveAfterWhatItSentIsTaken) {
  store::MemoryStore store;
  auto links = ConnectAll(&store, 2);
  ASSERT_EQ(links.size(), 2u);
  ASSERT_TRUE(links[1]->Send(Message(1, 0, 5000), absl::Now() + absl::Seconds(20)).ok());
  links[1].reset();  // its daemon went
  auto first = links[0]->Receive(1, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(first.ok()) << first.status();  // sent before it went: still read
  EXPECT_EQ(first->size(), 5000u);
  auto next = links[0]->Receive(1, absl::Now() + absl::Seconds(20));
  ASSERT_FALSE(next.ok());
  EXPECT_EQ(next.status().code(), absl::StatusCode::kUnavailable) << next.status();
  EXPECT_TRUE(absl::StrContains(next.status().message(), kNodes[1])) << next.status();
  // Sending to it fails too (now or once the kernel sees the reset), never hangs.
  absl::Status sent = absl::OkStatus();
  for (int k = 0; k < 64 && sent.ok(); ++k) {
    sent = links[0]->Send(Message(0, k, 1 << 20), absl::Now() + absl::Seconds(20));
  }
  EXPECT_FALSE(sent.ok());
}

TEST(RecordLinksTest, ReceiveWithNothingComingFailsAtItsDeadlineAndTheLinkStillWorks) {
  store::MemoryStore store;
  auto links = ConnectAll(&store, 2);
  ASSERT_EQ(links.size(), 2u);
  auto none = links[0]->Receive(1, absl::Now() + absl::Milliseconds(100));
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kDeadlineExceeded) << none.status();
  ASSERT_TRUE(links[1]->Send(Message(1, 0, 10), absl::Now() + absl::Seconds(20)).ok());
  auto got = links[0]->Receive(1, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(got.ok()) << got.status();
}

TEST(RecordLinksTest, AMessageLongerThanTheLimitFailsTheLinkInsteadOfAllocatingIt) {
  store::MemoryStore store;
  auto links = ConnectAll(&store, 2);
  ASSERT_EQ(links.size(), 2u);
  // 2 MiB against a 1 MiB limit: the receiver refuses it as soon as it sees the length (the
  // sender, which the receiver no longer reads, gives up at its own deadline).
  std::thread sender(
      [&] { (void)links[1]->Send(Message(1, 0, 2 << 20), absl::Now() + absl::Seconds(2)); });
  auto got = links[0]->Receive(1, absl::Now() + absl::Seconds(20));
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_TRUE(absl::StrContains(got.status().message(), "malformed")) << got.status();
  auto again = links[0]->Receive(1, absl::Now() + absl::Seconds(1));
  EXPECT_FALSE(again.ok());  // the link stays failed
  sender.join();
}

}  // namespace
}  // namespace gradsync::backend::cpu

namespace gradsync::backend::cpu {
namespace {

TEST(RecordLinksHandshakeTest, AFloodOfSilentConnectionsCannotKeepTheRealPeerOut) {
  // More silent connections than the listener holds handshakes for, from the peer's own
  // address: each newcomer takes the oldest one's slot, so the peer's handshake completes.
  ExpectPeersConnectDespite(absl::Seconds(20), [](store::MemoryStore& store) {
    std::vector<int> open;
    for (int i = 0; i < 100; ++i) open.push_back(Stranger(store, 0, nullptr, 0));
    return open;
  });
}

TEST(RecordLinksHandshakeTest, AConnectorWithoutTheKeyIsClosedAfterItsProof) {
  ExpectPeersConnectDespite(absl::Seconds(20), [](store::MemoryStore& store) {
    // A well-formed hello from "node 1", then a proof made without the key.
    struct {
      uint64_t magic = 0x67736c696e6b3032;  // "gslink02"
      uint32_t from = 1;
      uint32_t to = 0;
      unsigned char nonce[16] = {1, 2, 3};
    } hello;
    const int fd = Stranger(store, 0, &hello, sizeof(hello));
    timeval tv{10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    unsigned char challenge[56];
    EXPECT_EQ(::recv(fd, challenge, sizeof(challenge), MSG_WAITALL), 56) << "no challenge came";
    const unsigned char proof[32] = {};
    EXPECT_EQ(::send(fd, proof, sizeof(proof), MSG_NOSIGNAL), 32);
    char b;
    EXPECT_EQ(::recv(fd, &b, 1, 0), 0) << "node 0 kept a connection whose proof was wrong";
    ::close(fd);
    return std::vector<int>{};
  });
}

// A listener that publishes an address and key but does not hold the key: it reads the hello
// (which it keeps in `hello_bytes`) and answers with a challenge whose MAC is garbage.
TEST(RecordLinksHandshakeTest, TheConnectorRefusesAListenerThatCannotProveTheKeyAndNeverSendsIt) {
  store::MemoryStore store;
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener, 8), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string key(32, 'k');
  ASSERT_TRUE(
      store.Set("j", "r/0", absl::StrCat("127.0.0.1 ", ntohs(addr.sin_port), " ", key)).ok());
  std::string hello_bytes;
  std::thread impostor([&] {
    for (int attempt = 0; attempt < 100; ++attempt) {  // the connector retries: answer each
      pollfd p{listener, POLLIN, 0};
      if (::poll(&p, 1, 3000) <= 0) return;
      const int fd = ::accept(listener, nullptr, nullptr);
      char hello[32];
      if (::recv(fd, hello, sizeof(hello), MSG_WAITALL) == 32) hello_bytes.assign(hello, 32);
      unsigned char challenge[56] = {};
      const uint64_t magic = 0x67736368616c3032;  // "gschal02"
      std::memcpy(challenge, &magic, 8);
      ::send(fd, challenge, sizeof(challenge), MSG_NOSIGNAL);
      char rest[64];
      ::recv(fd, rest, sizeof(rest), MSG_DONTWAIT);  // a proof would land here: none may come
      ::close(fd);
    }
  });
  auto one = RecordLinks::Connect(SpecOf(&store, 1, 2), absl::Now() + absl::Milliseconds(800));
  impostor.join();
  ::close(listener);
  ASSERT_FALSE(one.ok());
  EXPECT_EQ(one.status().code(), absl::StatusCode::kUnavailable) << one.status();
  EXPECT_TRUE(absl::StrContains(one.status().message(), "could not prove")) << one.status();
  ASSERT_EQ(hello_bytes.size(), 32u);
  EXPECT_FALSE(absl::StrContains(hello_bytes, key.substr(0, 8))) << "the key went on the wire";
}

TEST(RecordLinksHandshakeTest, ACancelFdEndsAWaitForAPeerAtOnce) {
  store::MemoryStore store;
  const int cancel = sock::NewCancelFd();
  ASSERT_GE(cancel, 0);
  RecordLinks::Spec spec = SpecOf(&store, 0, 2);
  spec.cancel_fd = cancel;
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(200));
    sock::Signal(cancel);
  });
  auto l = RecordLinks::Connect(spec, absl::Now() + absl::Seconds(30));
  canceller.join();
  ::close(cancel);
  ASSERT_FALSE(l.ok());
  // Not DEADLINE_EXCEEDED: the wait ended at the cancel, not at its deadline.
  EXPECT_EQ(l.status().code(), absl::StatusCode::kCancelled) << l.status();
}

}  // namespace
}  // namespace gradsync::backend::cpu

namespace gradsync::backend::cpu {
namespace {

// One "daemon" per node: its own park. Epoch `epoch` of job "j" over `nodes` (indices into
// kNodes), connected on one thread per node; links[i] is node nodes[i]'s (all must connect).
std::vector<std::unique_ptr<RecordLinks>> ConnectEpoch(gradsync::Store* store,
                                                       std::vector<LinkPark>& parks,
                                                       const std::vector<int>& nodes, int epoch) {
  const int n = static_cast<int>(nodes.size());
  std::vector<std::unique_ptr<RecordLinks>> links(n);
  std::vector<absl::Status> status(n);
  RunOnEach(n, [&](int me) {
    RecordLinks::Spec spec = SpecOf(store, me, n, absl::StrCat("e", epoch, "/"));
    spec.nodes.clear();
    for (int i : nodes) spec.nodes.push_back(kNodes[i]);
    spec.park = &parks[nodes[me]];
    spec.home = "j";
    spec.epoch = epoch;
    auto l = RecordLinks::Connect(std::move(spec), absl::Now() + absl::Seconds(20));
    status[me] = l.status();
    if (l.ok()) links[me] = *std::move(l);
  });
  for (int i = 0; i < n; ++i) EXPECT_TRUE(status[i].ok()) << i << ": " << status[i];
  return links;
}

// Every node sends each peer `count` messages and reads the peers' back, checking each byte.
void ExchangeChecked(std::vector<std::unique_ptr<RecordLinks>>& links, int count) {
  const int n = static_cast<int>(links.size());
  RunOnEach(n, [&](int me) {
    for (int k = 0; k < count; ++k) {
      ASSERT_TRUE(links[me]->Send(Message(me, k, 5000 + k), absl::Now() + absl::Seconds(20)).ok());
    }
    for (int from = 0; from < n; ++from) {
      if (from == me) continue;
      for (int k = 0; k < count; ++k) {
        auto got = links[me]->Receive(from, absl::Now() + absl::Seconds(20));
        ASSERT_TRUE(got.ok()) << "node " << me << " from " << from << ": " << got.status();
        const std::vector<std::byte> want = Message(from, k, 5000 + k);
        ASSERT_EQ(got->size(), want.size());
        ASSERT_EQ(std::memcmp(got->data(), want.data(), want.size()), 0);
      }
    }
  });
}

// The next epoch over `nodes`: node nodes[i] must take `adopted[i]` links over; then every
// node sends each peer messages and checks the peers' (streams whole, old bytes skipped).
void ExpectNextEpoch(gradsync::Store* store, std::vector<LinkPark>& parks,
                     const std::vector<int>& nodes, int epoch, const std::vector<int>& adopted) {
  auto next = ConnectEpoch(store, parks, nodes, epoch);
  ASSERT_EQ(next.size(), nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) EXPECT_EQ(next[i]->adopted(), adopted[i]) << i;
  ExchangeChecked(next, 2);
}

TEST(RecordLinksParkTest, TheNextEpochTakesEveryKeptConnectionOverPastWhatTheOldOneLeftUnread) {
  store::MemoryStore store;
  std::vector<LinkPark> parks(3);
  auto old = ConnectEpoch(&store, parks, {0, 1, 2}, 1);
  ASSERT_EQ(old.size(), 3u);
  ExchangeChecked(old, 2);
  // Left in the streams, never read: whole messages, and bytes of the old framing that a
  // reader of the new epoch would take for a frame header.
  for (int me = 0; me < 3; ++me) {
    ASSERT_TRUE(old[me]->Send(Message(me, 9, 300000), absl::Now() + absl::Seconds(20)).ok());
    std::vector<std::byte> fake(64, std::byte{0x01});
    ASSERT_TRUE(old[me]->Send(fake, absl::Now() + absl::Seconds(20)).ok());
  }
  // Node 1 read part of what node 0 sent: its receive buffer is dropped with the epoch.
  ASSERT_TRUE(old[1]->Receive(0, absl::Now() + absl::Seconds(20)).ok());
  for (auto& l : old) l->Park();
  EXPECT_EQ(parks[0].size(), 2u);
  EXPECT_EQ(parks[1].size(), 2u);
  EXPECT_EQ(parks[2].size(), 2u);
  old.clear();

  auto next = ConnectEpoch(&store, parks, {0, 1, 2}, 2);
  ASSERT_EQ(next.size(), 3u);
  for (int me = 0; me < 3; ++me) {
    EXPECT_EQ(next[me]->adopted(), 2) << me;
    EXPECT_EQ(parks[me].size(), 0u) << me;
  }
  ExchangeChecked(next, 3);
  // And a bulk exchange both ways at once over the connections taken over.
  RunOnEach(2, [&](int me) {
    for (int k = 0; k < 16; ++k) {
      ASSERT_TRUE(next[me]
                      ->SendTo(1 - me, {absl::Span<const std::byte>(Message(me, k, 1 << 20))},
                               absl::Now() + absl::Seconds(60))
                      .ok());
    }
    for (int k = 0; k < 16; ++k) {
      auto got = next[me]->Receive(1 - me, absl::Now() + absl::Seconds(60));
      ASSERT_TRUE(got.ok()) << got.status();
      const std::vector<std::byte> want = Message(1 - me, k, 1 << 20);
      ASSERT_EQ(got->size(), want.size());
      ASSERT_EQ(std::memcmp(got->data(), want.data(), want.size()), 0) << k;
    }
  });
}

TEST(RecordLinksParkTest, APeerStillInTheOldEpochFailsAtOnceWhenTheOtherEndParks) {
  store::MemoryStore store;
  std::vector<LinkPark> parks(3);
  auto old = ConnectEpoch(&store, parks, {0, 1}, 1);
  ASSERT_EQ(old.size(), 2u);
  ASSERT_TRUE(old[0]->Send(Message(0, 0, 100), absl::Now() + absl::Seconds(20)).ok());
  old[0]->Park();
  auto first = old[1]->Receive(0, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(first.ok()) << first.status();  // sent before: read
  const absl::Time start = absl::Now();
  auto next = old[1]->Receive(0, absl::Now() + absl::Seconds(20));
  ASSERT_FALSE(next.ok());
  EXPECT_EQ(next.status().code(), absl::StatusCode::kUnavailable) << next.status();
  EXPECT_TRUE(absl::StrContains(next.status().message(), "ended")) << next.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // not its deadline
  // It parks too (the end mark is no fault of the connection): the next epoch takes it over.
  old[1]->Park();
  old.clear();
  ExpectNextEpoch(&store, parks, {0, 1}, 2, {1, 1});
}

TEST(RecordLinksParkTest, APeerBlockedSendingToANodeThatParksFailsAtOnceNotAtItsDeadline) {
  store::MemoryStore store;
  std::vector<LinkPark> parks(2);
  auto old = ConnectEpoch(&store, parks, {0, 1}, 1);
  ASSERT_EQ(old.size(), 2u);
  absl::Status sent;
  absl::Duration took;
  std::thread sender([&] {  // far more than the sockets hold: blocks, node 0 reading nothing
    const absl::Time start = absl::Now();
    sent = old[1]->SendTo(0, {absl::Span<const std::byte>(Message(1, 0, 64 << 20))},
                          absl::Now() + absl::Seconds(30));
    took = absl::Now() - start;
  });
  absl::SleepFor(absl::Milliseconds(300));
  old[0]->Park();
  sender.join();
  EXPECT_EQ(sent.code(), absl::StatusCode::kUnavailable) << sent;
  EXPECT_TRUE(absl::StrContains(sent.message(), "ended")) << sent;
  EXPECT_LT(took, absl::Seconds(20));
  // Its message went out in part: node 1 closes that stream, and the next epoch makes the pair
  // afresh on both ends.
  old[1]->Park();
  EXPECT_EQ(parks[1].size(), 0u);
  old.clear();
  ExpectNextEpoch(&store, parks, {0, 1}, 2, {0, 0});
}

TEST(RecordLinksParkTest, ASendToAPeerWhoseEndMarkCameWithItsLastMessageFailsAtOnce) {
  store::MemoryStore store;
  std::vector<LinkPark> parks(2);
  auto old = ConnectEpoch(&store, parks, {0, 1}, 1);
  ASSERT_EQ(old.size(), 2u);
  ASSERT_TRUE(old[0]->Send(Message(0, 0, 100), absl::Now() + absl::Seconds(20)).ok());
  old[0]->Park();
  absl::SleepFor(absl::Milliseconds(200));  // both in node 1's socket: read together
  auto got = old[1]->Receive(0, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(got.ok()) << got.status();
  const absl::Time start = absl::Now();
  const absl::Status sent = old[1]->SendTo(
      0, {absl::Span<const std::byte>(Message(1, 0, 64 << 20))}, absl::Now() + absl::Seconds(30));
  EXPECT_EQ(sent.code(), absl::StatusCode::kUnavailable) << sent;
  EXPECT_TRUE(absl::StrContains(sent.message(), "ended")) << sent;
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

TEST(RecordLinksParkTest, ASendToOtherPeersGoesOnWhileANodeItIsNotSendingToParks) {
  store::MemoryStore store;
  std::vector<LinkPark> parks(3);
  auto old = ConnectEpoch(&store, parks, {0, 1, 2}, 1);
  ASSERT_EQ(old.size(), 3u);
  constexpr int kMessages = 24;  // far more than the sockets hold
  absl::Status sent;
  std::thread sender([&] {  // blocks until node 2 reads; node 0 parks meanwhile
    for (int k = 0; k < kMessages && sent.ok(); ++k) {
      sent = old[1]->SendTo(2, {absl::Span<const std::byte>(Message(1, k, 1 << 20))},
                            absl::Now() + absl::Seconds(60));
    }
  });
  absl::SleepFor(absl::Milliseconds(200));
  old[0]->Park();
  absl::SleepFor(absl::Milliseconds(200));
  for (int k = 0; k < kMessages; ++k) {
    auto got = old[2]->Receive(1, absl::Now() + absl::Seconds(60));
    ASSERT_TRUE(got.ok()) << k << ": " << got.status();
    const std::vector<std::byte> want = Message(1, k, 1 << 20);
    ASSERT_EQ(got->size(), want.size());
    ASSERT_EQ(std::memcmp(got->data(), want.data(), want.size()), 0) << k;
  }
  sender.join();
  EXPECT_TRUE(sent.ok()) << sent;
  // Node 1's stream to node 2 is whole: kept by both, taken over by the next epoch.
  for (int me = 1; me < 3; ++me) old[me]->Park();
  old.clear();
  ExpectNextEpoch(&store, parks, {1, 2}, 2, {1, 1});
}

TEST(RecordLinksParkTest, AResumeMarkAcrossTwoReadsAndMessagesRightBehindItAreFound) {
  // Node 1 reads nothing after the first exchange, so its socket holds exactly what node 0
  // left: a frame of about 256 KiB (one read of Resume) before the end mark, so that node 0's
  // resume mark is found in a later read than the first, past the tail of the earlier ones.
  // Each node sends as soon as its Connect returns, so a read may hold the mark and the new
  // epoch's first bytes behind it.
  store::MemoryStore store;
  std::vector<LinkPark> parks(2);
  auto old = ConnectEpoch(&store, parks, {0, 1}, 1);
  ASSERT_EQ(old.size(), 2u);
  ExchangeChecked(old, 1);
  constexpr size_t kChunk = 256 << 10;
  ASSERT_TRUE(
      old[0]->Send(Message(0, 7, kChunk - 32 - 2 * 64), absl::Now() + absl::Seconds(20)).ok());
  for (auto& l : old) l->Park();
  old.clear();
  std::vector<std::unique_ptr<RecordLinks>> links(2);
  RunOnEach(2, [&](int me) {
    RecordLinks::Spec spec = SpecOf(&store, me, 2, "e2/");
    spec.park = &parks[me];
    spec.home = "j";
    spec.epoch = 2;
    auto l = RecordLinks::Connect(std::move(spec), absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(l.ok()) << l.status();
    links[me] = *std::move(l);
    EXPECT_EQ(links[me]->adopted(), 1);
    for (int k = 0; k < 3; ++k) {
      ASSERT_TRUE(links[me]->Send(Message(me, k, 100 + k), absl::Now() + absl::Seconds(20)).ok());
    }
    for (int k = 0; k < 3; ++k) {
      auto got = links[me]->Receive(1 - me, absl::Now() + absl::Seconds(20));
      ASSERT_TRUE(got.ok()) << got.status();
      const std::vector<std::byte> want = Message(1 - me, k, 100 + k);
      ASSERT_EQ(got->size(), want.size());
      ASSERT_EQ(std::memcmp(got->data(), want.data(), want.size()), 0);
    }
  });
}

TEST(RecordLinksParkTest, OnlyPairsBothOfWhoseEndsKeptTheConnectionTakeItOverTheOthersConnect) {
  store::MemoryStore store;
  std::vector<LinkPark> parks(3);
  auto old = ConnectEpoch(&store, parks, {0, 1, 2}, 1);
  ASSERT_EQ(old.size(), 3u);
  // Node 0 cuts a message to node 1 in half (node 1 does not read; the send gives up at its
  // deadline): that stream cannot go on, so node 0 does not keep it.
  const absl::Status cut = old[0]->SendTo(1, {absl::Span<const std::byte>(Message(0, 0, 64 << 20))},
                                          absl::Now() + absl::Milliseconds(300));
  ASSERT_EQ(cut.code(), absl::StatusCode::kDeadlineExceeded) << cut;
  for (auto& l : old) l->Park();
  EXPECT_EQ(parks[0].size(), 1u);  // to node 2 only
  EXPECT_EQ(parks[1].size(), 2u);  // node 1 keeps its end: node 0's decides
  // Node 2 lost what it kept (restarted, say): nothing of node 2 is taken over either.
  (void)parks[2].Take("j", kNodes);
  old.clear();
  auto next = ConnectEpoch(&store, parks, {0, 1, 2}, 2);
  ASSERT_EQ(next.size(), 3u);
  for (int me = 0; me < 3; ++me) EXPECT_EQ(next[me]->adopted(), 0) << me;
  ExchangeChecked(next, 2);

  // A third epoch: everything was made afresh or taken over at the second, so all is kept.
  for (auto& l : next) l->Park();
  next.clear();
  auto third = ConnectEpoch(&store, parks, {0, 1, 2}, 3);
  ASSERT_EQ(third.size(), 3u);
  for (int me = 0; me < 3; ++me) EXPECT_EQ(third[me]->adopted(), 2) << me;
  ExchangeChecked(third, 2);
}

TEST(RecordLinksParkTest, ALossAndAJoinRelinkOnlyThePairsTheyChange) {
  store::MemoryStore store;
  std::vector<LinkPark> parks(3);
  auto old = ConnectEpoch(&store, parks, {0, 1, 2}, 1);
  ASSERT_EQ(old.size(), 3u);
  // Node 1 is lost: nodes 0 and 2 go on; the pair 0-2 is taken over.
  old[0]->Park();
  old[2]->Park();
  old.clear();
  auto shrunk = ConnectEpoch(&store, parks, {0, 2}, 2);
  ASSERT_EQ(shrunk.size(), 2u);
  EXPECT_EQ(shrunk[0]->adopted(), 1);
  EXPECT_EQ(shrunk[1]->adopted(), 1);
  EXPECT_EQ(parks[0].size(), 1u);  // its end to node 1 stays there, untouched, until its time
  ExchangeChecked(shrunk, 2);
  // A node joins (at node 1's place, with nothing kept): its pairs are made, 0-2 kept again.
  for (auto& l : shrunk) l->Park();
  shrunk.clear();
  (void)parks[1].Take("j", kNodes);
  auto grown = ConnectEpoch(&store, parks, {0, 1, 2}, 3);
  ASSERT_EQ(grown.size(), 3u);
  EXPECT_TRUE(grown[0]->Adopted(2));
  EXPECT_FALSE(grown[0]->Adopted(1));
  EXPECT_EQ(grown[1]->adopted(), 0);
  EXPECT_TRUE(grown[2]->Adopted(0));
  EXPECT_FALSE(grown[2]->Adopted(1));
  ExchangeChecked(grown, 2);
}

TEST(RecordLinksParkTest, TwoGroupsOfAnEpochEachTakeOneOfTheConnectionsKept) {
  store::MemoryStore store;
  std::vector<LinkPark> parks(2);
  auto connect_group = [&](const std::string& group, int epoch) {
    std::vector<std::unique_ptr<RecordLinks>> links(2);
    RunOnEach(2, [&](int me) {
      RecordLinks::Spec spec = SpecOf(&store, me, 2, absl::StrCat(group, epoch, "/"));
      spec.park = &parks[me];
      spec.home = "j";
      spec.epoch = epoch;
      auto l = RecordLinks::Connect(std::move(spec), absl::Now() + absl::Seconds(20));
      ASSERT_TRUE(l.ok()) << l.status();
      links[me] = *std::move(l);
    });
    return links;
  };
  auto a = connect_group("a", 1);
  auto b = connect_group("b", 1);
  for (auto* g : {&a, &b}) {
    for (auto& l : *g) l->Park();
  }
  EXPECT_EQ(parks[0].size(), 2u);
  a.clear();
  b.clear();
  // One group after the other: each takes one over.
  auto a2 = connect_group("a", 2);
  EXPECT_EQ(a2[0]->adopted(), 1);
  EXPECT_EQ(a2[1]->adopted(), 1);
  EXPECT_EQ(parks[0].size(), 1u);  // the other went back
  auto b2 = connect_group("b", 2);
  EXPECT_EQ(b2[0]->adopted(), 1);
  EXPECT_EQ(b2[1]->adopted(), 1);
  ExchangeChecked(a2, 2);
  ExchangeChecked(b2, 2);
  for (auto* g : {&a2, &b2}) {
    for (auto& l : *g) l->Park();
  }
  a2.clear();
  b2.clear();
  // Both groups at once, in either order on each node: whichever connections each takes, both
  // ends of every pair agree, and the streams are whole.
  std::vector<std::vector<std::unique_ptr<RecordLinks>>> groups(2);
  for (auto& g : groups) g.resize(2);
  RunOnEach(4, [&](int k) {
    const int me = k % 2, group = k / 2;
    RecordLinks::Spec spec = SpecOf(&store, me, 2, absl::StrCat("g", group, "-3/"));
    spec.park = &parks[me];
    spec.home = "j";
    spec.epoch = 3;
    auto l = RecordLinks::Connect(std::move(spec), absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(l.ok()) << l.status();
    groups[group][me] = *std::move(l);
  });
  for (auto& g : groups) {
    ASSERT_TRUE(g[0] && g[1]);
    EXPECT_EQ(g[0]->adopted(), g[1]->adopted());
    ExchangeChecked(g, 2);
  }
}

TEST(LinkParkTest, KeepsTheLatestEpochsLinkPerPeerForItsTimeOnly) {
  auto fd = [] { return UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)); };
  LinkPark park;
  park.Put("j", "a", {fd(), "two", 2, {}});
  park.Put("j", "a", {fd(), "one", 1, {}});   // older: closed
  park.Put("j", "a", {fd(), "two'", 2, {}});  // another group's of the same epoch
  park.Put("j", "b", {fd(), "b1", 1, {}});
  park.Put("j", "c", {fd(), "c1", 1, {}});
  park.Put("k", "a", {fd(), "k", 5, {}});
  EXPECT_EQ(park.size(), 5u);
  auto taken = park.Take("j", {"a", "b", "z"});
  ASSERT_EQ(taken.size(), 2u);
  ASSERT_EQ(taken["a"].size(), 2u);
  EXPECT_EQ(taken["a"][0].id, "two");
  EXPECT_EQ(taken["a"][1].id, "two'");
  EXPECT_GE(taken["a"][0].fd.get(), 0);
  EXPECT_EQ(taken["b"][0].id, "b1");
  EXPECT_TRUE(park.Take("j", {"a", "b"}).empty());
  EXPECT_EQ(park.size(), 2u);  // j's link to c, k's
  park.Put("j", "b", {fd(), "b3", 3, {}});
  for (size_t i = 0; i < LinkPark::kMaxPerPeer + 5; ++i) {
    park.Put("j", "d", {fd(), absl::StrCat("d", i), 1, {}});
  }
  EXPECT_EQ(park.Take("j", {"d"})["d"].size(), LinkPark::kMaxPerPeer);

  LinkPark brief(absl::ZeroDuration());
  brief.Put("j", "a", {fd(), "x", 1, {}});
  EXPECT_TRUE(brief.Take("j", {"a"}).empty());  // past its time: closed at the next call
}

// Whether the peer of `end` closed its end (EOF), waiting up to 10 s.
bool SeesEnd(int end) {
  char c;
  if (!sock::WaitFor(end, POLLIN, absl::Now() + absl::Seconds(10)).value_or(false)) return false;
  return ::recv(end, &c, 1, MSG_DONTWAIT) == 0;
}

TEST(LinkParkTest, ALinkReplacedOrPastItsTimeIsClosedWithNoFurtherCall) {
  int older[2], newer[2], brief[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, older), 0);
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, newer), 0);
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, brief), 0);
  const UniqueFd older_peer(older[1]), newer_peer(newer[1]), brief_peer(brief[1]);
  {
    LinkPark park(absl::Seconds(30));
    park.Put("j", "a", {UniqueFd(older[0]), "old", 1, {}});
    park.Put("j", "a", {UniqueFd(newer[0]), "new", 2, {}});
    EXPECT_TRUE(SeesEnd(older_peer.get()));  // replaced by a later epoch's
    LinkPark short_lived(absl::Milliseconds(100));
    short_lived.Put("j", "a", {UniqueFd(brief[0]), "b", 1, {}});
    EXPECT_TRUE(SeesEnd(brief_peer.get()));  // its time passed: closed by the park's thread
    EXPECT_EQ(short_lived.size(), 0u);
    EXPECT_EQ(park.size(), 1u);
  }
  EXPECT_TRUE(SeesEnd(newer_peer.get()));  // the park's end closes what it kept
}

}  // namespace
}  // namespace gradsync::backend::cpu
