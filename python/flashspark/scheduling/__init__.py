"""How many drafts each request verifies per step: fixed K, or DSpark's confidence
scheduler (on DSpark's own head or DFlash 2's confidence proxy), with the step costs and
the calibration they rest on. Schedulers never import the loop: it calls them through
`Scheduler` (base.py)."""

from .base import Scheduler, ScheduleState
from .fixed import FixedK

__all__ = ["FixedK", "ScheduleState", "Scheduler"]
