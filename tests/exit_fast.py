"""``python exit_fast.py SCRIPT ARGS`` (or ``-m MODULE ARGS``): run it as ``python`` would, then
leave without the interpreter's teardown.

Freeing the modules Megatron-Core imports (torch._dynamo and inductor among them) takes a
second or more of CPU a process after the job has ended; a launch of 4 ranks on 2 cores waits
for all of them, and the suite launches some two hundred. Everything a normal exit does for
the job still happens: non-daemon threads are joined, atexit handlers run, the streams are
flushed and the exit code is the script's. An exception leaves the normal way (traceback,
teardown, status 1). ``launch.torchrun_cmd`` puts this in front of its target unless asked
not to; tests/test_entry_point.py runs the README's main job without it, so a hang in the
product's own teardown still fails a test. A fatal signal (a segfault in a native kernel or in
gloo) prints every thread's Python stack first (faulthandler), so the test's output says where."""

import atexit
import faulthandler
import os
import runpy
import sys
import threading


def run_target(argv):
    """Run ``argv`` (``SCRIPT ARGS`` or ``-m MODULE ARGS``) as ``__main__``; its exit code."""
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = argv[1:], os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    return 0


def leave(code: int) -> None:
    """What a normal exit does for the job, in the interpreter's order, then ``os._exit``:
    threading's own shutdown first (it tells thread pools to stop, as
    ``concurrent.futures`` registers, then joins the non-daemon threads: joining a pool's idle
    worker without that never returns; a Megatron-LM save left one), then the atexit
    handlers."""
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    faulthandler.enable()
    leave(run_target(sys.argv[1:]))
