"""The RDMA transport: one-sided RDMA READ/WRITE over reliable-connected queue pairs (DESIGN §6).

Shape:

* **Verbs behind a layer.** Everything goes through :mod:`kvpool.transfer.verbs` (typed, pyverbs imported
  lazily) so that the same code runs against :mod:`kvpool.transfer.verbs_fake` in tests. Where pyverbs or a
  device is missing, :func:`kvpool.transfer.factory.make_transports` simply leaves RDMA out (one log line).
* **Connection setup over the store's TCP control channel.** The client creates an RC QP, sends its QP info
  (qp_num, LID/GID, PSN, MTU) in an ``RDMA_CONNECT`` frame (JSON payload) to the store's data-plane port, and
  gets back the store's QP info plus the segment's memory regions (base address, length, rkey). The store
  side is :class:`RdmaResponder`, which the data plane calls with the request payload. The TCP connection
  stays open for the QP's lifetime: when it closes, the store releases the QP (so a crashed client leaks
  nothing), and a client that sees it closed reconnects.
* **Authorisation happens at connect time.** With one-sided RDMA the store CPU never sees a request, so the
  per-request grant check of the TCP path cannot happen. Instead ``RDMA_CONNECT`` carries master-signed grants
  (one per segment wanted; the client uses the grant of its first request there), verified with the
  segment's secret - or it arrives on a connection that presented the cluster token (HELLO). A READ-only grant
  gets a QP that refuses remote writes (the QP's access flags, enforced by the NIC). After that the client
  can touch any byte of the segments it was admitted to, until the connection closes: the trust boundary is
  "a client the master admitted", not "this range until then". docs/rdma.md spells the trade-off out.
* **Chunking.** A client buffer is registered as MRs of at most ``max_mr_bytes`` (NICs cap one MR; Mooncake
  issue #640), the store registers its segment the same way, and each request is cut at every local and
  remote MR boundary and at ``max_wr_bytes``: a request larger than one chunk becomes several work requests.
* **Completions.** Every work request is signaled; a batch posts up to the send-queue depth and polls the
  CQ (any thread waiting on any batch makes progress for all batches on that connection). An error
  completion (or a refused post) moves the QP to ERR: the remaining work requests flush, the requests get
  TRANSFER_FAILED (TIMEOUT for the retry/ack timeouts), and the QP is torn down and re-established on next
  use. A deadline that passes with work in flight aborts the QP (ERR, flush, destroy) so that the NIC can
  no longer touch the caller's buffers, and the requests get TIMEOUT.
* **Reachability.** :meth:`RdmaTransport.can_reach` is true only for replicas whose store advertised RDMA
  (``STORE_INFO``'s ``"rdma"`` entry, fed in with :meth:`RdmaTransport.note_store_info`), and not while the
  store is in a reconnect cooldown, so :class:`~kvpool.transfer.registry.TransportSet` sends the rest over
  TCP.

The code lives in five modules: :mod:`~kvpool.transfer.rdma_wire` (the RDMA_CONNECT codec and control
exchange), :mod:`~kvpool.transfer.rdma_memory` (registration and work-request planning),
:mod:`~kvpool.transfer.rdma_client` (:class:`RdmaTransport`; its connections in
:mod:`~kvpool.transfer.rdma_connection`) and :mod:`~kvpool.transfer.rdma_responder`
(:class:`RdmaResponder`). This module re-exports their public names.
"""

from kvpool.transfer.rdma_client import (
    DEFAULT_MAX_WR_BYTES,
    DEFAULT_SQ_DEPTH,
    RdmaStats,
    RdmaTransport,
)
from kvpool.transfer.rdma_connection import completion_code
from kvpool.transfer.rdma_memory import Piece, SegmentMemory, plan_pieces, register_chunked
from kvpool.transfer.rdma_responder import RdmaResponder
from kvpool.transfer.rdma_wire import (
    MAX_CONNECT_PAYLOAD,
    PROTOCOL_VERSION,
    RemoteRegion,
    exchange_rdma_connect,
    grant_from_json,
    grant_to_json,
    qp_info_from_json,
    qp_info_to_json,
)

__all__ = [
    "DEFAULT_MAX_WR_BYTES",
    "DEFAULT_SQ_DEPTH",
    "MAX_CONNECT_PAYLOAD",
    "PROTOCOL_VERSION",
    "Piece",
    "RdmaResponder",
    "RdmaStats",
    "RdmaTransport",
    "RemoteRegion",
    "SegmentMemory",
    "completion_code",
    "exchange_rdma_connect",
    "grant_from_json",
    "grant_to_json",
    "plan_pieces",
    "qp_info_from_json",
    "qp_info_to_json",
    "register_chunked",
]
