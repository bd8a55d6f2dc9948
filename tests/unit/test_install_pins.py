"""setup.cfg's extras resolve at once on every supported Python (issue 33, item 10): pip tries
the newest release of each dependency first, and where that release needs a numpy the install
cannot have, it downloads it (scipy: 35 MB a try) and tries the next one down. On Python 3.11
the README's first command downloaded scipy 1.16.2, 1.16.1 and 1.16.0 before settling on 1.15.3.

Read from setup.cfg: numpy's range per Python, and each extra's bounds on the packages that
scikit-learn and matplotlib pull with any version; checked against the releases' own
requirements (their wheels' metadata, as of 2026-11)."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

SETUP_CFG = Path(__file__).resolve().parents[2] / "setup.cfg"
PYTHONS = ("3.8", "3.9", "3.10", "3.11", "3.12", "3.13")

# (package, the package that pulls it, Pythons): (the newest release that goes with numpy there,
# the oldest newer one pip would otherwise try first, what it needs). "1.18.0" is not out yet:
# on 3.12+ an upper bound keeps a future release that drops numpy 1 from being tried.
NEEDS = {
    ("scipy", "scikit-learn", "3.8"): ("1.10.1", None, None),  # the newest for 3.8 at all
    ("scipy", "scikit-learn", "3.9"): ("1.13.1", None, None),  # the newest for 3.9 at all
    ("scipy", "scikit-learn", "3.10"): ("1.15.3", None, None),  # 1.16 needs Python 3.11
    ("scipy", "scikit-learn", "3.11"): ("1.15.3", "1.16.0", "numpy >= 1.25.2"),
    ("scipy", "scikit-learn", "3.12"): ("1.17.1", "1.18.0", "a numpy 1.26 may not give"),
    ("scipy", "scikit-learn", "3.13"): ("1.17.1", "1.18.0", "a numpy 1.26 may not give"),
    ("contourpy", "matplotlib", "3.11"): ("1.3.2", "1.3.3", "numpy >= 1.25"),
    ("contourpy", "matplotlib", "3.12"): ("1.3.3", "1.4.0", "numpy >= 2"),
    ("contourpy", "matplotlib", "3.13"): ("1.3.3", "1.4.0", "numpy >= 2"),
}


def requirements(section: str, key: str, python: str) -> dict[str, Requirement]:
    """The requirements of ``key`` in ``section`` whose markers hold on ``python``, by name."""
    config = configparser.ConfigParser()
    config.read(SETUP_CFG)
    found = {}
    for line in config[section][key].strip().splitlines():
        requirement = Requirement(line.strip())
        if requirement.marker is None or requirement.marker.evaluate(
                {"python_version": python, "python_full_version": python + ".0"}):
            assert requirement.name not in found, f"{key}: two requirements of {requirement.name} on {python}"
            found[requirement.name] = requirement
    return found


def extras() -> list[str]:
    config = configparser.ConfigParser()
    config.read(SETUP_CFG)
    return list(config["options.extras_require"])


def test_numpy_is_below_1_24_up_to_3_11_and_1_26_after():
    for python in PYTHONS:
        numpy = requirements("options", "install_requires", python)["numpy"].specifier
        before_3_12 = Version(python) < Version("3.12")
        assert ("1.23.5" in numpy) == before_3_12 and ("1.26.4" in numpy) != before_3_12, python


@pytest.mark.parametrize("extra", extras())
def test_every_extra_bounds_what_would_not_resolve_at_once(extra):
    for (name, puller, python), (good, bad, why) in NEEDS.items():
        pulled = requirements("options.extras_require", extra, python)
        if puller not in pulled:
            continue
        assert name in pulled, f"[{extra}] on Python {python}: {puller} pulls any {name}; bound it"
        bound = pulled[name].specifier
        assert bound.contains(good), f"[{extra}] {name}{bound} leaves out {good}, which works on Python {python}"
        if bad is not None:
            assert not bound.contains(bad), f"[{extra}] {name}{bound} lets pip try {bad} ({why}) on Python {python}"

