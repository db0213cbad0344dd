"""The losses rayzero trains after importing each DeepSpeed checkpoint of tests/data/deepspeed_ckpt/, against
DeepSpeed's own (docs/checkpoint_format.md, "Moving a DeepSpeed run").  No DeepSpeed needed:

    PYTHONPATH=$PWD:$PWD/tests python bench/ds_import_losses.py
"""
from __future__ import annotations

import os
import sys
import tempfile

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")]

import test_deepspeed_import as T  # noqa: E402
from distributed import run_distributed  # noqa: E402

from rayzero.checkpoint.deepspeed_import import import_deepspeed  # noqa: E402

if __name__ == "__main__":
    root, dirs = tempfile.mkdtemp(), {}
    for s in T.SOURCES:
        dirs[s] = os.path.join(root, s)
        import_deepspeed(T.SOURCES[s], dirs[s])
    world1 = T.continue_training(0, 1, dirs, {s: 0 for s in dirs})
    stages = {s: {1: 3, 2: 1, 3: 2}[T.CASES[T.CASE_OF[s]].stage] for s in dirs}
    world2 = run_distributed(T.continue_training, 2, dirs, stages)[0]
    for s in dirs:
        ref = T.reference(s)["losses_after"]
        d1 = max(abs(a - b) for a, b in zip(world1[s], ref))
        d2 = max(abs(a - b) for a, b in zip(world2[s], ref))
        print(f"{s:26s} DeepSpeed {[round(x, 6) for x in ref]}  max |difference|: world 1 stage 0 {d1:.2e}, "
              f"world 2 stage {stages[s]} {d2:.2e}")
