"""Save time with telemetry off, on (spool sink) and on (Kafka sink to a local tansu broker).

Usage: python bench/telemetry_save_overhead.py [--params 32000000] [--repeats 7] [--storage mem|disk]

One process saves a model of ``--params`` float32 parameters plus AdamW state (so about
12 bytes per parameter), to memory (``mem://``, the default: no disk noise, and the
shortest save, so the largest relative overhead) or to local disk with fsync. Modes are
interleaved round by round, so drift in disk or CPU speed hits every mode alike. Printed
per mode: the median and the minimum save time, and the median over rounds of the
round's time relative to "off" in the same round.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _delete(target: str) -> None:
    if target.startswith("mem://"):
        from bytecheckpoint.storage import open_storage

        storage, path = open_storage(target)
        storage.delete(path)
    else:
        shutil.rmtree(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=32_000_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-kafka", action="store_true", help="skip the Kafka mode")
    parser.add_argument("--storage", choices=("mem", "disk"), default="mem")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

    import torch

    import bytecheckpoint as bcp
    import telemetry
    from telemetry import config

    torch.manual_seed(0)
    width = 4096
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(max(1, args.params // (width * width)))])
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optim.step()
    state = {"model": model, "optimizer": optim}
    n_params = sum(p.numel() for p in model.parameters())

    broker = None
    modes = ["off", "spool"]
    if not args.no_kafka:
        from tests.support.telemetry_servers import Broker

        broker = Broker()
        broker.start()
        modes.append("kafka")

    work = Path(tempfile.mkdtemp(prefix="bcp-bench-"))
    times: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for i in range(args.repeats + 1):  # the first round warms caches and is discarded
            for mode in modes:
                if mode == "off":
                    telemetry.configure(enabled=False, spool_dir=work / "spool")
                elif mode == "spool":
                    telemetry.configure(enabled=True, spool_dir=work / "spool")
                else:
                    telemetry.configure(enabled=True, kafka=broker.bootstrap, topic="bench",
                                        spool_dir=work / "spool")
                target = f"mem://bench/{mode}-{i}" if args.storage == "mem" else str(work / f"{mode}-{i}")
                start = time.perf_counter()
                bcp.save(target, state, framework="single", step=i)
                elapsed = time.perf_counter() - start
                telemetry.flush(timeout=30)
                if i:
                    times[mode].append(elapsed)
                _delete(target)
        stats = telemetry.stats()
    finally:
        config.reset()
        shutil.rmtree(work, ignore_errors=True)
        if broker is not None:
            broker.stop()

    size_gb = n_params * 12 / 1e9
    print(f"save of {n_params / 1e6:.1f}M params (~{size_gb:.2f} GB with AdamW state) to {args.storage}, "
          f"{args.repeats} rounds:")
    for mode in modes:
        med = statistics.median(times[mode])
        paired = statistics.median(t / off - 1 for t, off in zip(times[mode], times["off"]))
        runs = ", ".join(f"{t:.3f}" for t in times[mode])
        print(f"  {mode:6s} median {med:.3f} s  min {min(times[mode]):.3f} s  "
              f"paired {paired * 100:+.2f}% vs off   runs: {runs}")
    print(f"  telemetry counters: emitted {stats['emitted']}, dropped {stats['dropped']}, "
          f"sink errors {stats['sink_errors']}")


if __name__ == "__main__":
    main()
