/* kvpool.transfer._lanes: a TCP lane's pipeline of large READs or WRITEs, with no Python between parts.
 *
 * Why native: a batched transfer of 1 MiB parts spends most of its client CPU in the kernel's copies
 * and the checksums, but the Python between the socket calls (build the iovec, parse each reply header,
 * hand the GIL to the other lanes and back around every syscall) measured 10-25 % of the client's CPU
 * per GB on a 2-vCPU host (docs/decisions/0016-native-lane-loop.md). This module runs exactly the loop of
 * tcp._Lane._pipeline for a job of same-op parts, with the GIL released for the whole job: the same
 * frames (built by Python), the same window and in-flight cap, the same order of replies, the same
 * checks, the same deadline re-arming. Python keeps everything else (framing, checksums, retries, errors).
 *
 * pipeline(fd, frames, buffers, first_req_id, window, max_inflight, at, armed, op, write_op, closing)
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
 * -> (codes, outcome, reply_op, message, armed)
 *     codes         the status of each answered part, in order (a prefix of the parts)
 *     outcome       DONE, STOPPED (the last code is the stopping status), BAD_FRAME, TIMED_OUT or
 *                   CONNECTION_FAILED (message says why)
 *     reply_op      the op of the last reply header read
 *     armed         the socket's timeout now, for the caller's bookkeeping
 *
 * A READ's bytes only ever land in buffers[i], and only when the reply for part i says OK with exactly
 * len(buffers[i]) bytes: a malformed or hostile reply cannot write outside the caller's buffers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <time.h>

#define MAGIC 0x3150564Bu /* b"KVP1" little-endian, as frames.MAGIC */
#define HEADER_SIZE 28    /* frames.HEADER: <IHHiQQ */
#define MAX_CLOSING 16

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

/* Reads the reply to part job->done: header, checks, then (OK) the payload into its destination. */
static int receive(io_t *io, job_t *job) {
    unsigned char header[HEADER_SIZE];
    int rc = recv_all(io, (char *)header, HEADER_SIZE);
    if (rc != DONE) {
        return rc;
    }
    uint32_t magic;
    uint16_t reply_op;
    int32_t status;
    uint64_t req_id, length;
    memcpy(&magic, header, 4);
    memcpy(&reply_op, header + 4, 2);
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
        rc = recv_all(io, job->buffers[i].buf, (size_t)length);
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
    PyObject *frames_arg, *buffers_arg, *at_arg, *armed_arg, *closing_arg;
    unsigned long long first_req_id;
    Py_ssize_t window;
    long long max_inflight;
    unsigned op, write_op;
    if (!PyArg_ParseTuple(args, "iOOKnLOOIIO:pipeline", &fd, &frames_arg, &buffers_arg, &first_req_id, &window,
                          &max_inflight, &at_arg, &armed_arg, &op, &write_op, &closing_arg)) {
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
    PyMem_Free(iov);
    PyMem_Free(job.codes);
    PyMem_Free(job.buffers);
    PyMem_Free(job.frames);
out:
    Py_DECREF(buffers);
    Py_DECREF(frames);
    return result;
}

static PyMethodDef methods[] = {
    {"pipeline", pipeline, METH_VARARGS, "A lane's pipeline of large READs or WRITEs (module docstring)."},
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
        PyModule_AddIntConstant(module, "CONNECTION_FAILED", CONNECTION_FAILED) != 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
