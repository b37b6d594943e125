"""``import headline_scripts`` puts ``benchmarks/`` on the import path, after the study's own folder: a study then
imports a headline benchmark (``from kernel_h200 import bench``, ``import generate_speed``) as the headline scripts
import each other. Run as ``python benchmarks/studies/NAME.py``, a study finds this module beside it."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
if str(BENCHMARKS) not in sys.path:
    sys.path.append(str(BENCHMARKS))


def sweep(argv: list[str], doc: str, measure, gpu: list[tuple], cpu: list[tuple], check: str) -> int:
    """A GPU study's command line: each configuration of ``gpu`` timed on CUDA, or with ``--cpu`` each of ``cpu`` (small
    ones, untimed: a check that runs under Triton's interpreter); ``measure(*configuration, device, timed)`` → a
    record, printed; the records written to the first argument that is not an option, if any, under the study's
    ``doc`` (its first paragraph). Exit status 0 where every record's ``check`` holds."""
    import json

    import torch

    on_cpu = "--cpu" in argv
    paths = [a for a in argv if not a.startswith("--")]
    device = torch.device("cpu" if on_cpu else "cuda")
    records = []
    for configuration in cpu if on_cpu else gpu:
        records.append(measure(*configuration, device, timed=not on_cpu))
        print(json.dumps(records[-1]), flush=True)
    if paths:
        with open(paths[0], "w") as out:
            json.dump({"what": doc.split("\n\n")[0], "device": str(device), "runs": records}, out, indent=1)
    return 0 if all(record[check] for record in records) else 1
