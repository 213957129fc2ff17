"""What the SSD tier does with a put that finds DRAM full while demotions are still in flight (a burst).

Two policies (docs/ssd-tier.md, "Bursts"; docs/decisions/0036-drop-coldest-burst-policy.md):

* ``backpressure`` (the default): the put is refused with ``DEMOTION_BACKLOG`` and the client asks again until
  its deadline, so puts are slowed to the disk's pace and nothing the SSD could hold is lost;
* ``drop-coldest``: the put goes through at once; the least recently used DRAM objects that have no SSD copy
  (and none in flight) are dropped to make room, as an eviction forced by a failed allocation does. Each such
  drop is counted (``burst_dropped``), never silent.

Registered like the placement and eviction policies: ``MasterConfig.ssd_burst_policy``'s choices come from
:data:`BURST_POLICIES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpool.common.registry import Registry

__all__ = ["BURST_POLICIES", "BurstPolicy", "make_burst_policy"]


@dataclass(frozen=True, slots=True)
class BurstPolicy:
    name: str
    holds_back: bool
    """True: refuse the put with DEMOTION_BACKLOG while demotions in flight will free DRAM. False: drop the
    coldest objects to fit it at once."""


# The one list of burst policies: MasterConfig.ssd_burst_policy's choices and --help come from it.
BURST_POLICIES: Registry[Callable[[], BurstPolicy]] = Registry("SSD burst policy")
BURST_POLICIES.add("backpressure", lambda: BurstPolicy("backpressure", holds_back=True))
BURST_POLICIES.add("drop-coldest", lambda: BurstPolicy("drop-coldest", holds_back=False))


def make_burst_policy(name: str) -> BurstPolicy:
    return BURST_POLICIES.get(name)()
