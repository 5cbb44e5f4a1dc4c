"""The entry points' error boundary (spd.errors.run_command): Ctrl-C is one line and exit 130 even where the error
that reaches it is another one Ctrl-C caused (a stage process stopped first, failing the start-up wait)."""

import os
import signal
import time

from spd.errors import UserError, run_command


def test_an_error_caused_by_ctrl_c_is_an_interruption(capsys):
    def body():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            raise RuntimeError("Connection closed by peer")    # what a gloo wait raised in the CI run
        return 0

    before = signal.getsignal(signal.SIGINT)
    assert run_command("spd-infer", body) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["spd-infer: interrupted"]
    assert signal.getsignal(signal.SIGINT) is before                # the handler is put back


def test_without_ctrl_c_errors_keep_their_kind(capsys):
    def bad():
        raise UserError("no such key")
    assert run_command("spd-infer", bad) == 2
    assert capsys.readouterr().err.strip() == "spd-infer: error: no such key"

    def bug():
        raise RuntimeError("a bug")
    try:
        run_command("spd-infer", bug)
    except RuntimeError as exc:
        assert str(exc) == "a bug"                  # a traceback, as before
    else:
        raise AssertionError("a bug was swallowed")
