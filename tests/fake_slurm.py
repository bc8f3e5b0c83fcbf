"""Stand-ins for SLURM's ``srun`` and ``scontrol``, so that examples/slurm/ runs on one host as several "nodes".

    fake_slurm.py srun [OPTIONS] COMMAND...   COMMAND once per node (SLURM_NNODES), each with its SLURM_NODEID;
                                              a SIGUSR1 or SIGTERM it gets goes to every process of every node,
                                              as slurmstepd signals a whole step; the exit code is the highest.
                                              With FAKE_SLURM_ECHO set: print COMMAND and the launcher's
                                              variables (PET_*, TORCH_ELASTIC_*) as JSON, and exit 0.
    fake_slurm.py scontrol show hostnames X   prints 127.0.0.1
    fake_slurm.py scontrol requeue JOB        appends "requeue JOB" to the file FAKE_SLURM_LOG
"""
import json
import os
import signal
import subprocess
import sys

import psutil


def srun(args) -> int:
    while args and args[0].startswith("-"):
        args = args[1:]
    if os.environ.get("FAKE_SLURM_ECHO"):
        print(json.dumps(dict(command=args, env={k: v for k, v in os.environ.items()
                                                 if k.startswith(("PET_", "TORCH_ELASTIC_"))})))
        return 0
    tasks = [subprocess.Popen(args, env=dict(os.environ, SLURM_NODEID=str(n), SLURM_PROCID=str(n), SLURM_LOCALID="0"))
             for n in range(int(os.environ.get("SLURM_NNODES", "1")))]

    def pass_on(signum, frame):
        for task in tasks:
            try:
                step = psutil.Process(task.pid)
                processes = [step, *step.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for process in processes:
                try:
                    process.send_signal(signum)
                except psutil.NoSuchProcess:
                    pass

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, pass_on)
    codes = [task.wait() for task in tasks]
    return max(128 - c if c < 0 else c for c in codes)


def scontrol(args) -> int:
    if args[:2] == ["show", "hostnames"]:
        print("127.0.0.1")
        return 0
    if args[:1] == ["requeue"]:
        with open(os.environ["FAKE_SLURM_LOG"], "a") as f:
            f.write(" ".join(args) + "\n")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit({"srun": srun, "scontrol": scontrol}[sys.argv[1]](sys.argv[2:]))
