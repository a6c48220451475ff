#!/usr/bin/env python3
"""t/golden/tb_read.py -- TensorBoard's own view of epjit's event files.

Not run by make check (it needs the tensorboard package:
`python3 -m venv VENV && VENV/bin/pip install tensorboard`).

  tb_read.py golden OUT
      Writes the fixed events of t/check_tensorboard.c (FIXED below) with
      TensorBoard's protobuf classes and record writer: the golden file
      t/golden/tb_scalars.tfevents that the C writer must reproduce byte for
      byte.
  tb_read.py fixed FILE
      Reads FILE (the golden, or an event file written by the C writer for
      the same events; its name must contain "tfevents", as TensorBoard
      requires of a file) with TensorBoard's EventAccumulator and checks
      every tag, step, value and wall_time against FIXED.
  tb_read.py run DIR CSV_DIR
      Reads the event file(s) of epjit-train's tensorboard folder DIR with
      EventAccumulator and checks every Train/Samples/ tag against the
      csv_monitor files of the same run (float rounding aside).
"""
import csv
import os
import struct
import sys

VERSION_WALL = 1700000000.25
LONG_TAG = "Train/Samples/" + "x" * 150
# (wall_time, step, tag, value): the events after the file_version one
FIXED = [
    (1700000001.5, 6, "Train/Samples/train_loss", 2.5),
    (1700000001.5, 6, "Train/Samples/lr", 0.001),
    (1700000001.5, 6, "Train/Samples/compile_ms", 0.0),
    (1700000002.125, 12, "Train/Samples/grad_norm", -1.25),
    (1700000002.125, 0, "Train/Samples/tokens_per_s", 123456.789),
    (1700000002.125, 1 << 40, "Train/Samples/peak_alloc_bytes", 3.0e38),
    (1700000003.0, 128, LONG_TAG, 1.5),
]
METRICS = ["train_loss", "lr", "grad_norm", "tokens_per_s", "step_time_ms",
           "peak_alloc_bytes", "compile_ms"]


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_ulp(x):
    """The gap from float32 x to the next float32 away from zero."""
    if x == 0:
        return 0.0
    (bits,) = struct.unpack("<I", struct.pack("<f", abs(x)))
    (up,) = struct.unpack("<f", struct.pack("<I", bits + 1))
    return up - abs(x)


def golden(out):
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter
    with open(out, "wb") as f:
        w = RecordWriter(f)
        w.write(event_pb2.Event(wall_time=VERSION_WALL,
                                file_version="brain.Event:2")
                .SerializeToString())
        for wall, step, tag, value in FIXED:
            s = summary_pb2.Summary(
                value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])
            w.write(event_pb2.Event(wall_time=wall, step=step, summary=s)
                    .SerializeToString())
        w.flush()
    print("wrote", out)


def accumulate(path):
    from tensorboard.backend.event_processing import event_accumulator
    acc = event_accumulator.EventAccumulator(
        path, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return acc


def fixed(path):
    from tensorboard.backend.event_processing import event_file_loader
    # the raw events, in order: the first is the file_version one
    events = list(event_file_loader.EventFileLoader(path).Load())
    assert events[0].file_version == "brain.Event:2", events[0]
    assert events[0].wall_time == VERSION_WALL, events[0].wall_time
    assert len(events) == 1 + len(FIXED), len(events)
    acc = accumulate(path)
    tags = sorted(acc.Tags()["scalars"])
    assert tags == sorted({t for _, _, t, _ in FIXED}), tags
    for wall, step, tag, value in FIXED:
        (e,) = acc.Scalars(tag)
        assert e.step == step, (tag, e.step, step)
        assert e.wall_time == wall, (tag, e.wall_time, wall)
        assert e.value == f32(value), (tag, e.value, value)
    print("%s: %d scalars, every tag, step, value and wall_time as written"
          % (path, len(FIXED)))


def run(d, csv_dir):
    acc = accumulate(d)
    tags = sorted(acc.Tags()["scalars"])
    want = sorted("Train/Samples/" + m for m in METRICS)
    assert tags == want, tags
    n = 0
    for m in METRICS:
        ev = acc.Scalars("Train/Samples/" + m)
        with open(os.path.join(csv_dir, "Train_Samples_%s.csv" % m)) as f:
            rows = list(csv.reader(f))
        assert rows[0] == ["step", m], rows[0]
        rows = rows[1:]
        assert len(ev) == len(rows), (m, len(ev), len(rows))
        for e, (step, value) in zip(ev, rows):
            want_v = f32(float(value))
            ulp = f32_ulp(want_v)
            assert e.step == int(step), (m, e.step, step)
            assert abs(e.value - want_v) <= ulp * 1.0001, (m, e.value, value)
            n += 1
    print("%s: %d scalars of %d tags agree with %s" % (d, n, len(METRICS),
                                                       csv_dir))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "golden":
        golden(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "fixed":
        fixed(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
