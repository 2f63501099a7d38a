"""A progress bar for a jitted training loop that tells the truth about compiling.

The first step of a jitted loop compiles the program (seconds); the others run it
(milliseconds). A bar started before the first step counts the compile as a step and
shows a rate and an ETA many times too slow. `StepBar` says "compiling" until the first
step has ended, then starts the bar at step 1, so its rate and ETA count run steps only.
"""

import sys


class StepBar:
    """tqdm's `set_postfix` / `update` / `close`, started after the first (compiling) step.

    Args:
        total: the number of steps.
        desc: the bar's label.
        file: where to write (default: stderr, as tqdm).
    """

    def __init__(self, total, desc, file=None):
        self.total, self.desc, self.file = total, desc, file
        self.bar, self.postfix = None, {}
        print(f"{desc}: compiling the training step ...", file=file or sys.stderr, flush=True)

    def set_postfix(self, **values):
        self.postfix = values
        if self.bar is not None:
            self.bar.set_postfix(**values)

    def update(self, n=1):
        if self.bar is None:  # the first step has ended: it compiled; the bar starts now
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=n, desc=self.desc, mininterval=0.5,
                            file=self.file, postfix=self.postfix or None)
            return
        self.bar.update(n)

    def close(self):
        if self.bar is not None:
            self.bar.close()
