"""The processes torchrun or ``accelerate launch`` start: ending them cleanly."""


def end_process_group() -> None:
    """Destroy the process group, if one was started, while the interpreter is still whole. Every command's
    boundary (:func:`lipsformer.cli.command`) calls it once ``main`` has an exit code (the errors it tells in one
    line included).

    Left to the interpreter's exit, gloo's worker threads can abort the process ("terminate called without an
    active exception", SIGABRT), now and then, after every result was written: torchrun then reports the run as
    failed (pytorch/pytorch#190489). After a bug or Ctrl-C the boundary leaves the group alone, since destroying it
    while another process may still be in a collective can hang.
    """
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
