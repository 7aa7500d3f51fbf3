/* A spinning thread team for the compiled kernels' parallel loops, linked into an artifact's model.so.
 *
 * TVM's generated code starts every parallel loop through the library's __TVMBackendParallelLaunch
 * pointer. A decode step launches ~110 of them (one per GEMV, attention, ...), each only tens of
 * microseconds long, so the fork/join itself is a visible share of the step: with the two vCPUs on
 * different cores ("split" placement, ~200 ns cache-line ping-pong) TVM's pool costs several
 * microseconds per launch. This team does one launch with two cache-line transfers: the caller bumps
 * a generation counter and runs task 0, the workers (spinning on the counter) run tasks 1..n-1 and
 * bump a done counter the caller spins on. Workers sleep on a futex after a spin budget
 * (microseconds, PERFX_SPIN_US) without work, so an idle engine does not burn a core.
 *
 * The Python runtime (perfx_compiler/runtime/thread_team.py) starts the team and points the
 * library's launch pointer here. A launch the team cannot take goes to TVM's own launch function
 * (saved at start): a second thread launching while the team is busy, a launch asking for more tasks
 * than the team has, or any launch in a forked child (the workers did not survive the fork).
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#define MAX_THREADS 256
#define EXPORT __attribute__((visibility("default")))

/* TVM's C ABI for parallel lambdas (tvm/runtime/c_backend_api.h). */
typedef struct {
  void* sync_handle;
  int32_t num_task;
} ParallelEnv;
typedef int (*ParallelLambda)(int task_id, ParallelEnv* penv, void* cdata);
typedef int (*ParallelLaunch)(ParallelLambda flambda, void* cdata, int num_task);

static struct {
  /* written by the launching thread before it bumps `generation` (release), read by the workers */
  _Alignas(64) _Atomic uint32_t generation;
  ParallelLambda flambda;
  void* cdata;
  int num_task;
  _Alignas(64) _Atomic int done;   /* workers finished with this generation */
  _Atomic int failed;              /* a task returned non-zero */
  _Alignas(64) _Atomic int sleepers;
  _Alignas(64) _Atomic int busy;   /* a launch is in flight */
  int threads;
  uint32_t start_generation;       /* the generation before the first launch */
  int64_t spin_ns;
  int alive;                       /* 0 after fork: the workers exist only in the parent */
  ParallelLaunch fallback;         /* TVM's launch function */
  _Atomic int64_t launches;        /* launches the team ran (tests and benchmarks read it) */
} team;

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void futex_wait(_Atomic uint32_t* addr, uint32_t expected) {
  syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t* addr) {
  syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0);
}

/* Spin until `generation` moves past `seen`; after the spin budget, sleep on the futex. */
static uint32_t wait_for_work(uint32_t seen) {
  int64_t start = 0;
  for (unsigned spins = 0;; spins++) {
    uint32_t g = atomic_load_explicit(&team.generation, memory_order_acquire);
    if (g != seen) return g;
    CPU_RELAX();
    if ((spins & 255) != 255) continue;  /* read the clock rarely */
    int64_t t = now_ns();
    if (start == 0) start = t;
    if (t - start < team.spin_ns) continue;
    atomic_fetch_add(&team.sleepers, 1);
    if (atomic_load(&team.generation) == seen) futex_wait(&team.generation, seen);
    atomic_fetch_sub(&team.sleepers, 1);
    start = 0;
  }
}

static void* worker_main(void* arg) {
  int id = (int)(intptr_t)arg;
  /* not the counter's value when this thread gets to run: a launch may already have bumped it */
  uint32_t seen = team.start_generation;
  for (;;) {
    seen = wait_for_work(seen);
    int num_task = team.num_task;
    if (id < num_task) {
      ParallelEnv env = {NULL, num_task};
      if (team.flambda(id, &env, team.cdata) != 0) atomic_store(&team.failed, 1);
    }
    atomic_fetch_add_explicit(&team.done, 1, memory_order_release);
  }
  return NULL;
}

static void after_fork_in_child(void) { team.alive = 0; }

/* Start `threads` - 1 workers (the launching thread is the first member). 0 on success. */
EXPORT int perfx_team_start(int threads, int spin_us, void* fallback) {
  if (team.threads) return team.threads == threads ? 0 : -1;  /* already started */
  if (threads < 2 || threads > MAX_THREADS || fallback == NULL) return -1;
  team.spin_ns = (int64_t)spin_us * 1000;
  team.fallback = (ParallelLaunch)fallback;
  team.start_generation = atomic_load(&team.generation);  /* no launch before `alive` is set below */
  for (int i = 1; i < threads; i++) {
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&th, &attr, worker_main, (void*)(intptr_t)i);
    pthread_attr_destroy(&attr);
    if (rc != 0) return -1;  /* started workers only ever sleep: the team is never used */
  }
  pthread_atfork(NULL, NULL, after_fork_in_child);
  team.threads = threads;
  team.alive = 1;
  return 0;
}

EXPORT int perfx_team_launch(ParallelLambda flambda, void* cdata, int num_task) {
  int n = num_task <= 0 ? team.threads : num_task;
  int expected = 0;
  if (!team.alive || n > team.threads ||
      !atomic_compare_exchange_strong(&team.busy, &expected, 1))
    return team.fallback(flambda, cdata, num_task);
  team.flambda = flambda;
  team.cdata = cdata;
  team.num_task = n;
  atomic_store_explicit(&team.done, 0, memory_order_relaxed);
  atomic_store_explicit(&team.failed, 0, memory_order_relaxed);
  /* seq_cst bump, then read `sleepers`: a worker either sees the new generation or is counted */
  atomic_fetch_add(&team.generation, 1);
  if (atomic_load(&team.sleepers)) futex_wake_all(&team.generation);
  ParallelEnv env = {NULL, n};
  int rc = flambda(0, &env, cdata);
  /* every worker checks in, also those without a task, so the next launch finds all of them idle */
  for (unsigned spins = 1; atomic_load_explicit(&team.done, memory_order_acquire) != team.threads - 1; spins++) {
    CPU_RELAX();
    if ((spins & 0xffff) == 0) sched_yield();  /* a worker lost its CPU (more threads than cores) */
  }
  if (atomic_load(&team.failed)) rc = -1;
  atomic_fetch_add_explicit(&team.launches, 1, memory_order_relaxed);
  atomic_store_explicit(&team.busy, 0, memory_order_release);
  return rc;
}

EXPORT int64_t perfx_team_launches(void) { return atomic_load(&team.launches); }
