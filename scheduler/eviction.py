"""How a preempted request gives up its KV blocks: the preemption mode as a policy object.

`RecomputeEviction` frees the blocks and forgets the computed tokens: the request keeps its
prompt and output tokens and re-feeds them when it resumes. `SwapEviction` books copies of the
blocks to the host pool (the runner makes them before the step's forward) and falls back to
recompute when the host pool is short. Each returns the status the request moves to, which names
the queue it waits in, so the scheduler files it without asking which mode it runs.
"""

from __future__ import annotations

import logging
from typing import Protocol

from scheduler.block_manager import BlockManager
from scheduler.request import Request, RequestStatus
from scheduler.step import StepPlan

logger = logging.getLogger(__name__)


class Eviction(Protocol):
    needs_host_pool: bool  # whether the mode copies blocks to host memory (the engine sizes a pool)

    def evict(self, request: Request, block_manager: BlockManager, plan: StepPlan) -> RequestStatus:
        """Take the request's device blocks away; returns PREEMPTED (recompute) or SWAPPED."""
        ...


def free_for_recompute(request: Request, block_manager: BlockManager) -> None:
    """Release every block the request holds (device and host) and forget its computed tokens."""
    block_manager.free(request)
    request.num_computed_tokens = 0


class RecomputeEviction:
    needs_host_pool = False

    def evict(self, request: Request, block_manager: BlockManager, plan: StepPlan) -> RequestStatus:
        free_for_recompute(request, block_manager)
        return RequestStatus.PREEMPTED


class SwapEviction:
    needs_host_pool = True

    def __init__(self) -> None:
        self._fell_back = False  # warned once: a full pool tends to stay full under the same load

    def evict(self, request: Request, block_manager: BlockManager, plan: StepPlan) -> RequestStatus:
        if not block_manager.can_swap_out(request):
            if not self._fell_back:
                logger.warning("the host swap pool is full: preempting by recompute instead (a larger "
                               "pool, swap_space_gib, keeps more swapped); warned once")
                self._fell_back = True
            return RecomputeEviction().evict(request, block_manager, plan)
        plan.swap_out.extend(block_manager.swap_out(request))
        return RequestStatus.SWAPPED


EVICTIONS: dict[str, type] = {"recompute": RecomputeEviction, "swap": SwapEviction}


def needs_host_pool(mode: str) -> bool:
    """Whether a validated preemption mode needs host memory to swap blocks into."""
    return EVICTIONS[mode].needs_host_pool


def make_eviction(mode: str) -> Eviction:
    """The eviction of a mode SchedulerConfig has validated."""
    return EVICTIONS[mode]()
