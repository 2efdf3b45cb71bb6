"""Run the README's command-line tour on a fresh store and write its real output.

    python -m bench.tour            # print the tour
    python -m bench.tour --write    # replace the tour block in README.md

Every command runs in a shell in a fresh folder with ``PERSIST_HOME`` set
there; the README shows exactly these commands (tests/test_tour.py checks),
with the output of the last run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
COMMANDS = [
    'persist generate --session work --prompt "The plan for today:" --max-tokens 24',
    'persist generate --session work --prompt " Next step:" --max-tokens 24',
    "persist ls",
    "persist show work",
    'persist generate --session c1 --chat --system-prompt "You are brief." --prompt "Hi"'
    " --max-tokens 8",
    'persist generate --session c2 --chat --system-prompt "You are brief." --prompt "Hey"'
    " --max-tokens 8",
    "persist show c2",
    "persist make-model tiny-qwen --arch qwen3_next",
    "python3 -c \"print('Section 1. Install the device. ' * 60)\" > manual.txt",
    "persist prime --model tiny-qwen --session manual --prompt-file manual.txt"
    " --checkpoint-every 256",
    'persist generate --model tiny-qwen --session question --prompt "$(head -c 1200 manual.txt)'
    ' What is step 2?" --max-tokens 8',
    "persist ls",
    "persist ls --all",
    "persist config set max-bytes 2G",
    "persist stats",
    "persist export work work.safetensors && persist inspect work.safetensors",
    "persist check",
    "persist gc --max-bytes 600K --dry-run",
    "persist show nope",
]
BLOCK = re.compile(r"(## Command line tour\n.*?```text\n)(.*?)(```\n)", re.S)


def run() -> str:
    tmp = Path(tempfile.mkdtemp())
    env = {**os.environ, "PERSIST_HOME": str(tmp / "store"), "PYTHONIOENCODING": "utf-8"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    out = []
    try:
        for cmd in COMMANDS:
            res = subprocess.run(
                cmd, shell=True, cwd=tmp, env=env, capture_output=True, text=True, errors="replace"
            )
            out.append(f"$ {cmd}")
            out += [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
            if res.returncode:
                out.append(f"(exit {res.returncode})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    tour = run()
    if not args.write:
        print(tour, end="")
        return
    text = README.read_text()
    if not BLOCK.search(text):
        raise SystemExit("README.md has no tour block to replace")
    README.write_text(BLOCK.sub(lambda m: m.group(1) + tour + m.group(3), text, count=1))


if __name__ == "__main__":
    main()
