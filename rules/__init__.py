"""The shipped `.rule` library, installed as package data."""

from pathlib import Path

RULES_DIR = Path(__file__).resolve().parent
