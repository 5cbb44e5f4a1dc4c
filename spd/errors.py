"""User-facing errors: one line naming the problem and the fix; entry points turn them into exit code 2."""

import errno
import signal
import sys
import threading


class UserError(Exception):
    """Bad input from the user (config, checkpoint, prompt). Never raised for internal bugs."""


class PipelineFailure(RuntimeError):
    """A pipeline process died, hung past its timeout, or the group could not be formed (the CLI: exit code 1)."""


# Failures of files and paths that reach an entry point are the user's to fix (a path that is a file, a full disk,
# no permission): one line, exit 2. Anything else is a bug and keeps its traceback.
FILE_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)
FILE_ERRNOS = {errno.ENOSPC: "no space left on the disk", errno.EROFS: "the file system is read-only",
               errno.EDQUOT: "disk quota exceeded"}


def run_command(command: str, body) -> int:
    """The error boundary of an entry point: `<command>: error: ...` and exit 2 for bad input, 1 for a failed
    pipeline process, 130 for Ctrl-C; never a traceback for those."""
    interrupted = []
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGINT)

        def on_sigint(signum, frame):
            interrupted.append(signum)
            signal.default_int_handler(signum, frame)
        signal.signal(signal.SIGINT, on_sigint)
    try:
        try:
            return body()
        except Exception:
            # Ctrl-C while the pipeline starts: a stage process it stopped first can fail the wait before the
            # KeyboardInterrupt reaches this thread — the interruption is what happened
            if interrupted:
                raise KeyboardInterrupt from None
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
    except UserError as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 2
    except PipelineFailure as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        if not isinstance(exc, FILE_ERRORS) and exc.errno not in FILE_ERRNOS:
            raise
        what = FILE_ERRNOS.get(exc.errno) or exc.strerror or errno.errorcode.get(exc.errno, type(exc).__name__)
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"{command}: error: {what}{where}; check the path, its permissions and the free space", file=sys.stderr)
        return 2
