"""A data-parallel replica's process: `python -m meshserve.engine.replica FD INDEX`.

Started by `data_parallel.DataParallelEngine` with one end of a socket pair as FD. The
first message is the replica's config; then it runs its own Engine (and that engine's
tp x pp ranks), taking "add", "abort", "reset" and "stop" commands and sending back every
step's outputs with its counters. It exits when told to stop or when the front is gone.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection

from meshserve.engine.engine import Engine


def serve(index: int, conn: Connection) -> int:
    """Run the replica until "stop" or the front's end of `conn` closes."""
    config = conn.recv()
    try:
        engine = Engine(config, progress=False)
    except BaseException as e:  # noqa: BLE001 - reported to the front
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return 1
    conn.send(("ready", engine.num_blocks, engine.stats))
    try:
        while True:
            while not engine.has_unfinished() or conn.poll():
                kind, *args = conn.recv()
                if kind == "stop":
                    return 0
                if kind == "add":
                    engine.add_request(*args)
                elif kind == "abort":
                    engine.abort(args[0])
                elif kind == "reset":
                    conn.send(("reset", engine.reset_prefix_cache(), engine.stats))
            outs = engine.step()
            if outs:
                conn.send(("outputs", outs, engine.stats))
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the front is gone
        return 0
    except BaseException as e:  # noqa: BLE001 - reported to the front
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        return 1
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Entry point: the socket's file descriptor and this replica's index."""
    fd, index = (argv if argv is not None else sys.argv[1:])[:2]
    return serve(int(index), Connection(int(fd)))


if __name__ == "__main__":
    sys.exit(main())
