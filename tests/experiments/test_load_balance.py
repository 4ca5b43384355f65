"""experiments/load_balance.py runs where grain is missing (the GPU machine has none)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_load_balance_imports_without_grain():
    code = (
        "import sys; sys.modules['grain'] = None; sys.modules['array_record'] = None\n"
        "import experiments.load_balance\n"
        "assert 'grain' not in sys.modules or sys.modules['grain'] is None\n"
        "print('ok')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
