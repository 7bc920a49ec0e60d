"""The child of engines/child.py: ``python -m kestrel_tui.engines.child_main LIBRARY``.

Only the standard library is imported before LIBRARY (llama_cpp): kestrel's own modules bring
numpy and cffi extensions, and on some images a native library loaded after them crashes.
Nothing is imported from the working directory (engines/child.py starts this with ``-P``).
"""
import os
import pickle
import sys
from dataclasses import replace


def safe_path() -> None:
    """Drop the path entries that are the working directory (an empty one, ".", or its own name, from
    PYTHONPATH): kestrel_tui is imported already, and a module there is a stranger's file."""
    cwd = os.path.realpath(os.getcwd())
    sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != cwd]


def serve() -> None:
    """The child: read one Job from stdin, run it, write pickled messages to the real stdout."""
    safe_path()
    __import__(sys.argv[1])  # first: before the job's classes bring numpy and kestrel's extensions in
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything the library prints goes to stderr, never into the message stream
    job = pickle.load(sys.stdin.buffer)  # an engines.child.Job

    from kestrel_tui.trace.run import Cancelled
    from kestrel_tui.engines.base import EngineFailed
    from kestrel_tui.engines.child import ModelShape
    from kestrel_tui.errors import UsageError
    from kestrel_tui.trace import rawstore

    rawstore.DEFAULT_BUDGET = 1 << 62  # raw buffers go to the parent (whose store spills): none on disk here

    def send(*msg):
        pickle.dump(msg, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()

    module, name = job.factory.split(":")
    try:
        factory = getattr(__import__(module, fromlist=[name]), name)
        engine = factory(job.spec, ModelShape(job.cfg), kv=job.kv, deep=job.deep)
        if job.request is None:
            send("done", None)
            return
        def on_position(p):
            send("pos", p)
            p.raw = None  # the parent holds them now

        req = replace(job.request, on_position=on_position)
        trace = engine.run(req)
        send("done", trace.backend)
    except EngineFailed as e:  # before UsageError: it is one
        send("failed", str(e))
    except UsageError as e:
        send("usage", str(e))
    except Cancelled:
        send("cancelled")


if __name__ == "__main__":
    serve()
