from collections.abc import Sequence

from typing_extensions import Buffer

DONE: int
STOPPED: int
BAD_FRAME: int
TIMED_OUT: int
CONNECTION_FAILED: int
FLAG_FROM_PAGES: int

def pipeline(
    fd: int,
    frames: Sequence[Buffer],
    buffers: Sequence[Buffer],
    first_req_id: int,
    window: int,
    max_inflight: int,
    at: float | None,
    armed: float | None,
    op: int,
    write_op: int,
    closing: Sequence[int],
    sources: Sequence[int] | None = None,
    /,
) -> tuple[list[int], int, int, str, float | None]: ...
def copy_into(dest: Buffer, src: Buffer, /) -> None: ...
