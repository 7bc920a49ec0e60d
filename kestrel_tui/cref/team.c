/* The threads of the compiled reference: the calling thread and helpers that join its work when they
 * can, never the other way round.
 *
 * An op (a GEMV, attention, the hashes) is cut into chunks whose outputs are independent; whoever
 * claims a chunk computes it whole, so which thread took which chunk moves no bit. The caller claims
 * chunks too and then waits only for the chunks a helper has claimed and not finished: a helper that
 * is not running (the machine busy with other work) is simply not waited for, and the caller does
 * its share. Between ops the caller runs the serial parts of the step alone; helpers spin a little
 * for the next op (a decode step's ops are microseconds apart), yielding the core now and then so that
 * on a machine busy with other work a spinning helper does not take the caller's core, then sleep
 * until an op comes.
 *
 * A claim is one compare-and-swap on a word holding the op's number, its chunk count and the next
 * chunk, so a helper that wakes up late, after its op is over, can never claim a chunk of a later op
 * under the earlier one's parameters. One team at a time uses the helpers; a second caller meanwhile
 * (another thread of the process) runs as a team of one. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sched.h>
#include <stdlib.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

#include "cref.h"

#define MAX_HELPERS 63
#define SPINS 2000  /* pauses a helper waits for the next op before it sleeps: some tens of microseconds */
/* An op shorter than this runs on the caller alone: handing it out and waiting for the last chunk
 * cost about a microsecond. (Measured on a 2-core VM shared with other work: sharing every op of an
 * embedded-model decode step was as fast as one thread while the machine was busy, and faster in its
 * quiet moments.) */
#define SHARE_MIN_NS 2000.0
static double g_share_min = SHARE_MIN_NS;

void kc_team_share_min(double ns)
{
    g_share_min = ns < 0 ? SHARE_MIN_NS : ns;
}

/* word: op number << 32 | chunks << 16 | next chunk */
#define WORD(gen, n, next) ((uint64_t)(gen) << 32 | (uint64_t)(n) << 16 | (uint64_t)(next))
#define W_GEN(w) ((uint32_t)((w) >> 32))
#define W_N(w) ((uint32_t)((w) >> 16) & 0xFFFF)
#define W_NEXT(w) ((uint32_t)(w) & 0xFFFF)

/* Each field a helper watches or writes on its own cache line: a helper spinning on the claim word
 * would take the line from the caller at every one of the caller's own claims. */
#define LINE _Alignas(64)
static struct {
    LINE _Atomic uint32_t gen;         /* the current op's number: what idle helpers watch */
    LINE _Atomic uint64_t word;        /* claims */
    LINE _Atomic int64_t helped;       /* chunks of the current op finished by helpers */
    LINE _Atomic int active;           /* helpers taking part in the current team */
    _Atomic int sleepers;
    int created;                       /* helpers started so far (under busy) */
    kc_chunk_fn fn, join;              /* the current op, read after a successful claim */
    void *ctx;
    pthread_mutex_t busy;              /* held by the team using the helpers */
    pthread_mutex_t lock;              /* with wake: helpers' sleep */
    pthread_cond_t wake;
} g_team = {.busy = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER,
            .wake = PTHREAD_COND_INITIALIZER};

/* Claim and compute chunks of op `gen` until none is left; join(ctx, 0, worker) first, once.
 * -> the chunks done. */
static int64_t work(uint32_t gen, int worker)
{
    int64_t did = 0;
    uint64_t w = atomic_load_explicit(&g_team.word, memory_order_acquire);
    while (W_GEN(w) == gen && W_NEXT(w) < W_N(w)) {
        if (!atomic_compare_exchange_weak_explicit(&g_team.word, &w, w + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;  /* w reloaded: another claim, or a later op */
        /* chunk W_NEXT(w) is ours: the op cannot end (nor its parameters change) before we finish it */
        if (did == 0 && g_team.join)
            g_team.join(g_team.ctx, 0, worker);
        g_team.fn(g_team.ctx, W_NEXT(w), worker);
        did++;
        if (worker)
            atomic_fetch_add_explicit(&g_team.helped, 1, memory_order_release);
        w = atomic_load_explicit(&g_team.word, memory_order_acquire);
    }
    return did;
}

static void *helper(void *arg)
{
    int index = (int)(intptr_t)arg;  /* worker index - 1 */
    uint32_t seen = atomic_load(&g_team.gen), now;
    for (;;) {
        int spins = 0;
        while ((now = atomic_load_explicit(&g_team.gen, memory_order_acquire)) == seen) {
            if (++spins < SPINS) {
                if (spins % 32 == 0)
                    sched_yield();  /* a thread waiting for this core (the caller, on a busy machine) runs */
                else
                    PAUSE();
                continue;
            }
            pthread_mutex_lock(&g_team.lock);
            atomic_fetch_add(&g_team.sleepers, 1);
            while (atomic_load(&g_team.gen) == seen)
                pthread_cond_wait(&g_team.wake, &g_team.lock);
            atomic_fetch_sub(&g_team.sleepers, 1);
            pthread_mutex_unlock(&g_team.lock);
            spins = 0;
        }
        seen = now;
        if (index < atomic_load(&g_team.active))
            work(seen, index + 1);
    }
    return NULL;
}

int64_t kc_team_chunks(int team, double work_ns, int64_t pieces)
{
    if (team <= 1 || work_ns < g_share_min || pieces <= 1)
        return 1;
    /* chunks of ~25 us, at least four a worker (a helper that joins late still finds some): the last
     * chunk is what the others may wait for */
    double c = work_ns / 25000.0;
    int64_t n = c < 4.0 * team ? 4 * (int64_t)team : (int64_t)c;
    n = n < KC_MAX_CHUNKS ? n : KC_MAX_CHUNKS;
    return n < pieces ? n : pieces;
}

int kc_team_begin(int threads)
{
    if (threads <= 1 || pthread_mutex_trylock(&g_team.busy) != 0)
        return 1;
    int want = threads - 1 < MAX_HELPERS ? threads - 1 : MAX_HELPERS;
    while (g_team.created < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, helper, (void *)(intptr_t)g_team.created);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
        g_team.created++;
    }
    int helpers = want < g_team.created ? want : g_team.created;
    if (helpers == 0) {
        pthread_mutex_unlock(&g_team.busy);
        return 1;
    }
    atomic_store(&g_team.active, helpers);
    return helpers + 1;
}

void kc_team_end(int team)
{
    if (team > 1) {
        atomic_store(&g_team.active, 0);
        pthread_mutex_unlock(&g_team.busy);
    }
}

void kc_team_run(int team, kc_chunk_fn fn, kc_chunk_fn join, void *ctx, int64_t chunks)
{
    if (chunks <= 0)
        return;
    if (team <= 1 || chunks == 1 || chunks > 0xFFFF) {  /* alone: no claims, no waiting */
        if (join)
            join(ctx, 0, 0);
        for (int64_t c = 0; c < chunks; c++)
            fn(ctx, c, 0);
        return;
    }
    g_team.fn = fn;
    g_team.join = join;
    g_team.ctx = ctx;
    atomic_store_explicit(&g_team.helped, 0, memory_order_relaxed);
    uint32_t gen = atomic_load_explicit(&g_team.gen, memory_order_relaxed) + 1;
    atomic_store_explicit(&g_team.word, WORD(gen, chunks, 0), memory_order_release);
    atomic_store(&g_team.gen, gen);  /* seq_cst: against a helper going to sleep */
    if (atomic_load(&g_team.sleepers) > 0) {
        pthread_mutex_lock(&g_team.lock);
        pthread_cond_broadcast(&g_team.wake);
        pthread_mutex_unlock(&g_team.lock);
    }
    int64_t mine = work(gen, 0);
    while (mine + atomic_load_explicit(&g_team.helped, memory_order_acquire) < chunks)
        PAUSE();
}
