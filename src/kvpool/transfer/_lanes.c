/* kvpool.transfer._lanes: a TCP lane's pipeline of large READs or WRITEs, with no Python between parts;
 * and copy_into, the shared-memory transport's copy (at the end of this file).
 *
 * Why native: a batched transfer of 1 MiB parts spends most of its client CPU in the kernel's copies
 * and the checksums, but the Python between the socket calls (build the iovec, parse each reply header,
 * hand the GIL to the other lanes and back around every syscall) took a large share of the client's CPU
 * (figures: docs/decisions/0016-native-lane-loop.md). This module runs exactly the loop of
 * tcp._Lane._pipeline for a job of same-op parts, with the GIL released for the whole job: the same
 * frames (built by Python), the same window and in-flight cap, the same order of replies, the same
 * checks, the same deadline re-arming. Python keeps everything else (framing, checksums, retries, errors).
 *
 * pipeline(fd, frames, buffers, first_req_id, window, max_inflight, at, armed, op, write_op, closing, sources)
 *     fd            a connected blocking socket (its FrameReader holds no read-ahead bytes)
 *     frames        one request frame (bytes-like) per part, request ids first_req_id, first_req_id + 1, ...
 *     buffers       one contiguous buffer per part: a READ's reply payload lands in it, exactly (it must
 *                   be writable); a WRITE's payload is sent from it right after its frame
 *     window        frames in flight at most; READs are (re)sent half a window at a time, WRITEs as soon
 *                   as there is room
 *     max_inflight  payload bytes in flight at most (a part is always allowed when none is)
 *     at            the deadline, time.monotonic() seconds, or None
 *     armed         the socket's current SO_RCVTIMEO/SO_SNDTIMEO in seconds, or None (none set)
 *     op            the requests' op (op == write_op: WRITEs, whose replies carry no payload; else READs)
 *     closing       statuses after which the store closes the connection: they stop the job, as does a
 *                   failure status in a reply of another op (a HELLO refusing the token)
 *     sources       READs: per part, where in its 4 KiB page the store's first byte of the reply payload
 *                   lies when the store sends it from the segment's pages (-1: not known), or None. A
 *                   part whose reply says so (FLAG_FROM_PAGES) and whose destination starts 1-63 bytes
 *                   past that modulo 4 KiB is received through a bounce buffer ("Bounced receives" below)
 * -> (codes, outcome, reply_op, message, armed)
 *     codes         the status of each answered part, in order (a prefix of the parts)
 *     outcome       DONE, STOPPED (the last code is the stopping status), BAD_FRAME, TIMED_OUT or
 *                   CONNECTION_FAILED (message says why)
 *     reply_op      the op of the last reply header read
 *     armed         the socket's timeout now, for the caller's bookkeeping
 *
 * A READ's bytes only ever land in buffers[i], and only when the reply for part i says OK with exactly
 * len(buffers[i]) bytes: a malformed or hostile reply cannot write outside the caller's buffers.
 *
 * Bounced receives. The kernel copies socket data into user memory with `rep movsb`, which on AMD Zen
 * runs slower when the destination is 1-63 bytes past the source modulo 4 KiB (glibc's memcpy too,
 * between 4 and 512 KiB: vector_copy; figures: docs/decisions/0050-measurements.md). A store started with
 * --read-sendfile sends a large READ from its segment's pages and flags the reply FLAG_FROM_PAGES, so the
 * source of part i is known: sources[i]. (A copied reply's source is wherever the store's kernel put it
 * in its socket buffers, unknown here: it is received directly.) A destination 16
 * bytes into its page (a large numpy array or bytearray: glibc's chunk header) is exactly that case.
 * Such a part is received BOUNCE_BYTES at a time into a page-aligned scratch buffer at the source's
 * offset, then copied with vector moves (vector_copy); what that gained is in
 * docs/decisions/0050-measurements.md.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <time.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define MAGIC 0x3150564Bu /* b"KVP1" little-endian, as frames.MAGIC */
#define HEADER_SIZE 28    /* frames.HEADER: <IHHiQQ */
#define FLAG_FROM_PAGES 2 /* frames.FLAG_FROM_PAGES: a READ reply sent from the segment's pages */
#define MAX_CLOSING 16
#define PAGE 4096u
#define SHORT_DISTANCE 63u      /* destination this far past the source (mod PAGE): the slow copy */
#define BOUNCE_BYTES (256u << 10) /* a multiple of PAGE: every chunk keeps the source's page offset */
#define RELEASE_GIL_BYTES (256 << 10) /* copy_into: a shorter copy (< 10 us) keeps the GIL */

enum outcome { DONE = 0, STOPPED = 1, BAD_FRAME = 2, TIMED_OUT = 3, CONNECTION_FAILED = 4 };

typedef struct {
    int fd;
    int has_deadline;
    double at;    /* CLOCK_MONOTONIC seconds, as time.monotonic() on Linux */
    double armed; /* < 0: no timeout set on the socket */
    char message[160];
} io_t;

static double monotonic_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* tcp._Lane._arm: keep the kernel timeouts within a little of the time left (a setsockopt per syscall
 * would cost more than the check). Returns an outcome. */
static int arm(io_t *io) {
    if (!io->has_deadline) {
        return DONE;
    }
    double remaining = io->at - monotonic_now();
    if (remaining <= 0) {
        snprintf(io->message, sizeof io->message, "deadline passed mid-transfer");
        return TIMED_OUT;
    }
    double slack = remaining * 0.1 > 0.002 ? remaining * 0.1 : 0.002;
    if (io->armed < 0 || io->armed - remaining > slack) {
        long long micros = (long long)(remaining * 1e6);
        if (micros < 1) {
            micros = 1; /* 0 would mean "forever" */
        }
        struct timeval tv = {.tv_sec = micros / 1000000, .tv_usec = micros % 1000000};
        if (setsockopt(io->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0 ||
            setsockopt(io->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0) {
            snprintf(io->message, sizeof io->message, "setsockopt: %s", strerror(errno));
            return CONNECTION_FAILED;
        }
        io->armed = remaining;
    }
    return DONE;
}

static int socket_error(io_t *io, int err) {
    if (err == EAGAIN || err == EWOULDBLOCK) { /* the kernel timeout: the deadline passed */
        snprintf(io->message, sizeof io->message, "deadline passed mid-transfer");
        return TIMED_OUT;
    }
    snprintf(io->message, sizeof io->message, "%s", strerror(err));
    return CONNECTION_FAILED;
}

static int send_all(io_t *io, struct iovec *iov, int count) {
    while (count > 0) {
        int rc = arm(io);
        if (rc != DONE) {
            return rc;
        }
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)count;
        ssize_t sent = sendmsg(io->fd, &msg, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) {
                continue;
            }
            return socket_error(io, errno);
        }
        while (count > 0 && (size_t)sent >= iov->iov_len) {
            sent -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count > 0) {
            iov->iov_base = (char *)iov->iov_base + sent;
            iov->iov_len -= (size_t)sent;
        }
    }
    return DONE;
}

static int recv_all(io_t *io, char *into, size_t n) {
    while (n > 0) {
        int rc = arm(io);
        if (rc != DONE) {
            return rc;
        }
        ssize_t got = recv(io->fd, into, n, MSG_WAITALL);
        if (got == 0) {
            snprintf(io->message, sizeof io->message, "connection closed by peer");
            return CONNECTION_FAILED;
        }
        if (got < 0) {
            if (errno == EINTR) {
                continue;
            }
            return socket_error(io, errno);
        }
        into += got;
        n -= (size_t)got;
    }
    return DONE;
}

typedef struct {
    Py_ssize_t n;
    Py_buffer *frames;
    Py_buffer *buffers; /* READ: where each reply's payload lands; WRITE: each request's payload */
    uint64_t first_req_id;
    Py_ssize_t window;
    long long max_inflight;
    unsigned op;
    int writes; /* op is WRITE: payloads go out after their frames, replies carry none */
    int32_t closing[MAX_CLOSING];
    int n_closing;
    const int16_t *sources; /* READs: the page offset of each part's source, -1 unknown; or NULL */
    char *bounce;     /* BOUNCE_BYTES + PAGE, page-aligned; allocated on first use, freed by the caller */
    int32_t *codes;   /* out: one per answered part */
    Py_ssize_t done;  /* out: parts answered */
    unsigned reply_op; /* out: the op of the last reply read */
} job_t;

static int is_closing(const job_t *job, int32_t status) {
    for (int i = 0; i < job->n_closing; i++) {
        if (job->closing[i] == status) {
            return 1;
        }
    }
    return 0;
}

/* Sends the next frames that fit (the window, the in-flight cap), as one vectored send. */
static int refill(io_t *io, job_t *job, Py_ssize_t *next_send, long long *inflight_bytes, struct iovec *iov) {
    int count = 0;
    while (*next_send < job->n && *next_send - job->done < job->window) {
        Py_ssize_t i = *next_send;
        if (i > job->done && *inflight_bytes + job->buffers[i].len > job->max_inflight) {
            break;
        }
        iov[count].iov_base = job->frames[i].buf;
        iov[count].iov_len = (size_t)job->frames[i].len;
        if (job->writes) {
            count++;
            iov[count].iov_base = job->buffers[i].buf;
            iov[count].iov_len = (size_t)job->buffers[i].len;
        }
        *inflight_bytes += job->buffers[i].len;
        count++;
        (*next_send)++;
    }
    return send_all(io, iov, count);
}

static int short_distance(const char *dest, int source) {
    unsigned distance = (unsigned)(((uintptr_t)dest - (uintptr_t)source) & (PAGE - 1));
    return source >= 0 && distance >= 1 && distance <= SHORT_DISTANCE;
}

/* memcpy without `rep movsb`: glibc's memcpy uses it for sizes between a few KiB and its non-temporal
 * threshold, the very copy that is slow at a short distance (docs/decisions/0050-measurements.md);
 * 16-byte vector moves run at full speed there. */
static void vector_copy(char *dest, const char *src, size_t n) {
#ifdef __SSE2__
    for (; n >= 64; n -= 64, src += 64, dest += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_storeu_si128((__m128i *)dest, a);
        _mm_storeu_si128((__m128i *)(dest + 16), b);
        _mm_storeu_si128((__m128i *)(dest + 32), c);
        _mm_storeu_si128((__m128i *)(dest + 48), d);
    }
#endif
    memcpy(dest, src, n);
}

static void copy_plain(char *dest, const char *src, size_t n) { memcpy(dest, src, n); }

/* Receives n bytes into dest through job->bounce, at the source's page offset (module docstring). */
static int recv_bounced(io_t *io, job_t *job, char *dest, size_t n, int source) {
    if (job->bounce == NULL) {
        void *bounce = NULL;
        if (posix_memalign(&bounce, PAGE, BOUNCE_BYTES + PAGE) != 0) {
            return recv_all(io, dest, n); /* no memory for the scratch: the slow copy still lands right */
        }
        job->bounce = bounce;
    }
    char *at = job->bounce + source;
    while (n > 0) {
        size_t chunk = n < BOUNCE_BYTES ? n : BOUNCE_BYTES;
        int rc = recv_all(io, at, chunk);
        if (rc != DONE) {
            return rc;
        }
        vector_copy(dest, at, chunk);
        dest += chunk;
        n -= chunk;
    }
    return DONE;
}

/* Reads the reply to part job->done: header, checks, then (OK) the payload into its destination. */
static int receive(io_t *io, job_t *job) {
    unsigned char header[HEADER_SIZE];
    int rc = recv_all(io, (char *)header, HEADER_SIZE);
    if (rc != DONE) {
        return rc;
    }
    uint32_t magic;
    uint16_t reply_op, flags;
    int32_t status;
    uint64_t req_id, length;
    memcpy(&magic, header, 4);
    memcpy(&reply_op, header + 4, 2);
    memcpy(&flags, header + 6, 2);
    memcpy(&status, header + 8, 4);
    memcpy(&req_id, header + 12, 8);
    memcpy(&length, header + 20, 8);
    job->reply_op = reply_op;
    Py_ssize_t i = job->done;
    if (magic != MAGIC) {
        snprintf(io->message, sizeof io->message, "bad magic 0x%08x", magic);
        return BAD_FRAME;
    }
    if (status != 0 && (is_closing(job, status) || reply_op != job->op)) {
        job->codes[i] = status;
        job->done++;
        return STOPPED;
    }
    if (req_id != job->first_req_id + (uint64_t)i) {
        snprintf(io->message, sizeof io->message, "response %llu for request %llu", (unsigned long long)req_id,
                 (unsigned long long)(job->first_req_id + (uint64_t)i));
        return BAD_FRAME;
    }
    if (job->writes) {
        if (length != 0) {
            snprintf(io->message, sizeof io->message, "unexpected %llu-byte payload in a WRITE reply",
                     (unsigned long long)length);
            return BAD_FRAME;
        }
    } else if (status == 0) {
        if (length != (uint64_t)job->buffers[i].len) {
            snprintf(io->message, sizeof io->message, "READ answered with %llu bytes, %lld asked",
                     (unsigned long long)length, (long long)job->buffers[i].len);
            return BAD_FRAME;
        }
        char *dest = job->buffers[i].buf;
        if ((flags & FLAG_FROM_PAGES) && job->sources != NULL && short_distance(dest, job->sources[i])) {
            rc = recv_bounced(io, job, dest, (size_t)length, job->sources[i]);
        } else {
            rc = recv_all(io, dest, (size_t)length);
        }
        if (rc != DONE) {
            return rc;
        }
    } else if (length != 0) {
        snprintf(io->message, sizeof io->message, "unexpected %llu-byte payload in a failed READ reply",
                 (unsigned long long)length);
        return BAD_FRAME;
    }
    job->codes[i] = status;
    job->done++;
    return DONE;
}

/* The pipeline; runs without the GIL. */
static int run_job(io_t *io, job_t *job, struct iovec *iov) {
    Py_ssize_t next_send = 0;
    long long inflight_bytes = 0;
    Py_ssize_t refill_at = job->window / 2;
    while (job->done < job->n) {
        /* READ frames are tiny: refilled half a window at a time (one send, one store wake-up per burst);
         * a WRITE goes as soon as there is room, as in tcp._Lane._pipeline. */
        if (next_send < job->n && (job->writes || next_send - job->done <= refill_at)) {
            int rc = refill(io, job, &next_send, &inflight_bytes, iov);
            if (rc != DONE) {
                return rc;
            }
        }
        Py_ssize_t i = job->done;
        int rc = receive(io, job);
        if (rc != DONE) {
            return rc;
        }
        inflight_bytes -= job->buffers[i].len;
    }
    return DONE;
}

static void release_buffers(Py_buffer *buffers, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        PyBuffer_Release(&buffers[i]);
    }
}

/* Fills job->frames and job->buffers from the sequences; on failure nothing is held. */
static int take_buffers(PyObject *frames, PyObject *buffers, job_t *job) {
    int flags = job->writes ? PyBUF_SIMPLE : PyBUF_WRITABLE;
    Py_ssize_t f = 0, b = 0;
    for (; f < job->n; f++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(frames, f), &job->frames[f], PyBUF_SIMPLE) != 0) {
            goto fail;
        }
    }
    for (; b < job->n; b++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(buffers, b), &job->buffers[b], flags) != 0) {
            goto fail;
        }
    }
    return 0;
fail:
    release_buffers(job->frames, f);
    release_buffers(job->buffers, b);
    return -1;
}

static int parse_closing(PyObject *closing, job_t *job) {
    PyObject *seq = PySequence_Fast(closing, "closing must be a sequence of ints");
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count > MAX_CLOSING) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many closing statuses");
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        long status = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (status == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        job->closing[i] = (int32_t)status;
    }
    job->n_closing = (int)count;
    Py_DECREF(seq);
    return 0;
}

/* sources: None, or one int per part in [-1, PAGE). Fills *out (PyMem, freed by the caller) or NULL. */
static int parse_sources(PyObject *sources, Py_ssize_t n, int16_t **out) {
    *out = NULL;
    if (sources == Py_None) {
        return 0;
    }
    PyObject *seq = PySequence_Fast(sources, "sources must be None or a sequence of ints");
    if (seq == NULL) {
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "one source per frame");
        return -1;
    }
    int16_t *offsets = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(int16_t));
    if (offsets == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long offset = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (offset == -1 && PyErr_Occurred()) {
            PyMem_Free(offsets);
            Py_DECREF(seq);
            return -1;
        }
        if (offset < -1 || offset >= (long)PAGE) {
            PyMem_Free(offsets);
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "a source page offset must be in [-1, 4096)");
            return -1;
        }
        offsets[i] = (int16_t)offset;
    }
    Py_DECREF(seq);
    *out = offsets;
    return 0;
}

static int parse_seconds(PyObject *value, double *out, int *present) {
    if (value == Py_None) {
        *present = 0;
        return 0;
    }
    *out = PyFloat_AsDouble(value);
    if (*out == -1.0 && PyErr_Occurred()) {
        return -1;
    }
    *present = 1;
    return 0;
}

static PyObject *build_result(const job_t *job, int outcome, const io_t *io) {
    PyObject *codes = PyList_New(job->done);
    if (codes == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < job->done; i++) {
        PyObject *code = PyLong_FromLong(job->codes[i]);
        if (code == NULL) {
            Py_DECREF(codes);
            return NULL;
        }
        PyList_SET_ITEM(codes, i, code);
    }
    PyObject *armed = io->armed < 0 ? Py_NewRef(Py_None) : PyFloat_FromDouble(io->armed);
    if (armed == NULL) {
        Py_DECREF(codes);
        return NULL;
    }
    return Py_BuildValue("(NiIsN)", codes, outcome, job->reply_op, io->message, armed);
}

static PyObject *pipeline(PyObject *module, PyObject *args) {
    (void)module;
    int fd;
    PyObject *frames_arg, *buffers_arg, *at_arg, *armed_arg, *closing_arg, *sources_arg = Py_None;
    unsigned long long first_req_id;
    Py_ssize_t window;
    long long max_inflight;
    unsigned op, write_op;
    if (!PyArg_ParseTuple(args, "iOOKnLOOIIO|O:pipeline", &fd, &frames_arg, &buffers_arg, &first_req_id, &window,
                          &max_inflight, &at_arg, &armed_arg, &op, &write_op, &closing_arg, &sources_arg)) {
        return NULL;
    }
    if (window < 1 || max_inflight < 1) {
        PyErr_SetString(PyExc_ValueError, "window and max_inflight must be >= 1");
        return NULL;
    }
    io_t io = {.fd = fd, .armed = -1.0, .message = ""};
    job_t job = {.first_req_id = first_req_id, .window = window, .max_inflight = max_inflight, .op = op};
    job.writes = op == write_op;
    int has_armed; /* io.armed stays -1 (none set) when armed is None */
    if (parse_seconds(at_arg, &io.at, &io.has_deadline) != 0 || parse_seconds(armed_arg, &io.armed, &has_armed) != 0 ||
        parse_closing(closing_arg, &job) != 0) {
        return NULL;
    }
    PyObject *frames = PySequence_Fast(frames_arg, "frames must be a sequence");
    if (frames == NULL) {
        return NULL;
    }
    PyObject *buffers = PySequence_Fast(buffers_arg, "buffers must be a sequence");
    if (buffers == NULL) {
        Py_DECREF(frames);
        return NULL;
    }
    PyObject *result = NULL;
    job.n = PySequence_Fast_GET_SIZE(frames);
    if (PySequence_Fast_GET_SIZE(buffers) != job.n) {
        PyErr_SetString(PyExc_ValueError, "one buffer per frame");
        goto out;
    }
    int16_t *sources = NULL;
    if (parse_sources(sources_arg, job.n, &sources) != 0) {
        goto out;
    }
    job.sources = sources;
    Py_ssize_t slots = job.n > 0 ? job.n : 1;
    Py_ssize_t iov_slots = 2 * (window < slots ? window : slots); /* a frame and (WRITE) its payload */
    job.frames = PyMem_Calloc((size_t)slots, sizeof(Py_buffer));
    job.buffers = PyMem_Calloc((size_t)slots, sizeof(Py_buffer));
    job.codes = PyMem_Calloc((size_t)slots, sizeof(int32_t));
    struct iovec *iov = PyMem_Calloc((size_t)iov_slots, sizeof(struct iovec));
    if (job.frames == NULL || job.buffers == NULL || job.codes == NULL || iov == NULL) {
        PyErr_NoMemory();
    } else if (take_buffers(frames, buffers, &job) == 0) {
        int outcome;
        Py_BEGIN_ALLOW_THREADS;
        outcome = run_job(&io, &job, iov);
        Py_END_ALLOW_THREADS;
        release_buffers(job.frames, job.n);
        release_buffers(job.buffers, job.n);
        result = build_result(&job, outcome, &io);
    }
    free(job.bounce);
    PyMem_Free(sources);
    PyMem_Free(iov);
    PyMem_Free(job.codes);
    PyMem_Free(job.buffers);
    PyMem_Free(job.frames);
out:
    Py_DECREF(buffers);
    Py_DECREF(frames);
    return result;
}

/* copy_into(dest, src): dest[:] = src, without the slow short-distance copy (vector_copy) and, for a
 * large copy, with the GIL released. The shared-memory transport's copies between a mapped segment and
 * the caller's buffer. */
static PyObject *copy_into(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        return PyErr_Format(PyExc_TypeError, "copy_into takes 2 arguments (%zd given)", nargs);
    }
    Py_buffer dest, src;
    if (PyObject_GetBuffer(args[0], &dest, PyBUF_WRITABLE) != 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &src, PyBUF_SIMPLE) != 0) {
        PyBuffer_Release(&dest);
        return NULL;
    }
    PyObject *result = Py_None;
    if (dest.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy_into: %zd-byte destination, %zd-byte source", dest.len, src.len);
        result = NULL;
    } else {
        int short_copy = short_distance(dest.buf, (int)((uintptr_t)src.buf & (PAGE - 1)));
        void (*copy)(char *, const char *, size_t) = short_copy ? vector_copy : copy_plain;
        if (dest.len >= RELEASE_GIL_BYTES) {
            Py_BEGIN_ALLOW_THREADS;
            copy(dest.buf, src.buf, (size_t)dest.len);
            Py_END_ALLOW_THREADS;
        } else {
            copy(dest.buf, src.buf, (size_t)dest.len);
        }
    }
    PyBuffer_Release(&dest);
    PyBuffer_Release(&src);
    return Py_XNewRef(result);
}

static PyMethodDef methods[] = {
    {"pipeline", pipeline, METH_VARARGS, "A lane's pipeline of large READs or WRITEs (module docstring)."},
    {"copy_into", (PyCFunction)(void (*)(void))copy_into, METH_FASTCALL, "dest[:] = src, fast whatever the buffers' alignment (_lanes.c)."},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvpool.transfer._lanes",
    .m_doc = "A TCP lane's pipeline of large READs or WRITEs, with the GIL released (see _lanes.c).",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__lanes(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(module, "DONE", DONE) != 0 || PyModule_AddIntConstant(module, "STOPPED", STOPPED) != 0 ||
        PyModule_AddIntConstant(module, "BAD_FRAME", BAD_FRAME) != 0 ||
        PyModule_AddIntConstant(module, "TIMED_OUT", TIMED_OUT) != 0 ||
        PyModule_AddIntConstant(module, "CONNECTION_FAILED", CONNECTION_FAILED) != 0 ||
        PyModule_AddIntConstant(module, "FLAG_FROM_PAGES", FLAG_FROM_PAGES) != 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
