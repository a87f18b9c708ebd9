"""Re-ordering: program order, the DP scheduler, narrow-waist partition, incremental scheduling.

MAGIS §5.2 (re-ordering saves memory at no cost in time), §6.1 and Alg. 2 (incremental
scheduling); Serenity's DP (MAGIS ref. [3]); ROAM §IV-A (independent segments, weight-update
placement).
"""

from magis.schedule.incremental import (
    IncrementalResult,
    incremental_schedule,
    reschedule_interval,
)
from magis.schedule.narrow_waist import nw_values
from magis.schedule.problem import Problem, problem_of
from magis.schedule.scheduler import (
    Scheduler,
    ScheduleResult,
    UnknownSchedulerError,
    peak_lower_bound,
    schedule,
    verify_schedule,
)
from magis.schedule.solve import Options, SegmentInfo

__all__ = [
    "IncrementalResult",
    "Options",
    "Problem",
    "ScheduleResult",
    "Scheduler",
    "SegmentInfo",
    "UnknownSchedulerError",
    "incremental_schedule",
    "nw_values",
    "peak_lower_bound",
    "problem_of",
    "reschedule_interval",
    "schedule",
    "verify_schedule",
]
