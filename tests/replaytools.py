"""A Python that has numpy and nothing else, to run a bundle's replay.py as a maintainer would
(imported by the repro tests)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np


def numpy_only_python(root: Path) -> str:
    """A fresh virtual environment under ``root`` whose packages are numpy and nothing else (no pip:
    numpy is linked from this one's); run it with `-I` to keep the environment's variables out too.
    Checked: it imports numpy and cannot import kestrel_tui."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    py = str(root / "venv" / "bin" / "python")
    site = subprocess.run([py, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    src = Path(np.__file__).parent
    for name in (src.name, src.name + ".libs"):
        if (src.parent / name).exists():
            os.symlink(src.parent / name, Path(site) / name)
    probe = subprocess.run([py, "-I", "-c", "import numpy\ntry:\n import kestrel_tui\nexcept ImportError:\n"
                            " print('numpy only')"], capture_output=True, text=True)
    assert probe.stdout.strip() == "numpy only", probe.stderr
    return py


def copy_away(folder: Path, where: Path) -> Path:
    """The bundle copied to ``where`` (outside the repository, as it travels by mail)."""
    copy = where / folder.name
    shutil.copytree(folder, copy, symlinks=True)
    return copy


def run_replay(py: str, copy: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -I replay.py` in the bundle's folder."""
    return subprocess.run([py, "-I", "replay.py"], cwd=copy, capture_output=True, text=True, timeout=timeout)
