"""The command lines a user can copy from a Markdown page's code blocks, as
tests/tooling/test_readme.py and tests/tooling/test_docs.py check them."""

import re


def code_block_commands(text: str, language: str = r"\w*") -> list[str]:
    """The lines of ``text``'s code blocks whose language matches ``language`` (any by default),
    each continued line joined to the next, comments left out, spaces made single."""
    found = []
    for block in re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            command = " ".join(re.sub(r"\s+#.*$", "", line).split())
            if command:
                found.append(command)
    return found
