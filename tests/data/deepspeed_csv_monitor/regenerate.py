"""Writes DeepSpeed's own csv_monitor files for EVENTS into job/ here (run with DeepSpeed installed):

    DS_ACCELERATOR=cpu python tests/data/deepspeed_csv_monitor/regenerate.py

tests/test_config_deepspeed.py checks that rayzero's csv sink writes the same bytes for the same events."""

import os
import shutil

EVENTS = [
    [("Train/Samples/train_loss", 0.731, 0), ("Train/Samples/lr", 0.001, 16)],
    [("Train/Samples/train_loss", 0.52, 16), ("Train/Samples/lr", 0.002, 32),
     ("Train/Samples/loss_scale", 32768.0, 32)],
]

if __name__ == "__main__":
    import deepspeed
    from deepspeed.monitor.config import CSVConfig
    from deepspeed.monitor.csv_monitor import csvMonitor

    here = os.path.dirname(os.path.abspath(__file__))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    deepspeed.init_distributed(dist_backend="gloo")
    shutil.rmtree(os.path.join(here, "job"), ignore_errors=True)
    monitor = csvMonitor(CSVConfig(enabled=True, output_path=here, job_name="job"))
    for events in EVENTS:
        monitor.write_events(events)
    print(deepspeed.__version__, sorted(os.listdir(os.path.join(here, "job"))))
