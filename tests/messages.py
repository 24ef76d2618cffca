"""Checks on error messages that cannot be fooled by argparse's usage text (which lists every
flag) or by a flag that merely contains another one's name."""

import re
from typing import List


def names_flag(text: str, flag: str) -> bool:
    """``flag`` appears as a whole token: not a prefix of a longer flag (--lr in
    --lr-warmup-iters) nor the tail of one (--lr in --min-lr)."""
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def error_messages(text: str) -> List[str]:
    """The messages of ``PROG: error: MESSAGE`` lines, without the usage text before them."""
    return [line.split(": error: ", 1)[1] for line in text.splitlines() if ": error: " in line]


def error_line(text: str) -> str:
    """The one error message in ``text``."""
    messages = error_messages(text)
    assert len(messages) == 1, text
    return messages[0]
