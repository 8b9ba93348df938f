"""Runs a function on W real processes joined by torch.distributed, with a timeout."""

import multiprocessing as mp
import os
import socket
import traceback

import chorus_torch  # noqa: F401  (registers the backend in this process too)


def reserve_port():
    """A socket holding a free port until it is closed: bound with SO_REUSEADDR, never
    listening, it keeps the port from every other process on Linux, yet rank 0's store (torch's
    TCPStore sets SO_REUSEADDR too) binds it (see chorus-launch's PortReservation)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 0))
    return s


def _main(rank, world, port, backend, fn, args, results, env, destroy):
    import torch.distributed as dist

    # One intra-op thread per rank, as torchrun sets for several ranks a host: the ranks share
    # the host's cores, and torch's spinning thread pools would starve each other's calls.
    import torch

    torch.set_num_threads(1)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        import chorus_torch  # noqa: F401,F811

        dist.init_process_group(backend, rank=rank, world_size=world)
        out = fn(rank, world, *args)
        if destroy:
            dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run(world, fn, *args, backend="chorus", timeout=180, env=None, expect_errors=False, destroy=True):
    """Runs fn(rank, world, *args) on `world` processes; returns the results by rank. Each
    destroys its process group after `fn` (or, without `destroy`, leaves it to the exit).

    Raises if a rank fails (unless expect_errors: then each rank's entry is ("ok", value) or
    ("error", text)), or if the job outlasts `timeout` seconds (every process is killed). A rank
    that returned but then did not exit cleanly (a crash at shutdown) has failed."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    reserved = reserve_port()
    port = reserved.getsockname()[1]
    procs = [ctx.Process(target=_main, args=(r, world, port, backend, fn, args, results, env or {}, destroy), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        import queue
        import time

        deadline = time.monotonic() + timeout
        while len(got) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(got))} did not finish within {timeout} s")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
                if dead and all(procs[r].exitcode != 0 for r in dead) and results.empty():
                    time.sleep(0.5)
                    if results.empty():
                        for r in dead:
                            got.setdefault(r, ("error", f"rank {r} exited with code {procs[r].exitcode}"))
                continue
            got[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        reserved.close()
    for r, p in enumerate(procs):
        if got.get(r, ("error",))[0] == "ok" and p.exitcode != 0:
            got[r] = ("error", f"rank {r} returned, then exited with code {p.exitcode}")
    if expect_errors:
        return [got[r] for r in range(world)]
    errors = [f"rank {r}: {v}" for r, (s, v) in sorted(got.items()) if s != "ok"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [got[r][1] for r in range(world)]


def failures(calls, kinds=(ValueError, TypeError, RuntimeError)):
    """The messages of the `calls` that raised one of `kinds`, in order (any other exception
    propagates)."""
    errors = []
    for call in calls:
        try:
            call()
        except kinds as e:
            errors.append(str(e))
    return errors
