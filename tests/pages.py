"""README.md and docs/*.md as the tests read them: their fenced blocks and the shell commands in them."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]
TEXTS = {page.relative_to(ROOT).as_posix(): page.read_text() for page in PAGES}
README = '\n'.join(TEXTS.values())  # every page, for what is searched across them


def blocks(language):
    """(section heading, code) of each ```language block, page by page (README first), in page order."""
    found = []
    for text in TEXTS.values():
        heading = None
        for match in re.finditer(r'^(#+) ([^\n]*)$|^```' + language + r'\n(.*?)^```', text, re.M | re.S):
            if match.group(1):
                heading = match.group(2).strip()
            else:
                found.append((heading, match.group(3)))
    return found


def commands(heading=None):
    """The shell commands of the ```bash blocks (of the sections named `heading`, if given), comments cut,
    continuation lines joined."""
    found = []
    for section, code in blocks('bash'):
        if heading is not None and section != heading:
            continue
        for line in code.replace('\\\n', ' ').splitlines():
            command = re.sub(r'\s+', ' ', line.split(' #')[0]).strip()
            if command:
                found.append(command)
    return found
