"""Run a benchmark's independent training runs N at a time: each in its own process on one thread.

A digits-sized run is bound by Python overhead, so two one-thread runs use two cores better than one two-thread
run. Each run seeds itself; the thread count changes float rounding only.
"""
import argparse
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, List, Sequence


def add_jobs_argument(parser: argparse.ArgumentParser) -> None:
    """``--jobs N`` (default 1): the runs at a time; fewer than 1 is refused with argparse's one line."""
    def at_least_one(text: str) -> int:
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
        return value

    parser.add_argument("--jobs", type=at_least_one, default=1,
                        help="runs at a time, each in its own process on one thread")


def _one_thread() -> None:
    import torch
    torch.set_num_threads(1)


def run_jobs(fn: Callable, jobs: Sequence[tuple], processes: int, report: Callable = lambda r: r) -> List:
    """``[report(fn(*job)) for job in jobs]``, in order; with ``processes > 1`` the calls run in that many spawned
    processes (``fn`` and the arguments must pickle: a module-level function), ``report`` as each result is due."""
    if processes == 1:
        return [report(fn(*job)) for job in jobs]
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_one_thread) as pool:
        futures = [pool.submit(fn, *job) for job in jobs]
        try:
            return [report(f.result()) for f in futures]
        except BaseException:  # a failed run (or ^C) stops the queue instead of running every job first
            pool.shutdown(wait=False, cancel_futures=True)
            raise
