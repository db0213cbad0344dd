"""A ``rayzero.fit`` driver for tests/test_ray_stop.py, run as its own process (signals go to the driver):
``python ray_stop_driver.py ADDRESS STORAGE NAME MAX_STEPS [save_on_stop]``.  Slow steps (KillOnce that kills
no one, 0.1 s a step), so that a signal lands mid-run; prints ``FINISHED <checkpoint>`` when fit returns."""

import sys

import ray

import rayzero
from ray_cases import CONFIG, WORKER_PYTHONPATH, KillOnce, Regression, model_factory

DETERMINISTIC = {**CONFIG, "deterministic": True}

if __name__ == "__main__":
    address, storage, name, max_steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    cluster = {"workers": 2, "storage": storage, "name": name, "checkpoint_every": 5}
    if sys.argv[5:] == ["no-save"]:
        cluster["save_on_stop"] = False
    ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": WORKER_PYTHONPATH}})
    result = rayzero.fit(
        model_factory,
        cluster,
        config=DETERMINISTIC,
        data=Regression(),
        train_step=KillOnce("/nonexistent", rank=-1, step=-1, delay_s=0.1),
        max_steps=max_steps,
    )
    print("FINISHED", result.checkpoint, result.resumed_from, flush=True)
