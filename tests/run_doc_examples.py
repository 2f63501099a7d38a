"""Run documentation examples, one after the other, on every rank of this job.

    mpiexec -n N python run_doc_examples.py EXAMPLES.json

EXAMPLES.json: a list of {"where": "file:line", "source": "..."}. Each example runs as a
program of its own (a fresh namespace, `__name__ == "__main__"`) in this process. An
example that raises on any rank ends the whole job (MPI_Abort), naming it, so that no
rank waits forever for one that stopped; rank 0 prints how many ran.
"""

import json
import linecache
import sys
import traceback


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
            print(f"EXAMPLE FAILED on rank {rank}: {ex['where']}\n{traceback.format_exc()}",
                  flush=True)
            MPI.COMM_WORLD.Abort(1)
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"examples passed: {len(examples)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
