"""The scheduler's public records and errors (``serve/scheduler.py`` re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass

from perfx_compiler.errors import PerfXError
from perfx_compiler.runtime.sampling import Logprob

__all__ = ["QueueFull", "SchedulerClosed", "SchedulerStats", "SequenceResult", "StreamEvent"]


class QueueFull(PerfXError):
    """The waiting queue is full; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class SchedulerClosed(PerfXError):
    """The scheduler is shut down (or not started) and takes no requests."""


@dataclass
class StreamEvent:
    """New output of one sequence of a request (delivered from the worker thread)."""

    request_id: str
    index: int  # which of the request's n sequences
    text: str  # text completed by this step ('' while held back or mid-character)
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" on a sequence's last event
    stop_reason: int | str | None = None
    error: str | None = None
    request_finished: bool = False  # every sequence of the request is done


@dataclass
class SequenceResult:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    error: str | None = None


@dataclass
class SchedulerStats:
    queue_depth: int = 0  # requests with a sequence waiting for admission
    running: int = 0  # sequences holding KV pages
    kv_pages_used: int = 0  # held by sequences
    kv_pages_cached: int = 0  # held by none, kept for their cached prefix (free to take)
    kv_pages_total: int = 0
    steps: int = 0
    preemptions: int = 0
