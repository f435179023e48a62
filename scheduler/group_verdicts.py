"""One admission verdict for all the sequences of one API request.

Admission judges a request's choices (and a batch's prompts) as one unit, on the whole group's
work, so every member should get the same answer. Members reach the scheduler one by one,
though, and not always between the same two steps (an inline predictor batch may end between
them): judged afresh, a later member could be refused after its siblings were admitted, and the
server then aborted the admitted ones, counting one 429 as a refusal and n - 1 aborts. The first
member's verdict is kept and given to the rest.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from scheduler.admission import AdmissionRejected
from scheduler.request import Request

# Verdicts of groups whose members have not all arrived. A member that never arrives (its client
# left while it waited for the predictor) leaves its group's entry behind: the oldest go first.
MAX_OPEN_GROUPS = 1024


@dataclass
class _Verdict:
    rejection: AdmissionRejected | None  # None: admitted
    members_seen: int = 1


class GroupVerdicts:
    def __init__(self, max_open_groups: int = MAX_OPEN_GROUPS) -> None:
        self._open: OrderedDict[str, _Verdict] = OrderedDict()
        self._max_open = max_open_groups

    def judge(self, request: Request, check: Callable[[], None],
              refuse_again: Callable[[AdmissionRejected], None]) -> None:
        """Run `check` (raising AdmissionRejected to refuse) for a request alone or the first
        member of its group; give a later member the first one's verdict, a refusal through
        `refuse_again` (which raises it, counted)."""
        group = request.group
        if group is None or group.size == 1:
            check()
            return
        verdict = self._open.get(group.group_id)
        if verdict is None:
            verdict = self._first_verdict(group.group_id, check)
        else:
            verdict.members_seen += 1
        if verdict.members_seen >= group.size:
            del self._open[group.group_id]
        if verdict.rejection is not None:
            if verdict.members_seen == 1:
                raise verdict.rejection
            refuse_again(verdict.rejection)

    def _first_verdict(self, group_id: str, check: Callable[[], None]) -> _Verdict:
        try:
            check()
            verdict = _Verdict(None)
        except AdmissionRejected as rejection:
            verdict = _Verdict(rejection)
        self._open[group_id] = verdict
        while len(self._open) > self._max_open:
            self._open.popitem(last=False)
        return verdict

    def __len__(self) -> int:
        return len(self._open)
