"""What a rank's failure says of the program that failed: the traceback a user reads (the
program's own frames, not those it was called through), and the marks its records carry
(rank/join/joined.py writes them, hpc_ddp/watch/failures.py and the supervisors read them)."""

from __future__ import annotations

import traceback

# Marks an error file whose rank failed on its own (not because a peer went away).
LOCAL_MARK = "[own failure]"
# The frames a rank's program is called through (submitit's task, our rank path, the
# supervisors): a user's traceback starts below them. Paths relative to site-packages or the
# repository, as a traceback shows them.
_WRAPPERS = ("hpc_ddp/rank/main/", "hpc_ddp/rank/join/joined.py", "hpc_ddp/rank/supervise/",
             "submitit/", "<frozen runpy>", "/runpy.py")
# Marks an exception whose rank recorded it (error file, rank log): the process that ends
# with it exits 1 without printing it again (rank/main/submitted.py, child.py).
RECORDED = "_hpc_ddp_recorded"
# Heads the last block of an error file: the whole chain (hpc_ddp/watch/failures.py reads it); the
# second form for a failure that is another rank's (a collective that failed when a peer
# died: the rank's last log lines say more than its frames).
FULL_TRACEBACK = "Full traceback (hpc_ddp's frames too):"
FULL_TRACEBACK_PEER = "Full traceback (hpc_ddp's frames too; the failure is another rank's):"
# ... and for a supervised rank, its training process's own chain (the supervisor's frames
# say nothing of the failure).
FULL_TRACEBACK_CHILD = "Full traceback (of the training process, hpc_ddp's frames too):"


class ChildFailed(Exception):
    """A supervisor's record of its training process's failure, as the process reported it
    (rank/supervise/outcome.py): when (``at``), the program's traceback and the whole chain.
    The cause of the error a supervisor raises, so that the rank's error file holds the
    program's frames, not the supervisor's (joined.record_error)."""

    def __init__(self, cause: str, at: float, trace: str, full: str) -> None:
        super().__init__(cause)
        self.at, self.trace, self.full = at, trace, full


def child_failed(error: BaseException | None) -> ChildFailed | None:
    """The ChildFailed in ``error``'s chain, if any."""
    while error is not None:
        if isinstance(error, ChildFailed):
            return error
        error = error.__cause__
    return None


def program_traceback(error: BaseException) -> str:
    """The traceback a user reads: of the error the program raised (the first of a chain of
    ours), from the program's first frame down (the frames it was called through dropped);
    "" for a refusal of ours (a UserError: its message is complete) or without frames."""
    from hpc_ddp.errors import UserError  # deferred (start-up): errors

    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    if isinstance(root, UserError) or root.__traceback__ is None:
        return ""
    frames = traceback.extract_tb(root.__traceback__)
    keep = 0
    while keep < len(frames) and any(w in frames[keep].filename for w in _WRAPPERS):
        keep += 1
    if keep == len(frames):
        return ""
    lines = ["Traceback (most recent call last):\n",
             *traceback.StackSummary.from_list(frames[keep:]).format(),
             *traceback.format_exception_only(type(root), root)]
    return "".join(lines).rstrip("\n")


