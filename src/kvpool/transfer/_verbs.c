/* kvpool.transfer._verbs: the RDMA data path's verbs objects and its posting loop, over libibverbs
 * (docs/decisions/0027-native-verbs-data-path.md).
 *
 * Why native: posting a 64 KiB page from Python cost a few microseconds of client CPU (building the work
 * request, the loop, the bookkeeping: decision 0021), above issue 26's 1 us per work request. pyverbs does
 * not expose the raw `struct ibv_qp *` a C poster needs, so this module owns the data path's verbs objects
 * itself: device, PD, MRs, CQs and RC QPs, and the hot calls post_chunks / post_list (one chain of
 * `struct ibv_send_wr`, one `ibv_post_send`) and poll (one `ibv_poll_cq`).
 *
 * Handles are the objects' addresses as Python ints; verbs_native.py owns them (one Python object per
 * handle, closed once). Errors raise OSError(errno, message).
 *
 * The FAKE provider. `ibv_post_send` and `ibv_poll_cq` are static inlines that call through
 * `qp->context->ops.post_send` and `cq->context->ops.poll_cq`. A fake QP and a fake CQ here belong to a fake
 * `struct ibv_context` whose ops table points at fake_post_send / fake_poll_cq, so the compiled posting
 * code is exactly the one a real NIC's provider is called from. fake_post_send makes the checks a provider
 * makes at post time (QP state, send-queue room, an injected refusal) and records the requests in the QP's
 * ring; the FAKE NIC (verbs_fake / verbs_fake_ipc, in Python) takes them from the ring, checks MR bounds,
 * rkeys and windows as an HCA does, moves the bytes and pushes completions (fake_complete), which
 * fake_poll_cq hands out, freeing a send-queue slot each, as hardware does.
 *
 * The GIL is held throughout: a post or a poll of a window is well under a microsecond of C on mlx5 and on
 * the fake, less than what releasing and re-taking the GIL costs (decision 0027).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <arpa/inet.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define WR_FIELDS 7 /* wr_id, opcode, local_addr, length, lkey, remote_addr, rkey */
#define STACK_WRS 256

static PyObject *raise_errno(int err, const char *what) {
    if (err <= 0) {
        err = EIO;
    }
    PyObject *args = Py_BuildValue("(iN)", err, PyUnicode_FromFormat("%s: %s", what, strerror(err)));
    if (args != NULL) {
        PyErr_SetObject(PyExc_OSError, args);
        Py_DECREF(args);
    }
    return NULL;
}

static void *as_ptr(PyObject *value) { return PyLong_AsVoidPtr(value); }

/* ------------------------------------------------------------------ devices */
static PyObject *list_devices(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    int n = 0;
    struct ibv_device **devices = ibv_get_device_list(&n);
    if (devices == NULL) {
        return raise_errno(errno, "ibv_get_device_list");
    }
    PyObject *out = PyList_New(0);
    for (int i = 0; out != NULL && i < n; i++) {
        PyObject *name = PyUnicode_FromString(ibv_get_device_name(devices[i]));
        if (name == NULL || PyList_Append(out, name) != 0) {
            Py_XDECREF(name);
            Py_CLEAR(out);
            break;
        }
        Py_DECREF(name);
    }
    ibv_free_device_list(devices);
    return out;
}

static PyObject *open_device(PyObject *self, PyObject *args) {
    (void)self;
    const char *wanted;
    if (!PyArg_ParseTuple(args, "s", &wanted)) {
        return NULL;
    }
    int n = 0;
    struct ibv_device **devices = ibv_get_device_list(&n);
    if (devices == NULL) {
        return raise_errno(errno, "ibv_get_device_list");
    }
    struct ibv_context *ctx = NULL;
    int err = ENODEV;
    for (int i = 0; i < n; i++) {
        if (strcmp(ibv_get_device_name(devices[i]), wanted) == 0) {
            ctx = ibv_open_device(devices[i]);
            err = errno;
            break;
        }
    }
    ibv_free_device_list(devices);
    if (ctx == NULL) {
        return raise_errno(err, "ibv_open_device");
    }
    return PyLong_FromVoidPtr(ctx);
}

static PyObject *close_device(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    if (!PyArg_ParseTuple(args, "O", &handle)) {
        return NULL;
    }
    int rc = ibv_close_device((struct ibv_context *)as_ptr(handle));
    return rc ? raise_errno(rc, "ibv_close_device") : Py_NewRef(Py_None);
}

/* -> (max_mr_size, max_qp_wr, max_qp_rd_atom) */
static PyObject *query_device(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    if (!PyArg_ParseTuple(args, "O", &handle)) {
        return NULL;
    }
    struct ibv_device_attr attr;
    int rc = ibv_query_device((struct ibv_context *)as_ptr(handle), &attr);
    if (rc) {
        return raise_errno(rc, "ibv_query_device");
    }
    return Py_BuildValue("(Kii)", (unsigned long long)attr.max_mr_size, attr.max_qp_wr, attr.max_qp_rd_atom);
}

/* -> (lid, active_mtu, gid as 8 groups of 4 hex digits) */
static PyObject *query_port(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    int port, gid_index;
    if (!PyArg_ParseTuple(args, "Oii", &handle, &port, &gid_index)) {
        return NULL;
    }
    struct ibv_context *ctx = as_ptr(handle);
    struct ibv_port_attr attr;
    int rc = ibv_query_port(ctx, (uint8_t)port, &attr);
    if (rc) {
        return raise_errno(rc, "ibv_query_port");
    }
    union ibv_gid gid;
    rc = ibv_query_gid(ctx, (uint8_t)port, gid_index, &gid);
    if (rc) {
        return raise_errno(rc, "ibv_query_gid");
    }
    char text[40];
    const uint8_t *raw = gid.raw;
    snprintf(text, sizeof text, "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x", raw[0],
             raw[1], raw[2], raw[3], raw[4], raw[5], raw[6], raw[7], raw[8], raw[9], raw[10], raw[11], raw[12], raw[13],
             raw[14], raw[15]);
    return Py_BuildValue("(iis)", attr.lid, (int)attr.active_mtu, text);
}

static PyObject *alloc_pd(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    if (!PyArg_ParseTuple(args, "O", &handle)) {
        return NULL;
    }
    struct ibv_pd *pd = ibv_alloc_pd((struct ibv_context *)as_ptr(handle));
    return pd == NULL ? raise_errno(errno, "ibv_alloc_pd") : PyLong_FromVoidPtr(pd);
}

static PyObject *dealloc_pd(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    if (!PyArg_ParseTuple(args, "O", &handle)) {
        return NULL;
    }
    int rc = ibv_dealloc_pd((struct ibv_pd *)as_ptr(handle));
    return rc ? raise_errno(rc, "ibv_dealloc_pd") : Py_NewRef(Py_None);
}

/* -> (mr, lkey, rkey) */
static PyObject *reg_mr(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    unsigned long long addr, length;
    int access;
    if (!PyArg_ParseTuple(args, "OKKi", &handle, &addr, &length, &access)) {
        return NULL;
    }
    struct ibv_mr *mr = ibv_reg_mr((struct ibv_pd *)as_ptr(handle), (void *)(uintptr_t)addr, (size_t)length, access);
    if (mr == NULL) {
        return raise_errno(errno, "ibv_reg_mr");
    }
    return Py_BuildValue("(NII)", PyLong_FromVoidPtr(mr), mr->lkey, mr->rkey);
}

static PyObject *dereg_mr(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    if (!PyArg_ParseTuple(args, "O", &handle)) {
        return NULL;
    }
    int rc = ibv_dereg_mr((struct ibv_mr *)as_ptr(handle));
    return rc ? raise_errno(rc, "ibv_dereg_mr") : Py_NewRef(Py_None);
}

static PyObject *create_cq(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    int depth;
    if (!PyArg_ParseTuple(args, "Oi", &handle, &depth)) {
        return NULL;
    }
    struct ibv_cq *cq = ibv_create_cq((struct ibv_context *)as_ptr(handle), depth, NULL, NULL, 0);
    return cq == NULL ? raise_errno(errno, "ibv_create_cq") : PyLong_FromVoidPtr(cq);
}

static PyObject *destroy_cq(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    if (!PyArg_ParseTuple(args, "O", &handle)) {
        return NULL;
    }
    int rc = ibv_destroy_cq((struct ibv_cq *)as_ptr(handle));
    return rc ? raise_errno(rc, "ibv_destroy_cq") : Py_NewRef(Py_None);
}

/* An RC QP whose every send WR is signaled, with a minimal receive queue (one-sided ops only). -> (qp, qp_num) */
static PyObject *create_qp(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *pd_handle, *cq_handle;
    int max_send_wr;
    if (!PyArg_ParseTuple(args, "OOi", &pd_handle, &cq_handle, &max_send_wr)) {
        return NULL;
    }
    struct ibv_cq *cq = as_ptr(cq_handle);
    struct ibv_qp_init_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.send_cq = cq;
    attr.recv_cq = cq;
    attr.qp_type = IBV_QPT_RC;
    attr.sq_sig_all = 1;
    attr.cap.max_send_wr = (uint32_t)max_send_wr;
    attr.cap.max_recv_wr = 1;
    attr.cap.max_send_sge = 1;
    attr.cap.max_recv_sge = 1;
    struct ibv_qp *qp = ibv_create_qp((struct ibv_pd *)as_ptr(pd_handle), &attr);
    if (qp == NULL) {
        return raise_errno(errno, "ibv_create_qp");
    }
    return Py_BuildValue("(NI)", PyLong_FromVoidPtr(qp), qp->qp_num);
}

static PyObject *destroy_qp(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    if (!PyArg_ParseTuple(args, "O", &handle)) {
        return NULL;
    }
    int rc = ibv_destroy_qp((struct ibv_qp *)as_ptr(handle));
    return rc ? raise_errno(rc, "ibv_destroy_qp") : Py_NewRef(Py_None);
}

/* RESET -> INIT: port, P_Key index 0, and what incoming requests may do. */
static PyObject *modify_init(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    int port, access;
    if (!PyArg_ParseTuple(args, "Oii", &handle, &port, &access)) {
        return NULL;
    }
    struct ibv_qp_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.qp_state = IBV_QPS_INIT;
    attr.port_num = (uint8_t)port;
    attr.pkey_index = 0;
    attr.qp_access_flags = (unsigned)access;
    int rc = ibv_modify_qp(as_ptr(handle), &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    return rc ? raise_errno(rc, "ibv_modify_qp INIT") : Py_NewRef(Py_None);
}

/* INIT -> RTR: the peer's QP number, PSN and address (a GID with a GRH for RoCE when gid is 16 bytes, else the LID). */
static PyObject *modify_rtr(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    int port, gid_index, rd_atomic, mtu, dlid, min_rnr_timer;
    unsigned int dest_qp_num, rq_psn;
    Py_buffer gid = {0};
    if (!PyArg_ParseTuple(args, "OiiiIIiiiy*", &handle, &port, &gid_index, &rd_atomic, &dest_qp_num, &rq_psn, &mtu, &dlid,
                          &min_rnr_timer, &gid)) {
        return NULL;
    }
    struct ibv_qp_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = (enum ibv_mtu)mtu;
    attr.dest_qp_num = dest_qp_num;
    attr.rq_psn = rq_psn;
    attr.max_dest_rd_atomic = (uint8_t)rd_atomic;
    attr.min_rnr_timer = (uint8_t)min_rnr_timer;
    attr.ah_attr.port_num = (uint8_t)port;
    attr.ah_attr.dlid = (uint16_t)dlid;
    if (gid.len == 16) {
        attr.ah_attr.is_global = 1;
        memcpy(attr.ah_attr.grh.dgid.raw, gid.buf, 16);
        attr.ah_attr.grh.sgid_index = (uint8_t)gid_index;
        attr.ah_attr.grh.hop_limit = 1;
    }
    PyBuffer_Release(&gid);
    int rc = ibv_modify_qp(as_ptr(handle), &attr,
                           IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                               IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    return rc ? raise_errno(rc, "ibv_modify_qp RTR") : Py_NewRef(Py_None);
}

/* RTR -> RTS: our send PSN, the ack timeout and retry counts, outstanding RDMA READs. */
static PyObject *modify_rts(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    unsigned int psn;
    int rd_atomic, timeout, retry_cnt, rnr_retry;
    if (!PyArg_ParseTuple(args, "OIiiii", &handle, &psn, &rd_atomic, &timeout, &retry_cnt, &rnr_retry)) {
        return NULL;
    }
    struct ibv_qp_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.qp_state = IBV_QPS_RTS;
    attr.sq_psn = psn;
    attr.timeout = (uint8_t)timeout;
    attr.retry_cnt = (uint8_t)retry_cnt;
    attr.rnr_retry = (uint8_t)rnr_retry;
    attr.max_rd_atomic = (uint8_t)rd_atomic;
    int rc = ibv_modify_qp(as_ptr(handle), &attr,
                           IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                               IBV_QP_MAX_QP_RD_ATOMIC);
    return rc ? raise_errno(rc, "ibv_modify_qp RTS") : Py_NewRef(Py_None);
}

static PyObject *modify_err(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    if (!PyArg_ParseTuple(args, "O", &handle)) {
        return NULL;
    }
    struct ibv_qp_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.qp_state = IBV_QPS_ERR;
    int rc = ibv_modify_qp(as_ptr(handle), &attr, IBV_QP_STATE);
    return rc ? raise_errno(rc, "ibv_modify_qp ERR") : Py_NewRef(Py_None);
}

/* ------------------------------------------------------------------ memory windows (type 2)
 * Decision 0020: one type-2 window per grant, bound by a work request on the store's QP to the client, so that
 * its rkey works only through that QP, over the granted range, with the granted access. What this relies on
 * (rdma-core 44, verbs.h and the ibv_alloc_mw / ibv_bind_mw / ibv_post_send man pages):
 * - ibv_alloc_mw(pd, IBV_MW_TYPE_2) allocates an unbound window on the PD of the QP and the MR;
 * - a type-2 window is bound by posting IBV_WR_BIND_MW with wr.bind_mw = {mw, rkey, bind_info {mr, addr,
 *   length, mw_access_flags}}; the new rkey is ibv_inc_rkey(mw->rkey) (same index, next 8-bit tag); the MR
 *   must be registered with IBV_ACCESS_MW_BIND, and a window with remote write needs local write on the MR;
 * - the rkey may be handed to the peer only after the bind's successful completion (ibv_bind_mw NOTES);
 * - IBV_WR_LOCAL_INV with invalidate_rkey invalidates it on the QP it is bound to; ibv_dealloc_mw unbinds
 *   and frees it; ibv_dereg_mr fails while a window is still bound to the MR;
 * - the device reports type-2 support in device_cap_flags (IBV_DEVICE_MEM_WINDOW_TYPE_2A / _2B) and max_mw. */

/* -> (device_cap_flags, max_mw, type-2 windows supported) */
static PyObject *query_mw(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    if (!PyArg_ParseTuple(args, "O", &handle)) {
        return NULL;
    }
    struct ibv_device_attr attr;
    int rc = ibv_query_device((struct ibv_context *)as_ptr(handle), &attr);
    if (rc) {
        return raise_errno(rc, "ibv_query_device");
    }
    unsigned long long caps = (unsigned long long)attr.device_cap_flags;
    int type2 = (caps & (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B)) != 0 && attr.max_mw > 0;
    return Py_BuildValue("(Kii)", caps, attr.max_mw, type2);
}

/* -> (mw, rkey): an unbound type-2 window of the PD */
static PyObject *alloc_mw(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    if (!PyArg_ParseTuple(args, "O", &handle)) {
        return NULL;
    }
    struct ibv_pd *pd = as_ptr(handle);
    if (pd == NULL) {
        return PyErr_Occurred() ? NULL : raise_errno(EBADF, "ibv_alloc_mw");
    }
    errno = 0;
    struct ibv_mw *mw = ibv_alloc_mw(pd, IBV_MW_TYPE_2);
    if (mw == NULL) {
        return raise_errno(errno, "ibv_alloc_mw");
    }
    return Py_BuildValue("(NI)", PyLong_FromVoidPtr(mw), mw->rkey);
}

static PyObject *dealloc_mw(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    if (!PyArg_ParseTuple(args, "O", &handle)) {
        return NULL;
    }
    struct ibv_mw *mw = as_ptr(handle);
    if (mw == NULL) {
        return PyErr_Occurred() ? NULL : raise_errno(EBADF, "ibv_dealloc_mw");
    }
    int rc = ibv_dealloc_mw(mw);
    return rc ? raise_errno(rc, "ibv_dealloc_mw") : Py_NewRef(Py_None);
}

/* post_bind_mw(qp, mw, wr_id, mr, addr, length, access) -> the window's new rkey (valid once the bind's
 * completion is successful). Signaled; no SGE. */
static PyObject *post_bind_mw(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *qp_handle, *mw_handle, *mr_handle;
    unsigned long long wr_id, addr, length;
    unsigned int access;
    if (!PyArg_ParseTuple(args, "OOKOKKI", &qp_handle, &mw_handle, &wr_id, &mr_handle, &addr, &length, &access)) {
        return NULL;
    }
    struct ibv_qp *qp = as_ptr(qp_handle);
    struct ibv_mw *mw = as_ptr(mw_handle);
    struct ibv_mr *mr = as_ptr(mr_handle);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (qp == NULL || mw == NULL || mr == NULL || length == 0) {
        return raise_errno(EINVAL, "post_bind_mw: a QP, a window, an MR and a length are needed");
    }
    uint32_t rkey = ibv_inc_rkey(mw->rkey);
    struct ibv_send_wr wr;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = wr_id;
    wr.opcode = IBV_WR_BIND_MW;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.bind_mw.mw = mw;
    wr.bind_mw.rkey = rkey;
    wr.bind_mw.bind_info.mr = mr;
    wr.bind_mw.bind_info.addr = addr;
    wr.bind_mw.bind_info.length = length;
    wr.bind_mw.bind_info.mw_access_flags = access;
    struct ibv_send_wr *bad = NULL;
    int rc = ibv_post_send(qp, &wr, &bad);
    if (rc) {
        return raise_errno(rc, "ibv_post_send BIND_MW");
    }
    mw->rkey = rkey; /* the next bind of this window tags from here (a failed bind leaves it unusable anyway) */
    return PyLong_FromUnsignedLong(rkey);
}

/* post_local_inv(qp, wr_id, rkey): invalidate the window with this rkey, bound to this QP. Signaled. */
static PyObject *post_local_inv(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *qp_handle;
    unsigned long long wr_id;
    unsigned int rkey;
    if (!PyArg_ParseTuple(args, "OKI", &qp_handle, &wr_id, &rkey)) {
        return NULL;
    }
    struct ibv_qp *qp = as_ptr(qp_handle);
    if (qp == NULL) {
        return PyErr_Occurred() ? NULL : raise_errno(EBADF, "post_local_inv");
    }
    struct ibv_send_wr wr;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = wr_id;
    wr.opcode = IBV_WR_LOCAL_INV;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.invalidate_rkey = rkey;
    struct ibv_send_wr *bad = NULL;
    int rc = ibv_post_send(qp, &wr, &bad);
    return rc ? raise_errno(rc, "ibv_post_send LOCAL_INV") : Py_NewRef(Py_None);
}

/* ------------------------------------------------------------------ the hot path */
static void fill_wr(struct ibv_send_wr *wr, struct ibv_sge *sge, uint64_t wr_id, int opcode, uint64_t laddr,
                    uint64_t length, uint64_t lkey, uint64_t raddr, uint64_t rkey) {
    sge->addr = laddr;
    sge->length = (uint32_t)length;
    sge->lkey = (uint32_t)lkey;
    wr->wr_id = wr_id;
    wr->next = wr + 1;
    wr->sg_list = sge;
    wr->num_sge = 1;
    wr->opcode = (enum ibv_wr_opcode)opcode;
    wr->send_flags = IBV_SEND_SIGNALED;
    wr->wr.rdma.remote_addr = raddr;
    wr->wr.rdma.rkey = (uint32_t)rkey;
}

/* Posts wrs[0..n) as one chain; the number posted (all, or those before the one the provider refused). */
static Py_ssize_t post_chain(struct ibv_qp *qp, struct ibv_send_wr *wrs, Py_ssize_t n, int *err) {
    *err = 0;
    if (n == 0) {
        return 0;
    }
    wrs[n - 1].next = NULL;
    struct ibv_send_wr *bad = NULL;
    int rc = ibv_post_send(qp, wrs, &bad);
    if (rc == 0) {
        return n;
    }
    *err = rc;
    if (bad == NULL || bad < wrs || bad >= wrs + n) {
        return n; /* where the device stopped is unknown: the caller awaits every one's completion or flush */
    }
    return bad - wrs;
}

static int get_u64(PyObject *obj, PyObject *name, uint64_t *out) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) {
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(value);
    Py_DECREF(value);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    *out = v;
    return 0;
}

static PyObject *s_opcode, *s_expiry_ms, *s_piece, *s_local_addr, *s_length, *s_lkey, *s_remote_addr, *s_rkey;

/* Slots of a class read without an attribute lookup: a chunk and its piece are __slots__ dataclasses, and a
 * generic getattr per field was most of post_chunks' time. The offsets come from the class's member
 * descriptors, found once per class; an object of another class, or a slot not of the expected kind, takes
 * the generic getattr. */
struct slot_reader {
    PyTypeObject *type; /* borrowed; kept alive by the reference below */
    PyObject *type_ref;
    Py_ssize_t offsets[5];
    int count;
};

static struct slot_reader chunk_slots, piece_slots;

static void slots_learn(struct slot_reader *reader, PyTypeObject *type, PyObject **names, int count) {
    Py_ssize_t offsets[5];
    for (int i = 0; i < count; i++) {
        PyObject *descr = _PyType_Lookup(type, names[i]); /* borrowed */
        if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
            return;
        }
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type != T_OBJECT_EX && member->type != T_OBJECT) {
            return;
        }
        offsets[i] = member->offset;
    }
    Py_XDECREF(reader->type_ref);
    reader->type_ref = Py_NewRef((PyObject *)type);
    reader->type = type;
    memcpy(reader->offsets, offsets, sizeof offsets);
    reader->count = count;
}

/* The count fields of obj named names, each as a uint64 (a fast path for the learnt class). */
static int read_fields(struct slot_reader *reader, PyObject *obj, PyObject **names, int count, uint64_t *out) {
    if (Py_TYPE(obj) != reader->type) {
        slots_learn(reader, Py_TYPE(obj), names, count);
    }
    int fast = Py_TYPE(obj) == reader->type;
    for (int i = 0; i < count; i++) {
        PyObject *value = fast ? *(PyObject **)((char *)obj + reader->offsets[i]) : NULL;
        if (value != NULL && PyLong_Check(value)) {
            unsigned long long v = PyLong_AsUnsignedLongLong(value);
            if (v == (unsigned long long)-1 && PyErr_Occurred()) {
                return -1;
            }
            out[i] = v;
        } else if (get_u64(obj, names[i], &out[i]) < 0) {
            return -1;
        }
    }
    return 0;
}

/* post_chunks(qp, chunks, start, stop, first_wr_id, now_ms) -> (posted, errno, expired)
 *
 * Posts chunks[start:stop] (objects with .opcode, .expiry_ms and .piece, whose .local_addr, .length, .lkey,
 * .remote_addr and .rkey say the work request) with wr_ids first_wr_id, first_wr_id + 1, ..., as one chain.
 * It stops before a chunk whose grant expired (0 < expiry_ms <= now_ms; expired is then 1 and that chunk
 * is chunks[start + posted]) and where the provider refuses one (errno is then its error). */
static PyObject *post_chunks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "post_chunks(qp, chunks: list, start, stop, first_wr_id, now_ms)");
        return NULL;
    }
    struct ibv_qp *qp = as_ptr(args[0]);
    PyObject *chunks = args[1];
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    Py_ssize_t stop = PyLong_AsSsize_t(args[3]);
    uint64_t first = PyLong_AsUnsignedLongLong(args[4]);
    long long now_ms = PyLong_AsLongLong(args[5]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (qp == NULL || start < 0 || stop < start || stop > PyList_GET_SIZE(chunks)) {
        PyErr_SetString(PyExc_ValueError, "post_chunks: bad QP handle or range");
        return NULL;
    }
    Py_ssize_t n = stop - start;
    PyObject *chunk_names[2] = {s_expiry_ms, s_opcode};
    PyObject *piece_names[5] = {s_local_addr, s_length, s_lkey, s_remote_addr, s_rkey};
    struct ibv_send_wr stack_wrs[STACK_WRS];
    struct ibv_sge stack_sges[STACK_WRS];
    struct ibv_send_wr *wrs = stack_wrs;
    struct ibv_sge *sges = stack_sges;
    if (n > STACK_WRS) {
        wrs = PyMem_Malloc((size_t)n * sizeof *wrs);
        sges = PyMem_Malloc((size_t)n * sizeof *sges);
        if (wrs == NULL || sges == NULL) {
            PyMem_Free(wrs == stack_wrs ? NULL : wrs);
            PyMem_Free(sges == stack_sges ? NULL : sges);
            return PyErr_NoMemory();
        }
    }
    Py_ssize_t built = 0;
    int expired = 0;
    PyObject *result = NULL;
    for (; built < n; built++) {
        if (start + built >= PyList_GET_SIZE(chunks)) { /* an attribute's code shortened the list */
            PyErr_SetString(PyExc_ValueError, "post_chunks: the list changed while it was read");
            goto done;
        }
        PyObject *chunk = Py_NewRef(PyList_GET_ITEM(chunks, start + built));
        uint64_t head[2], f[5]; /* (expiry_ms, opcode); (local_addr, length, lkey, remote_addr, rkey) */
        int unreadable = read_fields(&chunk_slots, chunk, chunk_names, 2, head) < 0;
        PyObject *piece = unreadable || (head[0] && (long long)head[0] <= now_ms) ? NULL : PyObject_GetAttr(chunk, s_piece);
        Py_DECREF(chunk);
        if (unreadable) {
            goto done;
        }
        if (head[0] && (long long)head[0] <= now_ms) {
            expired = 1;
            break;
        }
        if (piece == NULL) {
            goto done;
        }
        int bad = read_fields(&piece_slots, piece, piece_names, 5, f) < 0;
        Py_DECREF(piece);
        if (bad) {
            goto done;
        }
        if (f[1] > UINT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "post_chunks: a work request moves at most 4 GiB - 1");
            goto done;
        }
        fill_wr(&wrs[built], &sges[built], first + (uint64_t)built, (int)head[1], f[0], f[1], f[2], f[3], f[4]);
    }
    {
        int err;
        Py_ssize_t posted = post_chain(qp, wrs, built, &err);
        result = Py_BuildValue("(nii)", posted, err, expired && err == 0);
    }
done:
    if (wrs != stack_wrs) {
        PyMem_Free(wrs);
        PyMem_Free(sges);
    }
    return result;
}

/* post_list(qp, packed) -> (posted, errno): packed holds 7 uint64 per work request (wr_id, opcode,
 * local_addr, length, lkey, remote_addr, rkey), posted as one chain. */
static PyObject *post_list(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    Py_buffer packed;
    if (!PyArg_ParseTuple(args, "Oy*", &handle, &packed)) {
        return NULL;
    }
    struct ibv_qp *qp = as_ptr(handle);
    if (qp == NULL || packed.len % (Py_ssize_t)(WR_FIELDS * sizeof(uint64_t)) != 0) {
        PyBuffer_Release(&packed);
        PyErr_SetString(PyExc_ValueError, "post_list: bad QP handle or a buffer not of 7 uint64 per request");
        return NULL;
    }
    Py_ssize_t n = packed.len / (Py_ssize_t)(WR_FIELDS * sizeof(uint64_t));
    struct ibv_send_wr *wrs = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *wrs);
    struct ibv_sge *sges = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *sges);
    if (wrs == NULL || sges == NULL) {
        PyMem_Free(wrs);
        PyMem_Free(sges);
        PyBuffer_Release(&packed);
        return PyErr_NoMemory();
    }
    const uint64_t *v = packed.buf;
    for (Py_ssize_t i = 0; i < n; i++, v += WR_FIELDS) {
        fill_wr(&wrs[i], &sges[i], v[0], (int)v[1], v[2], v[3], v[4], v[5], v[6]);
    }
    int err;
    Py_ssize_t posted = post_chain(qp, wrs, n, &err);
    PyMem_Free(wrs);
    PyMem_Free(sges);
    PyBuffer_Release(&packed);
    return Py_BuildValue("(ni)", posted, err);
}

/* poll(cq, max) -> [(wr_id, status, byte_len, vendor_err), ...] */
static PyObject *poll(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    int max_entries;
    if (!PyArg_ParseTuple(args, "Oi", &handle, &max_entries)) {
        return NULL;
    }
    struct ibv_wc wcs[64];
    if (max_entries > 64) {
        max_entries = 64;
    }
    struct ibv_cq *cq = as_ptr(handle);
    int n = cq == NULL ? -EINVAL : ibv_poll_cq(cq, max_entries, wcs);
    if (n < 0) {
        return raise_errno(-n, "ibv_poll_cq");
    }
    PyObject *out = PyList_New(n);
    for (int i = 0; out != NULL && i < n; i++) {
        PyObject *item = Py_BuildValue("(KiII)", (unsigned long long)wcs[i].wr_id, (int)wcs[i].status, wcs[i].byte_len,
                                       wcs[i].vendor_err);
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

/* ------------------------------------------------------------------ the FAKE provider */
struct fake_cqe {
    uint64_t wr_id;
    int status;
    uint32_t byte_len;
    struct fake_qp *qp; /* whose send-queue slot the completion frees (NULL once the QP is destroyed) */
};

struct fake_cq {
    struct ibv_cq base;
    struct fake_cqe *entries;
    size_t head, tail, capacity;
};

struct fake_qp {
    struct ibv_qp base;
    struct fake_cq *cq;
    uint32_t max_send_wr;
    uint32_t outstanding; /* posted and not yet polled */
    uint32_t refusals;    /* injected: the next posts refused with ENOMEM */
    uint64_t *ring;       /* recorded, not yet taken by the fake NIC: WR_FIELDS per request */
    size_t recorded;
};

/* One request as the FAKE NIC reads it (WR_FIELDS uint64). READ/WRITE: wr_id, opcode, local_addr, length,
 * lkey, remote_addr, rkey. BIND_MW: wr_id, opcode, addr, length, the MR's lkey (0: none), mw_access_flags, the
 * new rkey. LOCAL_INV: wr_id, opcode, 0, 0, 0, 0, the rkey to invalidate. */
static void fake_record(uint64_t *slot, const struct ibv_send_wr *wr) {
    memset(slot, 0, WR_FIELDS * sizeof *slot);
    slot[0] = wr->wr_id;
    slot[1] = (uint64_t)wr->opcode;
    if (wr->opcode == IBV_WR_BIND_MW) {
        const struct ibv_mw_bind_info *info = &wr->bind_mw.bind_info;
        slot[2] = info->addr;
        slot[3] = info->length;
        slot[4] = info->mr != NULL ? info->mr->lkey : 0;
        slot[5] = info->mw_access_flags;
        slot[6] = wr->bind_mw.rkey;
    } else if (wr->opcode == IBV_WR_LOCAL_INV) {
        slot[6] = wr->invalidate_rkey;
    } else {
        slot[2] = wr->sg_list[0].addr;
        slot[3] = wr->sg_list[0].length;
        slot[4] = wr->sg_list[0].lkey;
        slot[5] = wr->wr.rdma.remote_addr;
        slot[6] = wr->wr.rdma.rkey;
    }
}

static int fake_post_send(struct ibv_qp *base, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr) {
    struct fake_qp *qp = (struct fake_qp *)base;
    for (; wr != NULL; wr = wr->next) {
        int err = 0;
        if (base->state != IBV_QPS_RTS && base->state != IBV_QPS_ERR) {
            err = EINVAL;
        } else if (qp->outstanding >= qp->max_send_wr) {
            err = ENOMEM;
        } else if (qp->refusals > 0) {
            qp->refusals--;
            err = ENOMEM;
        } else if ((wr->send_flags & IBV_SEND_SIGNALED) == 0) {
            err = EINVAL; /* the data path signals every request (sq_sig_all) */
        } else if (wr->opcode == IBV_WR_BIND_MW) {
            err = wr->bind_mw.mw == NULL || wr->bind_mw.mw->type != IBV_MW_TYPE_2 ? EINVAL : 0;
        } else if (wr->opcode == IBV_WR_LOCAL_INV) {
            err = 0;
        } else if (wr->num_sge != 1 || (wr->opcode != IBV_WR_RDMA_READ && wr->opcode != IBV_WR_RDMA_WRITE)) {
            err = EINVAL; /* the fake NIC does one-sided READ and WRITE, and binds and invalidates windows */
        }
        if (err) {
            *bad_wr = wr;
            return err;
        }
        fake_record(qp->ring + qp->recorded * WR_FIELDS, wr);
        qp->recorded++;
        qp->outstanding++;
    }
    return 0;
}

static int fake_poll_cq(struct ibv_cq *base, int num_entries, struct ibv_wc *wc) {
    struct fake_cq *cq = (struct fake_cq *)base;
    int n = 0;
    while (n < num_entries && cq->head < cq->tail) {
        struct fake_cqe *e = &cq->entries[cq->head++];
        memset(&wc[n], 0, sizeof wc[n]);
        wc[n].wr_id = e->wr_id;
        wc[n].status = (enum ibv_wc_status)e->status;
        wc[n].byte_len = e->byte_len;
        if (e->qp != NULL) {
            wc[n].qp_num = e->qp->base.qp_num;
            if (e->qp->outstanding > 0) {
                e->qp->outstanding--; /* the send-queue slot is free once its completion is polled */
            }
        }
        n++;
    }
    if (cq->head == cq->tail) {
        cq->head = cq->tail = 0;
    }
    return n;
}

/* Fake windows get rkeys from their own index range (the Python fake's MR keys stay far below it). */
static uint32_t fake_mw_index = 0x400000;

static struct ibv_mw *fake_alloc_mw(struct ibv_pd *pd, enum ibv_mw_type type) {
    if (type != IBV_MW_TYPE_2) {
        errno = EINVAL; /* the fake NIC has type-2 windows only, as the store uses */
        return NULL;
    }
    struct ibv_mw *mw = PyMem_RawCalloc(1, sizeof *mw);
    if (mw == NULL) {
        errno = ENOMEM;
        return NULL;
    }
    mw->context = pd->context;
    mw->pd = pd;
    mw->type = type;
    mw->handle = fake_mw_index;
    mw->rkey = (fake_mw_index++ & 0xffffff) << 8;
    return mw;
}

static int fake_dealloc_mw(struct ibv_mw *mw) {
    PyMem_RawFree(mw);
    return 0;
}

/* One fake device context per process: the ops table is all the posting code looks at. */
static struct ibv_context fake_context = {
    .ops = {.post_send = fake_post_send,
            .poll_cq = fake_poll_cq,
            .alloc_mw = fake_alloc_mw,
            .dealloc_mw = fake_dealloc_mw},
};

static PyObject *fake_alloc_pd(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    struct ibv_pd *pd = PyMem_Calloc(1, sizeof *pd);
    if (pd == NULL) {
        return PyErr_NoMemory();
    }
    pd->context = &fake_context;
    return PyLong_FromVoidPtr(pd);
}

static PyObject *fake_free(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    if (!PyArg_ParseTuple(args, "O", &handle)) {
        return NULL;
    }
    void *p = as_ptr(handle);
    if (PyErr_Occurred()) {
        return NULL;
    }
    PyMem_Free(p);
    Py_RETURN_NONE;
}

/* fake_mr(pd, addr, length, lkey, rkey) -> the provider's view of a FAKE NIC's MR (a bind names it). */
static PyObject *fake_mr(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *pd_handle;
    unsigned long long addr, length;
    unsigned int lkey, rkey;
    if (!PyArg_ParseTuple(args, "OKKII", &pd_handle, &addr, &length, &lkey, &rkey)) {
        return NULL;
    }
    struct ibv_pd *pd = as_ptr(pd_handle);
    if (PyErr_Occurred()) {
        return NULL;
    }
    struct ibv_mr *mr = PyMem_Calloc(1, sizeof *mr);
    if (mr == NULL) {
        return PyErr_NoMemory();
    }
    mr->context = &fake_context;
    mr->pd = pd;
    mr->addr = (void *)(uintptr_t)addr;
    mr->length = (size_t)length;
    mr->lkey = lkey;
    mr->rkey = rkey;
    return PyLong_FromVoidPtr(mr);
}

static PyObject *fake_create_cq(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    struct fake_cq *cq = PyMem_Calloc(1, sizeof *cq);
    if (cq == NULL) {
        return PyErr_NoMemory();
    }
    cq->base.context = &fake_context;
    return PyLong_FromVoidPtr(cq);
}

static PyObject *fake_destroy_cq(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    if (!PyArg_ParseTuple(args, "O", &handle)) {
        return NULL;
    }
    struct fake_cq *cq = as_ptr(handle);
    if (cq != NULL) {
        PyMem_Free(cq->entries);
        PyMem_Free(cq);
    }
    Py_RETURN_NONE;
}

static PyObject *fake_create_qp(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cq_handle;
    unsigned int max_send_wr, qp_num;
    if (!PyArg_ParseTuple(args, "OII", &cq_handle, &max_send_wr, &qp_num)) {
        return NULL;
    }
    struct fake_qp *qp = PyMem_Calloc(1, sizeof *qp);
    uint64_t *ring = PyMem_Calloc((size_t)max_send_wr * WR_FIELDS + 1, sizeof(uint64_t));
    if (qp == NULL || ring == NULL) {
        PyMem_Free(qp);
        PyMem_Free(ring);
        return PyErr_NoMemory();
    }
    qp->base.context = &fake_context;
    qp->base.qp_num = qp_num;
    qp->base.state = IBV_QPS_RESET;
    qp->base.qp_type = IBV_QPT_RC;
    qp->cq = as_ptr(cq_handle);
    qp->base.send_cq = &qp->cq->base;
    qp->max_send_wr = max_send_wr;
    qp->ring = ring;
    return PyLong_FromVoidPtr(qp);
}

/* Destroys a fake QP; its completions still in the CQ stay, freeing no slot. cq_alive: 0 once the CQ is gone. */
static PyObject *fake_destroy_qp(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    int cq_alive;
    if (!PyArg_ParseTuple(args, "Op", &handle, &cq_alive)) {
        return NULL;
    }
    struct fake_qp *qp = as_ptr(handle);
    if (qp == NULL) {
        Py_RETURN_NONE;
    }
    if (cq_alive && qp->cq != NULL) {
        for (size_t i = qp->cq->head; i < qp->cq->tail; i++) {
            if (qp->cq->entries[i].qp == qp) {
                qp->cq->entries[i].qp = NULL;
            }
        }
    }
    PyMem_Free(qp->ring);
    PyMem_Free(qp);
    Py_RETURN_NONE;
}

/* fake_set_state(qp, state, refusals): what the provider checks at post time (the QP state the fake's
 * state machine decided; refusals: injected failures to add) */
static PyObject *fake_set_state(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    int state;
    unsigned int refusals;
    if (!PyArg_ParseTuple(args, "OiI", &handle, &state, &refusals)) {
        return NULL;
    }
    struct fake_qp *qp = as_ptr(handle);
    if (qp == NULL) {
        return PyErr_Occurred() ? NULL : raise_errno(EBADF, "fake_set_state");
    }
    qp->base.state = (enum ibv_qp_state)state;
    qp->refusals += refusals;
    Py_RETURN_NONE;
}

/* fake_take(qp) -> bytes: the recorded requests (7 uint64 each, as post_list takes them), for the fake NIC. */
static PyObject *fake_take(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *handle;
    if (!PyArg_ParseTuple(args, "O", &handle)) {
        return NULL;
    }
    struct fake_qp *qp = as_ptr(handle);
    if (qp == NULL) {
        return PyErr_Occurred() ? NULL : raise_errno(EBADF, "fake_take");
    }
    PyObject *out =
        PyBytes_FromStringAndSize((const char *)qp->ring, (Py_ssize_t)(qp->recorded * WR_FIELDS * sizeof(uint64_t)));
    qp->recorded = 0;
    return out;
}

/* fake_complete(cq, qp, wr_id, status, byte_len): the fake NIC finished a request (qp 0: no slot to free). */
static PyObject *fake_complete(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "fake_complete(cq, qp, wr_id, status, byte_len)");
        return NULL;
    }
    struct fake_cq *cq = as_ptr(args[0]);
    struct fake_qp *qp = as_ptr(args[1]);
    uint64_t wr_id = PyLong_AsUnsignedLongLong(args[2]);
    long status = PyLong_AsLong(args[3]);
    unsigned long byte_len = PyLong_AsUnsignedLong(args[4]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (cq == NULL) {
        return raise_errno(EBADF, "fake_complete");
    }
    if (cq->tail == cq->capacity) {
        size_t capacity = cq->capacity ? cq->capacity * 2 : 256;
        struct fake_cqe *grown = PyMem_Realloc(cq->entries, capacity * sizeof *grown);
        if (grown == NULL) {
            return PyErr_NoMemory();
        }
        cq->entries = grown;
        cq->capacity = capacity;
    }
    struct fake_cqe *e = &cq->entries[cq->tail++];
    e->wr_id = wr_id;
    e->status = (int)status;
    e->byte_len = (uint32_t)byte_len;
    e->qp = qp;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ module */
static PyMethodDef methods[] = {
    {"list_devices", list_devices, METH_NOARGS, "RDMA device names."},
    {"open_device", open_device, METH_VARARGS, "open_device(name) -> context handle."},
    {"close_device", close_device, METH_VARARGS, "close_device(ctx)."},
    {"query_device", query_device, METH_VARARGS, "query_device(ctx) -> (max_mr_size, max_qp_wr, max_qp_rd_atom)."},
    {"query_port", query_port, METH_VARARGS, "query_port(ctx, port, gid_index) -> (lid, active_mtu, gid)."},
    {"alloc_pd", alloc_pd, METH_VARARGS, "alloc_pd(ctx) -> pd handle."},
    {"dealloc_pd", dealloc_pd, METH_VARARGS, "dealloc_pd(pd)."},
    {"reg_mr", reg_mr, METH_VARARGS, "reg_mr(pd, addr, length, access) -> (mr, lkey, rkey)."},
    {"dereg_mr", dereg_mr, METH_VARARGS, "dereg_mr(mr)."},
    {"create_cq", create_cq, METH_VARARGS, "create_cq(ctx, depth) -> cq handle."},
    {"destroy_cq", destroy_cq, METH_VARARGS, "destroy_cq(cq)."},
    {"create_qp", create_qp, METH_VARARGS, "create_qp(pd, cq, max_send_wr) -> (qp, qp_num): RC, all signaled."},
    {"destroy_qp", destroy_qp, METH_VARARGS, "destroy_qp(qp)."},
    {"modify_init", modify_init, METH_VARARGS, "modify_init(qp, port, access)."},
    {"modify_rtr", modify_rtr, METH_VARARGS,
     "modify_rtr(qp, port, gid_index, rd_atomic, dest_qp_num, rq_psn, mtu, dlid, min_rnr_timer, gid16_or_empty)."},
    {"modify_rts", modify_rts, METH_VARARGS, "modify_rts(qp, psn, rd_atomic, timeout, retry_cnt, rnr_retry)."},
    {"modify_err", modify_err, METH_VARARGS, "modify_err(qp)."},
    {"post_chunks", (PyCFunction)(void (*)(void))post_chunks, METH_FASTCALL,
     "post_chunks(qp, chunks, start, stop, first_wr_id, now_ms) -> (posted, errno, expired)."},
    {"post_list", post_list, METH_VARARGS, "post_list(qp, packed) -> (posted, errno)."},
    {"query_mw", query_mw, METH_VARARGS, "query_mw(ctx) -> (device_cap_flags, max_mw, type2_supported)."},
    {"alloc_mw", alloc_mw, METH_VARARGS, "alloc_mw(pd) -> (mw, rkey): an unbound type-2 memory window."},
    {"dealloc_mw", dealloc_mw, METH_VARARGS, "dealloc_mw(mw)."},
    {"post_bind_mw", post_bind_mw, METH_VARARGS,
     "post_bind_mw(qp, mw, wr_id, mr, addr, length, access) -> new rkey (IBV_WR_BIND_MW, signaled)."},
    {"post_local_inv", post_local_inv, METH_VARARGS, "post_local_inv(qp, wr_id, rkey) (IBV_WR_LOCAL_INV, signaled)."},
    {"fake_alloc_pd", fake_alloc_pd, METH_NOARGS, "A FAKE provider's PD (its windows are the fake's)."},
    {"fake_mr", fake_mr, METH_VARARGS, "fake_mr(pd, addr, length, lkey, rkey) -> a FAKE provider's MR."},
    {"fake_free", fake_free, METH_VARARGS, "fake_free(handle): frees a FAKE provider's PD or MR."},
    {"poll", poll, METH_VARARGS, "poll(cq, max) -> [(wr_id, status, byte_len, vendor_err)]."},
    {"fake_create_cq", fake_create_cq, METH_NOARGS, "A FAKE provider's CQ."},
    {"fake_destroy_cq", fake_destroy_cq, METH_VARARGS, "fake_destroy_cq(cq)."},
    {"fake_create_qp", fake_create_qp, METH_VARARGS, "fake_create_qp(cq, max_send_wr, qp_num) -> a FAKE provider's QP."},
    {"fake_destroy_qp", fake_destroy_qp, METH_VARARGS, "fake_destroy_qp(qp, cq_alive)."},
    {"fake_set_state", fake_set_state, METH_VARARGS, "fake_set_state(qp, state, refusals)."},
    {"fake_take", fake_take, METH_VARARGS, "fake_take(qp) -> the recorded requests, packed."},
    {"fake_complete", (PyCFunction)(void (*)(void))fake_complete, METH_FASTCALL,
     "fake_complete(cq, qp, wr_id, status, byte_len)."},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvpool.transfer._verbs",
    .m_doc = "The RDMA data path's verbs objects and posting loop over libibverbs, and a FAKE provider (_verbs.c).",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__verbs(void) {
    s_opcode = PyUnicode_InternFromString("opcode");
    s_expiry_ms = PyUnicode_InternFromString("expiry_ms");
    s_piece = PyUnicode_InternFromString("piece");
    s_local_addr = PyUnicode_InternFromString("local_addr");
    s_length = PyUnicode_InternFromString("length");
    s_lkey = PyUnicode_InternFromString("lkey");
    s_remote_addr = PyUnicode_InternFromString("remote_addr");
    s_rkey = PyUnicode_InternFromString("rkey");
    if (s_opcode == NULL || s_expiry_ms == NULL || s_piece == NULL || s_local_addr == NULL || s_length == NULL ||
        s_lkey == NULL || s_remote_addr == NULL || s_rkey == NULL) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module != NULL && PyModule_AddIntConstant(module, "WR_FIELDS", WR_FIELDS) != 0) {
        Py_CLEAR(module);
    }
    return module;
}
