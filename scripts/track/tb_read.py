"""Read every scalar of a TensorBoard log directory with TensorBoard's own EventAccumulator.

Usage: python tb_read.py LOGDIR
Prints one JSON object: {"tags": {tag: [[step, "value repr"], ...]}, "files": N}. Values are printed with repr()
so that nan / inf survive JSON. Used by kiln-track's tests to validate kiln's event files.
"""
import json
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main() -> None:
    logdir = sys.argv[1]
    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = {}
    for tag in acc.Tags()["scalars"]:
        tags[tag] = [[e.step, repr(float(e.value))] for e in acc.Scalars(tag)]
    files = [f for f in os.listdir(logdir) if f.startswith("events.out.tfevents.")]
    print(json.dumps({"tags": tags, "files": len(files)}))


if __name__ == "__main__":
    main()
