/* Host -> device upload of byte ranges through pinned slots, on native threads, without the GIL.
 *
 * Why: the Python bounce (restore/bulkcopy.py) takes and drops the GIL several times a 16 MiB chunk
 * (the host copy, the DMA's launch, the event). A restore that parses one file's pickle while another
 * file uploads then slows the upload down by the parse's length: each retake of the GIL waits for the
 * parsing thread's switch interval. Here the whole upload is one ctypes call (which releases the GIL):
 * WORKERS threads each take the next slot-sized piece of the ranges (an atomic counter), copy it into one
 * of their own pinned slots (the copy faults a fresh mapping's pages in), queue its DMA on their own
 * stream and record an event; a slot is reused once its event has completed. Every stream first waits
 * for AFTER (an event recorded on the caller's stream: work the caller queued on the destination comes
 * first), and every DMA has finished when the call returns.
 *
 * The CUDA driver's functions come in as pointers (struct cpd_cuda, filled from libcuda by
 * native/upload.py): no CUDA headers or libraries are needed to build this, and tests can pass fakes.
 * Built by `pip install` as an optional extension of setup.py (-O3, -pthread) and loaded by
 * native/upload.py with ctypes; plain C11, no Python headers.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CPD_UPLOAD_ABI 2
#define MAX_SLOTS_PER_WORKER 8

int cpd_upload_abi(void) { return CPD_UPLOAD_ABI; }

typedef int (*fn_ctx_set_current)(void *ctx);
typedef int (*fn_stream_create)(void **stream, unsigned flags);
typedef int (*fn_stream_destroy)(void *stream);
typedef int (*fn_stream_wait_event)(void *stream, void *event, unsigned flags);
typedef int (*fn_stream_synchronize)(void *stream);
typedef int (*fn_event_create)(void **event, unsigned flags);
typedef int (*fn_event_destroy)(void *event);
typedef int (*fn_event_record)(void *event, void *stream);
typedef int (*fn_event_synchronize)(void *event);
typedef int (*fn_memcpy_htod_async)(uint64_t dst, const void *src, size_t n, void *stream);

/* The driver entry points (cuCtxSetCurrent, cuStreamCreate, ... cuMemcpyHtoDAsync_v2), in this order. */
struct cpd_cuda {
    fn_ctx_set_current ctx_set_current;
    fn_stream_create stream_create;
    fn_stream_destroy stream_destroy;
    fn_stream_wait_event stream_wait_event;
    fn_stream_synchronize stream_synchronize;
    fn_event_create event_create;
    fn_event_destroy event_destroy;
    fn_event_record event_record;
    fn_event_synchronize event_synchronize;
    fn_memcpy_htod_async memcpy_htod_async;
};

/* Where a failure happened (returned through *where): which call failed first. */
enum { AT_NONE = 0, AT_CONTEXT, AT_STREAM, AT_EVENT, AT_WAIT, AT_SLOT, AT_COPY, AT_RECORD, AT_SYNC, AT_THREAD };

struct shared {
    const struct cpd_cuda *cu;
    void *ctx;
    const uint64_t *dsts;       /* the ranges: device address, host address, length */
    const unsigned char *const *srcs;
    const int64_t *lens;
    const int64_t *first_piece; /* nranges + 1 prefix sums of each range's piece count */
    int64_t nranges;
    int64_t pieces;
    unsigned char *const *slots; /* workers * slots_per_worker pinned slots of slot_bytes each */
    int64_t slot_bytes;
    int slots_per_worker;
    void *after;
    atomic_llong next;
    atomic_int error;
    atomic_int where;
};

struct worker {
    struct shared *sh;
    int index;
};

static void fail(struct shared *sh, int rc, int where) {
    int none = 0;
    if (atomic_compare_exchange_strong(&sh->error, &none, rc)) atomic_store(&sh->where, where);
}

/* The range holding piece p: the last r with first_piece[r] <= p (ranges without pieces are skipped). */
static int64_t range_of(const struct shared *sh, int64_t p) {
    int64_t lo = 0, hi = sh->nranges - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (sh->first_piece[mid] <= p) lo = mid; else hi = mid - 1;
    }
    return lo;
}

static void *work(void *arg) {
    struct worker *w = (struct worker *)arg;
    struct shared *sh = w->sh;
    const struct cpd_cuda *cu = sh->cu;
    void *stream = NULL;
    void *events[MAX_SLOTS_PER_WORKER] = {0};
    int used[MAX_SLOTS_PER_WORKER] = {0};
    int rc, k = 0;

    if ((rc = cu->ctx_set_current(sh->ctx)) != 0) { fail(sh, rc, AT_CONTEXT); return NULL; }
    if ((rc = cu->stream_create(&stream, 1 /* CU_STREAM_NON_BLOCKING */)) != 0) { fail(sh, rc, AT_STREAM); return NULL; }
    for (int s = 0; s < sh->slots_per_worker; s++) {
        if ((rc = cu->event_create(&events[s], 2 /* CU_EVENT_DISABLE_TIMING */)) != 0) { fail(sh, rc, AT_EVENT); goto done; }
    }
    if (sh->after != NULL && (rc = cu->stream_wait_event(stream, sh->after, 0)) != 0) { fail(sh, rc, AT_WAIT); goto done; }
    while (atomic_load(&sh->error) == 0) {
        long long p = atomic_fetch_add(&sh->next, 1);
        if (p >= sh->pieces) break;
        int64_t r = range_of(sh, p);
        int64_t off = (p - sh->first_piece[r]) * sh->slot_bytes;
        int64_t len = sh->lens[r] - off < sh->slot_bytes ? sh->lens[r] - off : sh->slot_bytes;
        unsigned char *slot = sh->slots[(int64_t)w->index * sh->slots_per_worker + k];
        if (used[k] && (rc = cu->event_synchronize(events[k])) != 0) { fail(sh, rc, AT_SLOT); break; }
        memcpy(slot, sh->srcs[r] + off, (size_t)len);
        if ((rc = cu->memcpy_htod_async(sh->dsts[r] + (uint64_t)off, slot, (size_t)len, stream)) != 0) { fail(sh, rc, AT_COPY); break; }
        if ((rc = cu->event_record(events[k], stream)) != 0) { fail(sh, rc, AT_RECORD); break; }
        used[k] = 1;
        k = (k + 1) % sh->slots_per_worker;
    }
done:
    /* every queued DMA has finished before the slots can be reused or the call returns */
    if ((rc = cu->stream_synchronize(stream)) != 0) fail(sh, rc, AT_SYNC);
    for (int s = 0; s < sh->slots_per_worker; s++)
        if (events[s] != NULL) cu->event_destroy(events[s]);
    cu->stream_destroy(stream);
    return NULL;
}

/* Copy nranges host ranges srcs[i][0..lens[i]) to the device addresses dsts[i]; 0 when every byte is
 * there, else the first CUDA error (or -1 when a thread could not start, -2 for bad arguments), with
 * *where set to the AT_* of the call that failed. Each range is cut into slot-sized pieces, taken in
 * order by whichever worker is free. slots: workers * slots_per_worker pinned host buffers of
 * slot_bytes each, used by no one else meanwhile. */
int cpd_upload(const struct cpd_cuda *cu, void *ctx, const uint64_t *dsts, const unsigned char *const *srcs,
               const int64_t *lens, int64_t nranges, unsigned char *const *slots, int64_t slot_bytes,
               int workers, int slots_per_worker, void *after, int *where) {
    *where = AT_NONE;
    if (workers < 1 || slots_per_worker < 1 || slots_per_worker > MAX_SLOTS_PER_WORKER || slot_bytes < 1 || nranges < 0) {
        *where = AT_THREAD;
        return -2;
    }
    int64_t *first_piece = (int64_t *)malloc((size_t)(nranges + 1) * sizeof(int64_t));
    if (first_piece == NULL) { *where = AT_THREAD; return -1; }
    first_piece[0] = 0;
    for (int64_t r = 0; r < nranges; r++) {
        if (lens[r] < 0) { free(first_piece); *where = AT_THREAD; return -2; }
        first_piece[r + 1] = first_piece[r] + (lens[r] + slot_bytes - 1) / slot_bytes;
    }
    int64_t pieces = first_piece[nranges];
    if (pieces == 0) { free(first_piece); return 0; }

    struct shared sh;
    sh.cu = cu;
    sh.ctx = ctx;
    sh.dsts = dsts;
    sh.srcs = srcs;
    sh.lens = lens;
    sh.first_piece = first_piece;
    sh.nranges = nranges;
    sh.pieces = pieces;
    sh.slots = slots;
    sh.slot_bytes = slot_bytes;
    sh.slots_per_worker = slots_per_worker;
    sh.after = after;
    atomic_init(&sh.next, 0);
    atomic_init(&sh.error, 0);
    atomic_init(&sh.where, AT_NONE);

    if ((int64_t)workers > pieces) workers = (int)pieces;
    pthread_t *threads = (pthread_t *)calloc((size_t)workers, sizeof(pthread_t));
    struct worker *ws = (struct worker *)calloc((size_t)workers, sizeof(struct worker));
    int started = 0;
    if (threads == NULL || ws == NULL) {
        fail(&sh, -1, AT_THREAD);
    } else {
        for (; started < workers; started++) {
            ws[started].sh = &sh;
            ws[started].index = started;
            if (pthread_create(&threads[started], NULL, work, &ws[started]) != 0) {
                fail(&sh, -1, AT_THREAD); /* the started ones see the error and stop after their current piece */
                break;
            }
        }
        for (int t = 0; t < started; t++) pthread_join(threads[t], NULL);
    }
    free(threads);
    free(ws);
    free(first_piece);
    *where = atomic_load(&sh.where);
    return atomic_load(&sh.error);
}
