"""Ends what a local Ray instance leaves behind when its sweep driver dies without shutting it down.

Ray's raylet and GCS fate-share with the driver, but after a kill -9 its DashboardAgent and
RuntimeEnvAgent first try to report the raylet's death to the GCS, which is gone, and live on for
about a minute. The driver starts this script (``ray_launcher.start_ray``) with a pipe on its stdin.
It imports nothing of runlab's, keeps a list of the driver's Ray processes, and once the pipe closes
(the driver exited, however it exited) kills those still alive.

Usage: python reaper.py DRIVER_PID
"""
import os
import select
import signal
import sys
import time

import psutil

POLL_S = 0.5  # how often the driver's Ray processes are listed: each new worker must be seen once
GRACE_S = 1.0  # what Ray's own processes get to end by themselves first


def ray_descendants(driver: psutil.Process) -> set:
    """(pid, start time) of each Ray process under the driver: the start time tells a reused pid apart."""
    found = set()
    try:
        children = driver.children(recursive=True)
    except psutil.Error:
        return found
    for child in children:
        try:
            if child.pid != os.getpid() and "ray" in " ".join(child.cmdline()):
                found.add((child.pid, child.create_time()))
        except psutil.Error:
            continue  # it ended while being listed
    return found


def driver_gone() -> bool:
    readable, _, _ = select.select([sys.stdin], [], [], POLL_S)
    return bool(readable) and not os.read(sys.stdin.fileno(), 1024)


def kill_survivors(processes: set) -> None:
    time.sleep(GRACE_S)
    for pid, started in processes:
        try:
            process = psutil.Process(pid)
            if process.create_time() == started:
                process.send_signal(signal.SIGKILL)
        except psutil.Error:
            continue  # ended by itself


def main(driver_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the driver, which then shuts Ray down
    driver = psutil.Process(driver_pid)
    seen = set()
    while not driver_gone():
        seen |= ray_descendants(driver)
    kill_survivors(seen)


if __name__ == "__main__":
    main(int(sys.argv[1]))
