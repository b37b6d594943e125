"""``import headline_scripts`` puts ``benchmarks/`` on the import path, after the study's own folder: a study then
imports a headline benchmark (``from kernel_h200 import bench``, ``import generate_speed``) as the headline scripts
import each other. Run as ``python benchmarks/studies/NAME.py``, a study finds this module beside it."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
if str(BENCHMARKS) not in sys.path:
    sys.path.append(str(BENCHMARKS))
