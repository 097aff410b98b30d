"""bench/cpu_sitting.sh (issue 36's figures in one sitting): the script parses, and every
benchmark it runs exists and takes the options the script passes it (a renamed option would
otherwise surface only after a quarter of an hour of measuring)."""

from __future__ import annotations

import re
import subprocess

from mpiutil import ROOT

SITTING = ROOT / "bench" / "cpu_sitting.sh"


def test_sitting_script_parses_and_names_real_options():
    proc = subprocess.run(["bash", "-n", str(SITTING)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    calls = re.findall(r"(bench/\w+\.py)((?:\s+--[\w-]+(?:\s+[^\s-][^\s]*)?)*)",
                       SITTING.read_text())
    assert {c[0] for c in calls} >= {"bench/decoder.py", "bench/checkpoint.py",
                                      "bench/zo_pass.py", "bench/zo_step.py",
                                      "bench/embed.py", "bench/kmeans.py"}
    for script, args in calls:
        src = (ROOT / script).read_text()
        # options a script takes from a bench module it imports (zo_step.py: zo_step_llm.py)
        for mod in re.findall(r"^\s*from (\w+) import", src, re.MULTILINE):
            if (ROOT / "bench" / f"{mod}.py").is_file():
                src += (ROOT / "bench" / f"{mod}.py").read_text()
        for opt in re.findall(r"--[\w-]+", args):
            assert f'"{opt}"' in src, (script, opt)
