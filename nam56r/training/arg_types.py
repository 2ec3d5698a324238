"""argparse value types the project's command lines share."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer of 1 or more; argparse reports anything else as a usage error."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
