"""Storage and tracking URLs as people may see them.

Its own module because both the MLflow logger (`tracking`) and the start-up locks (`locks`, which
`tracking` uses) print URLs in their messages.
"""

from __future__ import annotations

import re


def redact(url: str) -> str:
    """A storage URL with its password hidden, fit for a tag or a report."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", str(url))
