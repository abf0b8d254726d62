/*
 * A library's pool of threads (the decode step's, the forward's batched products), made
 * once (pool_set_threads, which each library exports under its own name), whose
 * workers run one task at a time split into `threads` parts, the calling thread taking
 * part 0. A step hands it about 150 tasks a token, each tens of microseconds long, so a
 * worker spins a while for the next one (SPIN_ROUNDS pauses, well under a millisecond)
 * before sleeping on a condition variable; the caller spins on the parts still running,
 * yielding the core after as long (on a machine with more threads than cores, a spinning
 * caller would hold the core a descheduled worker needs). No allocation per task.
 */
#ifndef SPMD_CP_THREAD_POOL_H
#define SPMD_CP_THREAD_POOL_H

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

enum { MAX_THREADS = 256, SPIN_ROUNDS = 20000 };

typedef void (*task_fn)(void *args, int part, int parts);

static struct {
  int threads; /* parts a task is split into, the caller's included */
  pthread_t workers[MAX_THREADS];
  pthread_mutex_t lock;
  pthread_cond_t wake;
  task_fn task; /* NULL: the workers stop */
  void *args;
  unsigned generation; /* bumped for each task */
  int pending;         /* workers still running the current task */
  unsigned started_at; /* the generation when the workers started: they wait for the next */
} pool = {1, {0}, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, 0, 0, 0};

static inline void spin_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

static unsigned next_generation(unsigned seen) {
  unsigned now;
  for (int spins = 0; spins < SPIN_ROUNDS; spins++) {
    if ((now = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE)) != seen) return now;
    spin_pause();
  }
  pthread_mutex_lock(&pool.lock);
  while ((now = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE)) == seen)
    pthread_cond_wait(&pool.wake, &pool.lock);
  pthread_mutex_unlock(&pool.lock);
  return now;
}

static void *pool_worker(void *part) {
  unsigned seen = pool.started_at; /* a task may be published before this thread runs */
  for (;;) {
    seen = next_generation(seen);
    if (pool.task == NULL) return NULL;
    pool.task(pool.args, (int)(intptr_t)part, pool.threads);
    __atomic_fetch_sub(&pool.pending, 1, __ATOMIC_RELEASE);
  }
}

/* Hand the workers a new task (or NULL: stop) and wake those asleep. */
static void pool_publish(task_fn task, void *args, int workers) {
  pool.task = task, pool.args = args;
  __atomic_store_n(&pool.pending, workers, __ATOMIC_RELAXED);
  pthread_mutex_lock(&pool.lock);
  __atomic_fetch_add(&pool.generation, 1, __ATOMIC_RELEASE);
  pthread_cond_broadcast(&pool.wake);
  pthread_mutex_unlock(&pool.lock);
}

static int pool_running; /* a task is on the pool: another caller runs its task alone */

/* The BLAS's own threads are held at one while the pool's parts run. A part that hands a
 * product to the BLAS (a float32 matrix's sgemv; a batched step's float32 sgemm) then
 * computes it on its own thread: OpenBLAS has one set of threads for the process, and
 * every part dispatching to it at once spun waiting for the others (exec_blas_async: the
 * embedded model's float32 decode, one rank on 2 threads, 4.7 tok/s against 24.6 on one
 * thread). OpenBLAS only (found by name), and only a build without thread affinity (its
 * configuration says NO_AFFINITY, as Debian's does), where setting its count pins no
 * thread to a core. */
typedef void (*blas_threads_set_fn)(int);
typedef int (*blas_threads_get_fn)(void);
typedef const char *(*blas_config_fn)(void);
static blas_threads_set_fn blas_threads_set;
static blas_threads_get_fn blas_threads_get;
static int blas_threads_known;

static void find_blas_threads(void) {
  if (__atomic_load_n(&blas_threads_known, __ATOMIC_ACQUIRE)) return;
  blas_config_fn config = (blas_config_fn)dlsym(RTLD_DEFAULT, "openblas_get_config");
  const char *built = config != NULL ? config() : NULL;
  if (built != NULL && strstr(built, "NO_AFFINITY") != NULL) {
    blas_threads_set = (blas_threads_set_fn)dlsym(RTLD_DEFAULT, "openblas_set_num_threads");
    blas_threads_get = (blas_threads_get_fn)dlsym(RTLD_DEFAULT, "openblas_get_num_threads");
  }
  __atomic_store_n(&blas_threads_known, 1, __ATOMIC_RELEASE);
}

/* The BLAS's thread count before it was held at one (0: not held). */
static int hold_blas_threads(void) {
  find_blas_threads();
  if (blas_threads_set == NULL || blas_threads_get == NULL) return 0;
  int threads = blas_threads_get();
  if (threads <= 1) return 0;
  blas_threads_set(1);
  return threads;
}

/* task(args, part, parts) for every part, on the pool; returns when all have run. A
 * caller that finds the pool busy (a task's part calling back in, another thread) runs
 * its task alone, as one part. */
static void run_parallel(task_fn task, void *args) {
  if (pool.threads == 1 || __atomic_exchange_n(&pool_running, 1, __ATOMIC_ACQUIRE)) {
    task(args, 0, 1);
    return;
  }
  int blas_threads = hold_blas_threads();
  pool_publish(task, args, pool.threads - 1);
  task(args, 0, pool.threads);
  for (int spins = 0; __atomic_load_n(&pool.pending, __ATOMIC_ACQUIRE) > 0; spins++) {
    if (spins < SPIN_ROUNDS) spin_pause();
    else sched_yield();
  }
  if (blas_threads) blas_threads_set(blas_threads);
  __atomic_store_n(&pool_running, 0, __ATOMIC_RELEASE);
}

/* The workers of a pool of `threads` (1: none), started once; a new count stops the old
 * workers first. Returns the threads the pool has (fewer where a start failed). */
static int pool_set_threads(int threads) {
  threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
  if (threads == pool.threads) return threads;
  if (pool.threads > 1) {
    pool_publish(NULL, NULL, 0);
    for (int i = 1; i < pool.threads; i++) pthread_join(pool.workers[i], NULL);
  }
  pool.threads = 1;
  pool.started_at = pool.generation;
  int started = 1;
  while (started < threads &&
         pthread_create(&pool.workers[started], NULL, pool_worker, (void *)(intptr_t)started) == 0)
    started++;
  pool.threads = started;
  return started;
}

#endif
