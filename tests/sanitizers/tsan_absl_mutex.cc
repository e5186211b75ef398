// Tells ThreadSanitizer about absl::Mutex (and Notification) in a TSan build
// (GRADSYNC_SANITIZE=thread) whose abseil is Debian's, built without TSan: there Mutex::Lock and
// friends carry no TSan annotations, so TSan sees no lock at all and reports every guarded member
// as a race.
//
// Linked into every program of the build (exported with -rdynamic, so gRPC's calls come here too),
// these definitions take the place of abseil's by symbol interposition: each annotates the lock or
// unlock (the __tsan_mutex_* calls abseil makes itself when built with TSan) around the real
// function, found with dlsym(RTLD_NEXT). A wait (Await*, LockWhen*, CondVar::Wait*) is an unlock
// and a lock; while the real function runs, TSan ignores this thread's accesses, as abseil's own
// annotations do: it may evaluate other threads' Conditions under the lock.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

// No libstdc++ here (no std::string, no guarded statics): C programs of the build link it too.
#pragma clang diagnostic ignored "-Wthread-safety-analysis"

extern "C" {
void __tsan_mutex_destroy(void* addr, unsigned flags);
void __tsan_mutex_pre_lock(void* addr, unsigned flags);
void __tsan_mutex_post_lock(void* addr, unsigned flags, int recursion);
int __tsan_mutex_pre_unlock(void* addr, unsigned flags);
void __tsan_mutex_post_unlock(void* addr, unsigned flags);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}

namespace {

// The flags of compiler-rt's tsan_interface.h.
constexpr unsigned kReadLock = 1 << 3;
constexpr unsigned kTryLock = 1 << 4;
constexpr unsigned kTryLockFailed = 1 << 5;

#define GRADSYNC_STR2(x) #x
#define GRADSYNC_STR(x) GRADSYNC_STR2(x)

// abseil's own definition of the function whose mangled name ends in `rest` (the part after
// absl::<inline namespace>::), looked up once.
template <typename Fn>
Fn Real(void** slot, const char* rest, const char* prefix = "_ZN4absl") {
  void* f = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
  if (f == nullptr) {
    const char* ns = GRADSYNC_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
    char name[256];
    std::snprintf(name, sizeof(name), "%s%zu%s%s", prefix, std::strlen(ns), ns, rest);
    f = dlsym(RTLD_NEXT, name);
    if (f == nullptr) {
      std::fprintf(stderr, "tsan_absl_mutex: abseil has no %s\n", name);
      std::abort();
    }
    __atomic_store_n(slot, f, __ATOMIC_RELEASE);
  }
  return reinterpret_cast<Fn>(f);
}

// abseil calls its own exported functions through the PLT (AwaitWithTimeout calls
// AwaitWithDeadline, which lands here again): only the outermost call on a thread annotates.
thread_local int depth = 0;
struct Outermost {
  Outermost() : yes(depth++ == 0) {}
  ~Outermost() { --depth; }
  const bool yes;
};

// A lock taken by `real`; with kTryLock, `real` says whether it was.
template <typename Fn>
auto AnnotatedLock(void* mu, unsigned flags, Fn&& real) {
  Outermost o;
  if (o.yes) __tsan_mutex_pre_lock(mu, flags);
  auto r = real();
  if (o.yes) __tsan_mutex_post_lock(mu, flags | ((flags & kTryLock) && !r ? kTryLockFailed : 0), 0);
  return r;
}

template <typename Fn>
void AnnotatedUnlock(void* mu, unsigned flags, Fn&& real) {
  Outermost o;
  if (o.yes) __tsan_mutex_pre_unlock(mu, flags);
  real();
  if (o.yes) __tsan_mutex_post_unlock(mu, flags);
}

// A wait that releases `mu` and holds it again on return, whatever it returns.
template <typename R, typename Fn>
R AnnotatedWait(void* mu, unsigned flags, Fn&& real) {
  Outermost o;
  if (!o.yes) return real();
  __tsan_mutex_pre_unlock(mu, flags);
  R r = real();
  __tsan_mutex_post_unlock(mu, flags);
  __tsan_mutex_pre_lock(mu, flags);
  __tsan_mutex_post_lock(mu, flags, 0);
  return r;
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

using Cond = const Condition&;

void Mutex::Lock() {
  static void* slot = nullptr;
  auto real = Real<void (*)(Mutex*)>(&slot, "5Mutex4LockEv");
  AnnotatedLock(this, 0, [&] { return real(this), true; });
}

void Mutex::ReaderLock() {
  static void* slot = nullptr;
  auto real = Real<void (*)(Mutex*)>(&slot, "5Mutex10ReaderLockEv");
  AnnotatedLock(this, kReadLock, [&] { return real(this), true; });
}

bool Mutex::TryLock() {
  static void* slot = nullptr;
  auto real = Real<bool (*)(Mutex*)>(&slot, "5Mutex7TryLockEv");
  return AnnotatedLock(this, kTryLock, [&] { return real(this); });
}

bool Mutex::ReaderTryLock() {
  static void* slot = nullptr;
  auto real = Real<bool (*)(Mutex*)>(&slot, "5Mutex13ReaderTryLockEv");
  return AnnotatedLock(this, kReadLock | kTryLock, [&] { return real(this); });
}

void Mutex::Unlock() {
  static void* slot = nullptr;
  auto real = Real<void (*)(Mutex*)>(&slot, "5Mutex6UnlockEv");
  AnnotatedUnlock(this, 0, [&] { real(this); });
}

void Mutex::ReaderUnlock() {
  static void* slot = nullptr;
  auto real = Real<void (*)(Mutex*)>(&slot, "5Mutex12ReaderUnlockEv");
  AnnotatedUnlock(this, kReadLock, [&] { real(this); });
}

void Mutex::Await(Cond cond) {
  static void* slot = nullptr;
  auto real = Real<void (*)(Mutex*, Cond)>(&slot, "5Mutex5AwaitERKNS0_9ConditionE");
  AnnotatedWait<bool>(this, 0, [&] { return real(this, cond), true; });
}

bool Mutex::AwaitWithTimeout(Cond cond, Duration timeout) {
  static void* slot = nullptr;
  auto real = Real<bool (*)(Mutex*, Cond, Duration)>(
      &slot, "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return AnnotatedWait<bool>(this, 0, [&] { return real(this, cond, timeout); });
}

bool Mutex::AwaitWithDeadline(Cond cond, Time deadline) {
  static void* slot = nullptr;
  auto real = Real<bool (*)(Mutex*, Cond, Time)>(
      &slot, "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return AnnotatedWait<bool>(this, 0, [&] { return real(this, cond, deadline); });
}

// LockWhen*: the lock is held when the real function returns, whatever it returns.
void Mutex::LockWhen(Cond cond) {
  static void* slot = nullptr;
  auto real = Real<void (*)(Mutex*, Cond)>(&slot, "5Mutex8LockWhenERKNS0_9ConditionE");
  AnnotatedLock(this, 0, [&] { return real(this, cond), true; });
}

void Mutex::ReaderLockWhen(Cond cond) {
  static void* slot = nullptr;
  auto real = Real<void (*)(Mutex*, Cond)>(&slot, "5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  AnnotatedLock(this, kReadLock, [&] { return real(this, cond), true; });
}

bool Mutex::LockWhenWithTimeout(Cond cond, Duration timeout) {
  static void* slot = nullptr;
  auto real = Real<bool (*)(Mutex*, Cond, Duration)>(
      &slot, "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  bool r = false;
  AnnotatedLock(this, 0, [&] { return r = real(this, cond, timeout), true; });
  return r;
}

bool Mutex::LockWhenWithDeadline(Cond cond, Time deadline) {
  static void* slot = nullptr;
  auto real = Real<bool (*)(Mutex*, Cond, Time)>(
      &slot, "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  bool r = false;
  AnnotatedLock(this, 0, [&] { return r = real(this, cond, deadline), true; });
  return r;
}

Mutex::~Mutex() {
  static void* slot = nullptr;
  auto real = Real<void (*)(Mutex*)>(&slot, "5MutexD2Ev");
  __tsan_mutex_destroy(this, 0);
  real(this);
}

void CondVar::Wait(Mutex* mu) {
  static void* slot = nullptr;
  auto real = Real<void (*)(CondVar*, Mutex*)>(&slot, "7CondVar4WaitEPNS0_5MutexE");
  AnnotatedWait<bool>(mu, 0, [&] { return real(this, mu), true; });
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  static void* slot = nullptr;
  auto real = Real<bool (*)(CondVar*, Mutex*, Duration)>(
      &slot, "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  return AnnotatedWait<bool>(mu, 0, [&] { return real(this, mu, timeout); });
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  static void* slot = nullptr;
  auto real = Real<bool (*)(CondVar*, Mutex*, Time)>(
      &slot, "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  return AnnotatedWait<bool>(mu, 0, [&] { return real(this, mu, deadline); });
}

// Notification: Notify releases, a wait that saw it acquires (abseil's fast path reads an atomic
// TSan cannot see). The sync address is the flag itself, so HasBeenNotified's inline atomic load
// (instrumented) acquires it too.
namespace {
void* NotifiedFlag(const Notification* n) {
  return const_cast<char*>(reinterpret_cast<const char*>(n) + sizeof(Mutex));
}
}  // namespace

void Notification::Notify() {
  static void* slot = nullptr;
  auto real = Real<void (*)(Notification*)>(&slot, "12Notification6NotifyEv");
  __tsan_release(NotifiedFlag(this));
  real(this);
}

void Notification::WaitForNotification() const {
  static void* slot = nullptr;
  auto real = Real<void (*)(const Notification*)>(&slot, "12Notification19WaitForNotificationEv",
                                                  "_ZNK4absl");
  real(this);
  __tsan_acquire(NotifiedFlag(this));
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  static void* slot = nullptr;
  auto real = Real<bool (*)(const Notification*, Duration)>(
      &slot, "12Notification30WaitForNotificationWithTimeoutENS0_8DurationE", "_ZNK4absl");
  const bool yes = real(this, timeout);
  if (yes) __tsan_acquire(NotifiedFlag(this));
  return yes;
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  static void* slot = nullptr;
  auto real = Real<bool (*)(const Notification*, Time)>(
      &slot, "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE", "_ZNK4absl");
  const bool yes = real(this, deadline);
  if (yes) __tsan_acquire(NotifiedFlag(this));
  return yes;
}

ABSL_NAMESPACE_END
}  // namespace absl
