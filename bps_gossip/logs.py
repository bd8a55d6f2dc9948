"""Logging set-up from BYTEPS_LOG_LEVEL (TRACE and FATAL map onto DEBUG and CRITICAL)."""

from __future__ import annotations

import logging

_LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
}


def get_logger(role: str, level: str = "WARNING") -> logging.Logger:
    """A logger named ``bps_gossip.<role>`` writing to stderr at ``level``."""
    logger = logging.getLogger(f"bps_gossip.{role}")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[bps_gossip {role} %(asctime)s %(levelname)s] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(_LEVELS.get(level, logging.WARNING))
    return logger
