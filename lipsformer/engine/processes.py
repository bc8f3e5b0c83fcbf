"""The processes torchrun or ``accelerate launch`` start: ending them cleanly."""
import functools
from typing import Callable

import torch.distributed as dist


def ends_processes(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap a command's ``main``: once it returns an exit code (the errors it handles included), the process
    group, if one was started, is destroyed while the interpreter is still whole.

    Left to the interpreter's exit, gloo's worker threads can abort the process ("terminate called without an
    active exception", SIGABRT), now and then, after every result was written: torchrun then reports the run as
    failed (pytorch/pytorch#190489). An exception ``main`` does not handle passes through with the group left
    alone, since destroying it while another process may still be in a collective can hang.
    """
    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        code = main(*args, **kwargs)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        return code
    return run
