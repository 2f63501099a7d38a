"""Run documentation examples, one after the other, on every rank of this job.

    mpiexec -n N python run_doc_examples.py EXAMPLES.json

EXAMPLES.json: a list of {"where": "file:line", "source": "..."}. Each example runs as a
program of its own (a fresh namespace, `__name__ == "__main__"`) in this process. An
example that raises on any rank ends the whole job (MPI_Abort), naming it, so that no
rank waits forever for one that stopped; rank 0 prints how many ran.

A failing rank prints its report and also writes it to EXAMPLES.json's folder as
`failed-rank<R>.txt`: MPICH's launcher, tearing the job down after MPI_Abort, sometimes
drops everything the ranks wrote to stdout and stderr (seen in about 1 run of 10), and a
file is not lost that way.
"""

import json
import linecache
import sys
import time
import traceback
from pathlib import Path


def main(path):
    examples = json.load(open(path))
    for ex in examples:
        # (the source where tracebacks look for it: a failure shows its line)
        linecache.cache[ex["where"]] = (len(ex["source"]), None,
                                        ex["source"].splitlines(True), ex["where"])
        try:
            code = compile(ex["source"], ex["where"], "exec")
            exec(code, {"__name__": "__main__"})
        except BaseException:  # noqa: BLE001 (SystemExit too: an example must not exit)
            from mpi4py import MPI

            rank = MPI.COMM_WORLD.Get_rank()
            report = f"EXAMPLE FAILED on rank {rank}: {ex['where']}\n{traceback.format_exc()}"
            (Path(path).parent / f"failed-rank{rank}.txt").write_text(report)
            print(report, flush=True)
            time.sleep(0.2)  # (time for the launcher to forward it, as vjpmpi's own aborts)
            MPI.COMM_WORLD.Abort(1)
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"examples passed: {len(examples)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
