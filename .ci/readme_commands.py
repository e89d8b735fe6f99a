"""The shell commands of the README sections a newcomer follows, one per line, for `.ci/readme_commands.sh`.

Reads the ```bash blocks of "## Quick start" and of the "Try the launch on a laptop first" bullet of
"## Training on GPUs", joins backslash continuations and drops comments. `git clone`, `python -m venv` and `pip install` lines are left
out (CI runs in a clone, where `.ci/run` has just installed the package in a fresh virtualenv).

    python .ci/readme_commands.py README.md
"""

import re
import sys
from pathlib import Path


SECTIONS = (
    (r"^## Quick start", r"^## "),
    (r"^- \*\*Try the launch on a laptop first\*\*", r"^(- \*\*|## )"),
)


def section(text: str, start: str, end: str) -> str:
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if re.match(start, line))
    last = next((i for i in range(first + 1, len(lines)) if re.match(end, lines[i])), len(lines))
    return "\n".join(lines[first:last])


def commands(text: str) -> list[str]:
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", "", "\n".join(line.strip() for line in block.splitlines()))
        for line in joined.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith(("#", "pip install", "git clone", "python -m venv")):
                found.append(line)
    return found


if __name__ == "__main__":
    readme = Path(sys.argv[1]).read_text(encoding="utf-8")
    for start, end in SECTIONS:
        for command in commands(section(readme, start, end)):
            print(command)
