"""Everything is in setup.cfg, except the start-up hook that lets MXNet 1.9.1 import under
numpy >= 1.24 (Python 3.12+): startup/bps_gossip_numpy_aliases.py and its .pth go straight
into site-packages, whose path relative to the installation prefix only this interpreter knows.
"""

import os
import sysconfig

from setuptools import Distribution, setup

SITE_PACKAGES = os.path.relpath(sysconfig.get_path("purelib"), sysconfig.get_path("data"))


class WithDataInEditableInstalls(Distribution):
    """setuptools' editable_wheel installs data files only if the distribution answers
    ``has_data()``, which Distribution does not have (it has ``has_data_files()``): without
    this, ``pip install -e`` would leave the hook out."""

    def has_data(self) -> bool:
        return self.has_data_files()


setup(distclass=WithDataInEditableInstalls,
      data_files=[(SITE_PACKAGES, ["startup/bps_gossip_numpy_aliases.pth",
                                   "startup/bps_gossip_numpy_aliases.py"])])
