"""Whether a process of this host still runs: what the run folder's lock and the token
cache's build lock ask of a lock left by a process that may have died."""
import os


def alive(pid: int) -> bool:
    """True while process ``pid`` exists (also one of another user: signalling it is refused,
    not failed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
